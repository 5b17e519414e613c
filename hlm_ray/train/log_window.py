"""The metrics of the steps since the last log line: loss, K, U, throughput, MFU, memory.

    log_window(run, done)    # at log steps; logs `train/*` through the run's tracker
    U = measured_unique_columns(input_ids_BL, labels_BL, negatives_N)

Loss values stay on the device between log steps; the window reads them with one collective
(averaged over workers and steps) and resets them, so a step never waits for the host.
"""

from __future__ import annotations

import math
import time

import torch

from hlm_ray.errors import HLMError
from hlm_ray.flops import config_step_flops, k_tags, mfu
from hlm_ray.train.distributed import global_mean
from hlm_ray.train.lm_objective import LMObjective
from hlm_ray.train.run_state import TrainRun


def log_window(run: TrainRun, done: int) -> None:
    """The metrics of the steps since the last log line (the one sync per window)."""
    elapsed = time.perf_counter() - run.window_start
    steps = run.window_steps
    # The loss and K per micro-batch, averaged over workers and steps (one collective).
    loss_sum, rows_sum = global_mean(torch.stack([run.loss_sum, run.rows_sum])).tolist()
    kept = steps - run.window_skipped  # skipped steps (on_nonfinite=skip) add no loss
    if kept:
        check_finite_loss(loss_sum / kept, done, steps)
    rows, before = rows_sum / steps, run.last.get("train/K")
    run.last = {
        "train/lr": run.scheduler.get_last_lr()[0],
        "train/grad_norm": float(run.grad_norm),
        "train/step_time_s": elapsed / steps,
        "train/tokens_per_s": run.tokens_per_step * steps / elapsed,
        "train/K": rows,  # a masked LM's K varies by micro-batch (~15% of positions): the mean
        **peak_memory(run.env.device),
    }
    if kept:  # a window of skipped steps only has no loss
        run.last["train/loss"] = loss_sum / kept
    if run.cfg.optim.on_nonfinite == "skip":
        run.last["train/skipped_steps"] = float(run.skipped)
    # Measured U: distinct ids among the last micro-batch's negatives (all workers' with
    # cross-worker negatives); the FLOP model and MFU use it, not the bound min(W·K, V).
    U = measured_unique_columns(*run.last_batch)
    cost = config_step_flops(
        run.cfg, len(run.tokenizer), world_size=run.env.world_size, unique_columns=U
    )
    run.last["train/U"] = float(U)
    run.last["train/flops_per_token"] = cost.per_token
    utilisation = mfu(cost.per_token * run.last["train/tokens_per_s"], run.peak_flops)
    if utilisation is not None:
        run.last["train/mfu"] = utilisation / run.env.world_size  # peak is per device
    run.tracker.log_metrics(run.last, step=done)
    if rows != before:  # the tags say what the metric says
        run.tracker.set_tags(k_tags(rows, len(run.tokenizer)))
    run.loss_sum.zero_()
    run.rows_sum.zero_()
    run.window_steps, run.window_skipped, run.window_start = 0, 0, time.perf_counter()


def check_finite_loss(loss: float, done: int, steps: int) -> None:
    """Stop a diverged run at the log step that sees it: a NaN or inf loss never recovers, and
    going on would spend the budget and then save and register NaN weights. Raised before the
    window is logged or checkpointed, so the newest checkpoint is the last good one."""
    if not math.isfinite(loss):
        first = done - steps + 1
        raise HLMError(
            f"training diverged: the loss is {loss} at step {done} (first non-finite in steps "
            f"{first}..{done}); the run stops, its last good checkpoint is kept; lower optim.lr "
            "or set optim.grad_clip"
        )


def check_before_checkpoint(run: TrainRun, done: int) -> None:
    """`check_finite_loss` at a checkpoint step that is not a log step (one collective), so a
    checkpoint never holds the weights of a diverged run."""
    kept = run.window_steps - run.window_skipped
    if kept:  # a skipped step's loss is not in the sum, and left the weights as they were
        loss = global_mean(run.loss_sum.detach().clone()).item() / kept
        check_finite_loss(loss, done, run.window_steps)


def measured_unique_columns(
    input_ids: torch.Tensor, labels: torch.Tensor | None, negatives: torch.Tensor | None
) -> int:
    """U of one micro-batch: distinct target ids, or distinct ids among all workers' negatives
    when they were gathered (one host sync; called at log steps only)."""
    ids = negatives if negatives is not None else LMObjective.target_ids(input_ids, labels)
    return int(torch.unique(ids).numel())


def peak_memory(device: torch.device) -> dict[str, float]:
    """`train/peak_mem_mb`: the device's peak allocation, or on a CPU the process's peak RSS."""
    if device.type == "cuda":
        return {"train/peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20}
    import resource

    # CPU: the process's peak resident set (KiB on Linux), the closest thing to device memory.
    return {"train/peak_mem_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
