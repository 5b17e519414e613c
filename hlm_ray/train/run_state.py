"""What one training worker holds while it trains: where it sits, where it saves, its state.

    env = WorkerEnv(rank=0, world_size=1, device=torch.device("cpu"))
    reporter = LocalReporter(Path("runs/x"), keep=2)   # Ray Train workers get a RayReporter
    run = setup_run(cfg, env, reporter, tracking, resume_from)   # a TrainRun (train/setup.py)

`TrainRun` is built by `hlm_ray.train.setup`, advanced by `hlm_ray.train.step`, read by the log
window, validation, checkpointing and the run's finish; it is plain data, with no behaviour.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hlm_ray.config import Config
from hlm_ray.data import BlockSampler
from hlm_ray.tracking import Tracker
from hlm_ray.train import checkpoint as ckpt
from hlm_ray.train.inputs import Masking


@dataclass
class WorkerEnv:
    """Where this worker sits. Ray Train fills it from its context; one process is rank 0 of 1."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    nodes: tuple[str, ...] = ()
    """Each rank's node address, in rank order (Ray Train workers; empty in one process)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class LocalReporter:
    """Checkpoints in `<output_dir>/checkpoint_*`, keeping the newest `keep`."""

    def __init__(self, output_dir: Path, keep: int):
        self.root = Path(output_dir)
        self.keep = keep

    def report(self, metrics: dict[str, float], checkpoint_dir: Path | None) -> None:
        if checkpoint_dir is not None:
            ckpt.prune_checkpoints(self.root, self.keep)

    def checkpoint_folder(self, step: int) -> Path:
        return self.root / f"{ckpt.PREFIX}{step:08d}"


@dataclass
class TrainRun:
    """One worker's training run: what was built, and the counters the loop advances."""

    cfg: Config
    env: WorkerEnv
    out_dir: Path
    reporter: LocalReporter
    tracker: Tracker
    tokenizer: Any
    corpus: Any
    model: torch.nn.Module
    module: torch.nn.Module
    """The LMObjective (DDP-wrapped with more than one worker): its forward returns the loss."""
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    amp: torch.dtype | None
    sampler: BlockSampler
    masking: Masking | None
    token_bytes: torch.Tensor
    """Each token id's byte length (for the validation bits per byte of a vocabulary head)."""
    peak_flops: float | None
    accum: int
    start: int
    """The step training starts from (0, or the resumed checkpoint's)."""
    train_time: float = 0.0
    step_times: list[float] = field(default_factory=list)
    """Wall seconds of each optimizer step of this attempt (summary.json's `step_seconds`: the
    sweeps' speed intervals are made from them)."""
    window_start: float = field(default_factory=time.perf_counter)
    window_steps: int = 0
    window_skipped: int = 0
    """Steps of the window whose update `optim.on_nonfinite=skip` dropped (not in `loss_sum`)."""
    skipped: int = 0  # this attempt's skipped steps, all told
    skipped_in_a_row: int = 0
    loss_sum: torch.Tensor | None = None
    grad_norm: float = math.nan
    rows_sum: torch.Tensor | None = None  # loss rows (K) per micro-batch, summed over the window
    setup_s: float = 0.0
    checkpoint_s: float = 0.0
    entered: float = 0.0
    entered_at: float = 0.0
    last_batch: tuple | None = None
    """(input_ids, labels, negatives) of the last micro-batch."""
    best_val: float = math.inf
    last: dict[str, float] = field(default_factory=dict)
    resumed_metrics: dict[str, float] = field(default_factory=dict)
    """The metrics the resumed checkpoint was saved with: the summary of a run resumed with no
    step left to train (its `last` stays empty)."""
    budget: Any = None
    """What `budget.*` became (`hlm_ray.budget.BudgetPlan`), or None."""
    prior_seconds: float = 0.0
    """Training seconds of the steps before the resumed checkpoint (for budget.seconds)."""
    done: int = 0
    target_counts: torch.Tensor | None = None
    """(V,) int64 on the device: this rank's target tokens of the steps applied so far (rank 0
    also holds the resumed checkpoint's sum); `hlm_ray.train.token_counts`."""
    counts_unknown: bool = False
    """Resumed from a checkpoint without counts: the earlier steps' tokens are not known."""

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.optim.global_batch_size * self.cfg.data.seq_len
