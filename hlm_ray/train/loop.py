"""The per-worker training function: the same code runs in one process or on Ray Train workers.

    summary = train_worker(cfg.to_dict())                         # one process
    summary = train_worker(cfg.to_dict(), env=WorkerEnv(...), reporter=..., tracking=...)

This module is the loop alone: when to step, log, validate and checkpoint, and when to stop (the
last step, or `budget.seconds` spent). Each of those is its own module (the package docstring,
`hlm_ray/train/__init__.py`, maps them).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from hlm_ray.budget import deadline_passed
from hlm_ray.config import Config
from hlm_ray.console import Lines
from hlm_ray.train.finish import finish_run
from hlm_ray.train.log_window import check_before_checkpoint, log_window
from hlm_ray.train.run_checkpoints import BEST, keep_final_model, save_checkpoint
from hlm_ray.train.run_state import LocalReporter, TrainRun, WorkerEnv
from hlm_ray.train.setup import quiet_library_progress_bars, setup_run
from hlm_ray.train.step import train_step
from hlm_ray.train.validate import evaluate

__all__ = ["BEST", "LocalReporter", "WorkerEnv", "evaluate", "train_worker"]


def train_worker(
    config: dict[str, Any],
    *,
    env: WorkerEnv | None = None,
    reporter: LocalReporter | None = None,
    tracking: dict[str, Any] | None = None,
    resume_from: str | Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train to `optim.max_steps`; returns the run summary (rank 0's view).

    `tracking` ({"uri": ..., "run_id": ...}) makes rank 0 log to that MLflow run as well as to
    `<output_dir>/metrics.jsonl`; the caller opened the run and closes it."""
    entered, entered_at = time.perf_counter(), time.time()  # for summary["seconds"]
    cfg = Config.from_dict(config)
    quiet_library_progress_bars()
    run = setup_run(cfg, env, reporter, tracking, resume_from)
    run.entered, run.entered_at = entered, entered_at
    cfg = run.cfg  # with the steps a budget became
    terminal = sys.stderr.isatty()
    bar = tqdm(
        total=cfg.optim.max_steps,
        initial=run.start,
        disable=not (progress and run.env.is_main),
        desc=f"{cfg.objective.name} {cfg.model.arch}",
        dynamic_ncols=terminal,
        # A Ray worker's output goes to the driver's console line by line: whole lines there
        # (no carriage returns, no clearing), and rarely.
        file=sys.stderr if terminal else Lines(sys.stderr),
        mininterval=0.1 if terminal else 10.0,
    )
    run.model.train()
    run.window_start = time.perf_counter()
    run.setup_s = run.window_start - entered
    seconds = cfg.budget.seconds
    first = cfg.optim.max_steps if deadline_passed(run.prior_seconds, seconds) else run.start
    for step in range(first, cfg.optim.max_steps):
        if cfg.run.fail_at_step == step and run.env.rank == run.env.world_size - 1:
            _inject_failure(run.out_dir, step)
        train_step(run, step)
        done = run.done = step + 1
        bar.update(1)
        out_of_time = deadline_passed(run.prior_seconds + run.train_time, seconds)
        final = done == cfg.optim.max_steps or out_of_time
        if done % cfg.run.log_every == 0 or final:
            log_window(run, done)
            if "train/loss" in run.last:  # absent when every step of the window was skipped
                bar.set_postfix(loss=f"{run.last['train/loss']:.3f}")
        if done % cfg.run.eval_every == 0 or final:
            _evaluate_now(run, done)
        if done % cfg.run.checkpoint_every == 0 or final:
            if not (done % cfg.run.log_every == 0 or final):
                check_before_checkpoint(run, done)
            save_checkpoint(run, done, final)
        if out_of_time:
            break
    bar.close()
    if run.done == run.start and resume_from is not None and run.env.is_main:
        keep_final_model(run.out_dir, Path(resume_from))  # no step ran here to write it
    return finish_run(run)


def _evaluate_now(run: TrainRun, done: int) -> None:
    """Validation at an eval step (`evaluate` is looked up here: tests script its result)."""
    val = evaluate(
        run.module, run.corpus.val, run.cfg, run.env, run.masking, run.token_bytes, run.amp
    )
    run.tracker.log_metrics(val, step=done)
    run.last.update(val)
    run.window_start = time.perf_counter()  # evaluation is not training time


def _inject_failure(out_dir: Path, step: int) -> None:
    """Fault injection (tests): fail once at `step`; the marker file makes the retry pass."""
    marker = out_dir / f".failed_at_{step}"
    if not marker.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        marker.touch()
        raise RuntimeError(f"injected failure at step {step} (run.fail_at_step)")
