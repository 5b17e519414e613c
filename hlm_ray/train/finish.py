"""The end of a training run: its summary (returned, and written as summary.json), what a
budget became, and the artifacts rank 0 logs.

    summary = finish_run(run)   # {"objective", "steps", "tokens", "tokens_per_s", "metrics", ...}
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from hlm_ray.budget import budget_params, flops_per_step
from hlm_ray.models import num_parameters
from hlm_ray.train.run_lock import check_writer
from hlm_ray.train.run_state import TrainRun
from hlm_ray.train.run_tracking import log_artifacts


def finish_run(run: TrainRun) -> dict[str, Any]:
    """Log the artifacts (rank 0) and return (and write) the run summary."""
    cfg, out_dir = run.cfg, run.out_dir
    steps_run = run.done - run.start
    summary = {
        "objective": cfg.objective.name,
        "arch": cfg.model.arch,
        "steps": run.done,
        "tokens": run.done * run.tokens_per_step,
        "tokens_per_s": (
            steps_run * run.tokens_per_step / run.train_time
            if run.train_time
            else earlier_tokens_per_s(run)
        ),
        "vocab_size": len(run.tokenizer),
        "parameters": num_parameters(run.model),
        "metrics": run.last or run.resumed_metrics,  # no step ran: the checkpoint's
        "model_dir": str(out_dir / "model"),
        # Where the worker's time went (rank 0): building model and data, the optimizer steps
        # (train), checkpoints with their reports, everything (worker); entered_at is the wall
        # clock the launcher compares with its own.
        "seconds": {
            "setup": run.setup_s,
            "train": run.train_time,
            "checkpoint": run.checkpoint_s,
            "worker": time.perf_counter() - run.entered,
            "entered_at": run.entered_at,
        },
        # Each optimizer step's wall seconds, from step `start` + 1 (this attempt's): a speed
        # comparison's interval is made from them (`hlm_ray.tune.speed`).
        "step_seconds": {
            "first_step": run.start + 1,
            "values": [round(t, 6) for t in run.step_times],
        },
    }
    if run.budget is not None:
        summary["budget"] = budget_outcome(run)
    if run.env.is_main:  # NaN is not JSON: a number that could not be measured is null
        check_writer()  # an orphaned worker (its driver gone) leaves the run unfinished
        (out_dir / "summary.json").write_text(json.dumps(_no_nan(summary), indent=1))
        log_artifacts(run.tracker, out_dir, cfg)  # after summary.json: the model card reads it
    return summary


def earlier_tokens_per_s(run: TrainRun) -> float | None:
    """Throughput of a run resumed with no step left to train (killed after its last
    checkpoint, or a finished run resumed): its earlier summary's, for the same steps; else the
    last log window's, saved with the checkpoint; else None. It was NaN, beside empty metrics."""
    path = run.out_dir / "summary.json"
    try:
        earlier = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:  # an unreadable summary is rewritten here
        earlier = {}
    value = earlier.get("tokens_per_s") if earlier.get("steps") == run.done else None
    value = value if value is not None else run.resumed_metrics.get("train/tokens_per_s")
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _no_nan(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    return value


def budget_outcome(run: TrainRun) -> dict[str, Any]:
    """What the budget became, and what the run spent (rank 0 logs it): the steps run and,
    with the last measured U (`train/U`), the FLOPs per step the data really cost."""
    plan = run.budget
    out = {**budget_params(plan), "budget/steps_run": run.done}
    out["budget/train_seconds"] = run.prior_seconds + run.train_time
    out["budget/flops_per_step"] = plan.flops_per_step
    if "train/U" in run.last:
        measured = flops_per_step(
            run.cfg,
            len(run.tokenizer),
            world_size=run.env.world_size,
            unique_columns=int(run.last["train/U"]),
        )
        out["budget/flops_per_step_measured"] = measured
    numbers = {k: float(v) for k, v in out.items() if isinstance(v, int | float)}
    run.tracker.log_metrics(numbers, step=run.done)
    return out
