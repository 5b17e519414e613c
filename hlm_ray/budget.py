"""Budgets in compute, not steps: "similar compute" said once, in the config (`budget.*`).

    cfg = apply_overrides(cfg, {"budget.flops": 3e13})     # or budget.tokens, budget.seconds
    cfg, plan = resolve_budget(cfg, vocab_size=len(tokenizer), world_size=2, unique_columns=U)
    cfg.optim.max_steps == plan.steps                      # the schedule spans these steps
    tracker.log_metrics(budget_metrics(plan), step=0)      # budget/value, steps, flops_per_step

    hlm train --preset tiny-decoder --objective headless --set budget.flops=3e13
    python sweeps/batch_size.py --preset tiny --set budget.tokens=2e6

One optimizer step (`hlm_ray.train.step`) is `global_batch_size` sequences of `seq_len` tokens
over all workers: `global_batch_size / micro_batch_size` micro-batches (workers × gradient
accumulation), each priced by `hlm_ray.flops.config_step_flops`. So

    tokens per step = global_batch_size × seq_len
    FLOPs per step  = config_step_flops(cfg, V, world_size, U).total × global / micro

and a budget becomes ``steps = floor(budget / per step)``: the run never spends more than its
budget, and a budget smaller than one step is refused. At equal FLOPs two arms' step counts are
in the inverse ratio of their FLOPs per step (up to that floor).

The dedup CWT's FLOPs depend on U, the distinct target ids of a micro-batch, which only the data
knows: `budget.unique_columns` gives it, else the worker measures it on the run's first
micro-batch before training (`budget/unique_columns`) and logs the whole run's last measured
`train/U` and the FLOPs it implies at the end (`budget/flops_per_step_measured`). Where no data
is at hand (`hlm_ray.plan`'s dry run) the bound U = min(W·K, V) is used: an upper bound on the
FLOPs, so at most the steps a run gets.

`budget.warmup_share` makes the warm-up that share of the steps a budget becomes (at least one):
runs whose budgets buy 10 or 1,000 steps warm up alike.

`budget.seconds` is a deadline, not a step count: the loop stops at the first step that ends
past it (`deadline_passed`, agreed by all workers), saves a checkpoint and logs the steps it
became; `optim.max_steps` stays the cap and the schedule's length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hlm_ray.config import Config, apply_overrides
from hlm_ray.errors import HLMError
from hlm_ray.flops import config_step_flops


@dataclass(frozen=True)
class BudgetPlan:
    """What a budget became for one run."""

    kind: str
    """tokens | flops | seconds."""
    value: float
    """The budget, in its own unit."""
    steps: int
    """Optimizer steps (for seconds: the cap, optim.max_steps)."""
    tokens_per_step: int
    flops_per_step: float
    """FLOPs of one optimizer step over all workers, with U = `unique_columns`."""
    unique_columns: int | None
    """U the FLOPs were priced with (None: the objective has no dedup CWT columns)."""
    unique_columns_source: str
    """Where U came from: budget.unique_columns, measured, or the bound min(W·K, V)."""


def budget_kind(cfg: Config) -> str | None:
    """The budget that is set (tokens, flops or seconds), or None."""
    b = cfg.budget
    return next((k for k in ("tokens", "flops", "seconds") if getattr(b, k) is not None), None)


def tokens_per_step(cfg: Config) -> int:
    return cfg.optim.global_batch_size * cfg.data.seq_len


def flops_per_step(
    cfg: Config, vocab_size: int, *, world_size: int = 1, unique_columns: int | None = None
) -> float:
    """FLOPs of one optimizer step: every micro-batch of the global batch, all workers."""
    micro = config_step_flops(cfg, vocab_size, world_size=world_size, unique_columns=unique_columns)
    return micro.total * (cfg.optim.global_batch_size // cfg.optim.micro_batch_size)


def _dedup_columns(cfg: Config) -> bool:
    """Whether the objective scores de-duplicated CWT columns, whose FLOPs depend on U."""
    o = cfg.objective
    return o.name in ("headless", "mixed") and o.cwt_variant != "plain" and o.num_negatives is None


def needs_unique_columns(cfg: Config) -> bool:
    """Whether the worker should measure U before resolving the budget."""
    return budget_kind(cfg) is not None and _dedup_columns(cfg) and not cfg.budget.unique_columns


def resolve_budget(
    cfg: Config,
    vocab_size: int,
    *,
    world_size: int = 1,
    unique_columns: int | None = None,
) -> tuple[Config, BudgetPlan | None]:
    """`cfg` with `optim.max_steps` = the budget's steps, and what the budget became; `cfg`
    unchanged and None without a budget. `unique_columns`: U measured on the data (used when
    `budget.unique_columns` is not set; without either, the bound min(W·K, V))."""
    kind = budget_kind(cfg)
    if kind is None:
        return cfg, None
    if not _dedup_columns(cfg):
        u, source = None, "not used"
    elif cfg.budget.unique_columns is not None:
        u, source = cfg.budget.unique_columns, "budget.unique_columns"
    elif unique_columns is not None:
        u, source = unique_columns, "measured on the first micro-batch"
    else:
        u, source = None, "bound min(W·K, V)"
    per_step_flops = flops_per_step(cfg, vocab_size, world_size=world_size, unique_columns=u)
    per_step_tokens = tokens_per_step(cfg)
    value = float(getattr(cfg.budget, kind))
    if kind == "seconds":
        steps = cfg.optim.max_steps
    else:
        per_step = per_step_tokens if kind == "tokens" else per_step_flops
        steps = math.floor(value / per_step)
        if steps < 1:
            unit = "tokens" if kind == "tokens" else "FLOPs"
            raise HLMError(
                f"budget.{kind}={value:g} is less than one optimizer step ({per_step:.4g} "
                f"{unit} per step); raise the budget or lower optim.global_batch_size"
            )
        cfg = apply_overrides(cfg, {"optim.max_steps": steps})
    if cfg.budget.warmup_share is not None:
        warmup = max(1, round(cfg.budget.warmup_share * steps))
        cfg = apply_overrides(cfg, {"optim.warmup_steps": warmup})
    plan = BudgetPlan(kind, value, steps, per_step_tokens, per_step_flops, u, source)
    return cfg, plan


def budget_metrics(plan: BudgetPlan) -> dict[str, float]:
    """The numbers a budgeted run logs at step 0 (its kind goes to the params and tags)."""
    out = {
        "budget/value": plan.value,
        "budget/steps": float(plan.steps),
        "budget/tokens_per_step": float(plan.tokens_per_step),
        "budget/flops_per_step": plan.flops_per_step,
    }
    if plan.unique_columns is not None:
        out["budget/unique_columns"] = float(plan.unique_columns)
    return out


def budget_params(plan: BudgetPlan) -> dict[str, str | float | int]:
    return {
        "budget/kind": plan.kind,
        "budget/value": plan.value,
        "budget/steps": plan.steps,
        "budget/unique_columns_source": plan.unique_columns_source,
    }


def deadline_passed(train_seconds: float, budget_seconds: float | None) -> bool:
    """Whether training time has passed `budget.seconds`, agreed by every worker (rank 0's
    clock decides, so all workers stop at the same step: one broadcast per step)."""
    if budget_seconds is None:
        return False
    passed = train_seconds >= budget_seconds
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([1.0 if passed else 0.0])
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.broadcast(flag, src=0)
        passed = bool(flag.item())
    return passed


def first_step_unique_columns(micro_batch, ranks: range) -> int:
    """U of step 0's first micro-batch: distinct target ids over `ranks` (all workers with
    cross-worker negatives, else rank 0). `micro_batch(rank)` returns that rank's target ids;
    the data order is a function of (seed, step), so every worker measures the same U."""
    import torch  # here, not at the top: a plan (`hlm train --dry-run`) needs no torch

    return int(torch.unique(torch.cat([micro_batch(rank) for rank in ranks])).numel())
