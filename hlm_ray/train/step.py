"""One optimizer step of one worker: its micro-batches of the step's global batch, then update.

    train_step(run, step)   # run: a TrainRun (hlm_ray.train.run_state); advances its counters

The step's global batch is a pure function of (seed, step) (`BlockSampler.shard`), so a resumed
run needs no sampler state. `grad_accum` micro-batches of `optim.micro_batch_size` sequences
each (K for CWT comes from one micro-batch), then clip and step. The loss stays on the device
(summed into `run.loss_sum`): no host sync per step; the log window reads it.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time

import torch

from hlm_ray.device import autocast
from hlm_ray.errors import HLMError
from hlm_ray.train.distributed import gather_negative_ids
from hlm_ray.train.inputs import load_batch, stream_seed
from hlm_ray.train.lm_objective import LMObjective
from hlm_ray.train.optim import clip_grad_norm
from hlm_ray.train.run_state import TrainRun
from hlm_ray.train.token_counts import count_targets_


def train_step(run: TrainRun, step: int) -> None:
    """One optimizer step: this worker's `accum` micro-batches of the step's global batch, then
    clip and update. The loss stays on the device (summed into `run.loss_sum`)."""
    cfg, env = run.cfg, run.env
    step_start = time.perf_counter()
    micro_batches = run.sampler.shard(step, env.rank, env.world_size, cfg.optim.micro_batch_size)
    step_loss = torch.zeros((), device=run.loss_sum.device)
    step_counts = torch.zeros_like(run.target_counts)  # (V,) the step's target ids, no sync
    for i, idx in enumerate(micro_batches):
        input_ids, labels = load_batch(
            run.corpus.train, idx, env, run.masking, cfg.run.seed, step, i
        )
        count_targets_(step_counts, input_ids, labels)
        negatives = None
        if cfg.objective.cross_worker_negatives:
            negatives = gather_negative_ids(LMObjective.target_ids(input_ids, labels))
        sync = i == len(micro_batches) - 1 or env.world_size == 1
        seed = stream_seed(cfg.run.seed, step, env.rank, i)
        with _no_sync(run.module, sync), autocast(env.device, run.amp):
            out = run.module(input_ids, labels, negative_ids=negatives, negative_seed=seed)["loss"]
        run.scaler.scale(out.loss / run.accum).backward()
        step_loss += out.loss.detach() / run.accum
        # An int for CWT and decoders, a 0-d tensor for the masked vanilla loss: no sync here.
        run.rows_sum += out.num_rows / run.accum
    run.scaler.unscale_(run.optimizer)
    # Sparse-aware (the lazy embedding update's gradient): torch's clip_grad_norm_ raises.
    run.grad_norm = clip_grad_norm(run.model.parameters(), cfg.optim.grad_clip or float("inf"))
    if cfg.optim.on_nonfinite == "skip" and not keep_update(run, step):
        run.window_skipped += 1  # the weights and the optimizer's moments stay as they were
    else:
        run.scaler.step(run.optimizer)
        run.loss_sum += step_loss
        run.target_counts += step_counts
    run.scaler.update()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.last_batch = (input_ids, labels, negatives)  # for the measured U at log steps
    took = time.perf_counter() - step_start
    run.train_time += took
    run.step_times.append(took)
    run.window_steps += 1


def keep_update(run: TrainRun, step: int) -> bool:
    """`optim.on_nonfinite=skip`: whether step `step`'s update is applied. Decided on the
    gradient norm, the same on every worker after DDP's all-reduce (a non-finite loss anywhere
    makes it non-finite), so all workers skip together; reading it is one host sync per step.
    HLMError after `optim.max_skipped_steps` skipped steps in a row."""
    if math.isfinite(float(run.grad_norm)):
        run.skipped_in_a_row = 0
        return True
    run.skipped += 1
    run.skipped_in_a_row += 1
    limit = run.cfg.optim.max_skipped_steps
    if run.skipped_in_a_row > limit:
        first = step - run.skipped_in_a_row + 1
        raise HLMError(
            f"training diverged: the gradient is {float(run.grad_norm)} at step {step + 1}, "
            f"{run.skipped_in_a_row} steps in a row (steps {first + 1}..{step + 1}), more than "
            f"optim.max_skipped_steps={limit}; the run stops, its last good checkpoint is kept; "
            "lower optim.lr or set optim.grad_clip"
        )
    if run.env.rank == 0:
        print(
            f"step {step + 1}: the gradient is {float(run.grad_norm)}; its update is skipped "
            f"(optim.on_nonfinite=skip; {run.skipped_in_a_row} in a row)",
            file=sys.stderr,
            flush=True,
        )
    return False


def _no_sync(module, sync: bool):
    """DDP's gradient all-reduce only on the last micro-batch of a step."""
    if sync or not hasattr(module, "no_sync"):
        return contextlib.nullcontext()
    return module.no_sync()
