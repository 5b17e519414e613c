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
            steps_run * run.tokens_per_step / run.train_time if run.train_time else math.nan
        ),
        "vocab_size": len(run.tokenizer),
        "parameters": num_parameters(run.model),
        "metrics": run.last,
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
    if run.env.is_main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        log_artifacts(run.tracker, out_dir, cfg)  # after summary.json: the model card reads it
    return summary


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
