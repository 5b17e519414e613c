"""A cost plan before spending: trials, tokens, FLOPs, GPU-hours and wall time, from the FLOP
model alone (nothing is started: no Ray, no data, no MLflow).

    python sweeps/vocab.py --preset paper --dry-run              # H100 bf16 at 40% MFU
    python sweeps/batch_size.py --preset paper --dry-run --gpu-type A100 --mfu 0.35
    hlm train --preset pythia-70m --num-workers 8 --gpu --dry-run

    plan = sweep_plan(spec, Assumptions(gpu="H100", mfu=0.4, cluster_gpus=8))
    print(format_plan(plan))
    tracker.log_metrics(plan_metrics(plan), step=0)   # a real sweep: on its parent run

What is counted: pretraining only, `optim.max_steps` optimizer steps of `global_batch_size`
sequences (or the steps a `budget.tokens` / `budget.flops` becomes, `hlm_ray.budget`; a
`budget.seconds` run is planned at its cap, `optim.max_steps`), each micro-batch priced by
`hlm_ray.flops.config_step_flops` (matmul FLOPs, forward + backward). The dedup CWT's columns are priced at their bound U = min(W·K, V) (real text has
fewer distinct ids: runs log the measured `train/U`), so a headless trial's FLOPs are an upper
bound. Wall time: FLOPs / (MFU × peak × the trial's GPUs), plus a fixed cost per trial (Ray and
TorchTrainer start-up, checkpoints, the downstream step: `trial/overhead_s` of a real sweep),
with the trials packed onto the concurrency the cluster allows (longest first).
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from hlm_ray.budget import resolve_budget
from hlm_ray.config import Config
from hlm_ray.errors import HLMError
from hlm_ray.flops import PEAK_FLOPS, config_step_flops

DEFAULT_GPU = "H100"
DEFAULT_MFU = 0.40
DEFAULT_OVERHEAD_S = 60.0


@dataclass(frozen=True)
class Assumptions:
    """What the plan takes as given; each one is printed with the plan."""

    gpu: str = DEFAULT_GPU
    """A key of `hlm_ray.flops.PEAK_FLOPS` (dense bf16 peak)."""
    mfu: float = DEFAULT_MFU
    """Model FLOPs utilisation the trials reach (0.4: a well-tuned bf16 transformer)."""
    cluster_gpus: int | None = None
    """GPUs of the cluster; None: this machine's (or 8, one node, when it has none)."""
    cluster_cpus: float | None = None
    """CPUs of the cluster; None: this machine's (or 8 per assumed GPU)."""
    overhead_s: float = DEFAULT_OVERHEAD_S
    """Fixed cost of one trial: start-up, checkpoints, the downstream step."""

    def __post_init__(self):
        if _peak(self.gpu) is None:
            raise HLMError(
                f"--gpu-type {self.gpu!r} is not known; use one of {', '.join(PEAK_FLOPS)}"
            )
        if not 0 < self.mfu <= 1:
            raise HLMError(f"--mfu {self.mfu} must be in (0, 1]")

    @property
    def peak_flops(self) -> float:
        return _peak(self.gpu)


@dataclass(frozen=True)
class TrialPlan:
    label: str
    tokens: int
    flops: float
    gpus: float
    cpus: float
    vocab_size: int
    head_share: float
    steps: int = 0
    """Optimizer steps (a budget's, resolved with the bound U: at most what the run gets)."""


@dataclass(frozen=True)
class Plan:
    name: str
    trials: list[TrialPlan]
    assumptions: Assumptions
    concurrency: int
    cluster: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def total_flops(self) -> float:
        return sum(t.flops for t in self.trials)

    @property
    def total_tokens(self) -> int:
        return sum(t.tokens for t in self.trials)

    def trial_seconds(self, trial: TrialPlan) -> float:
        """Training time of one trial on its GPUs at the stated MFU (no fixed cost)."""
        return trial.flops / (
            self.assumptions.mfu * self.assumptions.peak_flops * max(trial.gpus, 1)
        )

    @property
    def gpu_hours(self) -> float:
        a = self.assumptions
        return self.total_flops / (a.mfu * a.peak_flops) / 3600

    @property
    def wall_seconds(self) -> float:
        """Longest-first list scheduling of the trials onto `concurrency` slots."""
        durations = sorted(
            (self.trial_seconds(t) + self.assumptions.overhead_s for t in self.trials),
            reverse=True,
        )
        slots = [0.0] * max(1, self.concurrency)
        for d in durations:
            heapq.heapreplace(slots, slots[0] + d)
        return max(slots)


def trial_plan(
    cfg: Config, label: str, *, workers: int, gpus_per_worker: float, cpus_per_worker: float
) -> TrialPlan:
    vocab = vocab_size_of(cfg)
    cfg, _ = resolve_budget(cfg, vocab, world_size=workers)  # the bound U: no data here
    step = config_step_flops(cfg, vocab, world_size=workers)  # one worker's micro-batch
    micro_batches = cfg.optim.global_batch_size // cfg.optim.micro_batch_size  # all workers
    tokens = cfg.optim.max_steps * cfg.optim.global_batch_size * cfg.data.seq_len
    return TrialPlan(
        label=label,
        tokens=tokens,
        flops=step.total * micro_batches * cfg.optim.max_steps,
        gpus=workers * gpus_per_worker,
        cpus=workers * cpus_per_worker,
        vocab_size=vocab,
        head_share=step.head_share,
        steps=cfg.optim.max_steps,
    )


def sweep_plan(
    spec,
    assumptions: Assumptions,
    *,
    fit: Callable[[list[dict[str, float]]], int],
    name: str | None = None,
) -> Plan:
    """The plan of a `SweepSpec`'s grid (one trial per cell); `fit(nodes)` is how many trials
    run side by side on those nodes (`hlm_ray.tune.placement.plan_concurrency`)."""
    trials = [
        trial_plan(
            spec.cell_config(c["value"], c["objective"], c["seed"]),
            f"{c['objective']} {spec.axis.name}={c['value']} seed {c['seed']}",
            workers=spec.workers_per_trial,
            gpus_per_worker=spec.gpus_per_worker,
            cpus_per_worker=spec.cpus_per_worker,
        )
        for c in spec.cells()
    ]
    cluster, notes = _cluster(assumptions, spec.gpus_per_worker > 0)
    return Plan(name or spec.axis.name, trials, assumptions, fit([cluster]), cluster, notes)


def train_plan(
    cfg: Config,
    assumptions: Assumptions,
    *,
    workers: int,
    gpus_per_worker: float,
    cpus_per_worker: float,
) -> Plan:
    """The plan of one `hlm train` run; its fixed cost (start-up, checkpoints) is the
    assumptions' `overhead_s` (`hlm train --dry-run` makes it 0 unless `--overhead-s` says)."""
    trial = trial_plan(
        cfg,
        f"{cfg.objective.name} {cfg.preset or cfg.model.arch}",
        workers=workers,
        gpus_per_worker=gpus_per_worker,
        cpus_per_worker=cpus_per_worker,
    )
    cluster, notes = _cluster(assumptions, gpus_per_worker > 0)
    return Plan("hlm train", [trial], assumptions, 1, cluster, notes)


def format_plan(plan: Plan) -> str:
    a = plan.assumptions
    lines = [f"plan for {plan.name}: {len(plan.trials)} trial(s), nothing started", ""]
    header = (
        f"  {'trial':34s} {'steps':>8s} {'V':>8s} {'tokens':>10s} {'FLOPs':>10s} {'head':>6s} "
        f"{'GPU-h':>8s}"
    )
    lines.append(header)
    for t in plan.trials:
        gpu_h = t.flops / (a.mfu * a.peak_flops) / 3600
        lines.append(
            f"  {t.label:34s} {t.steps:>8,d} {t.vocab_size:>8,d} {_si(t.tokens):>10s} {t.flops:>10.3g} "
            f"{t.head_share:>6.1%} {gpu_h:>8.2f}"
        )
    per = plan.trials[0]
    lines += [
        "",
        f"  tokens per trial     {_span([t.tokens for t in plan.trials], _si)} "
        f"(all trials: {_si(plan.total_tokens)})",
        f"  FLOPs per trial      {_span([t.flops for t in plan.trials], '{:.3g}'.format)}",
        f"  FLOPs                {plan.total_flops:.3g} in all "
        f"(FLOP model: matmuls, forward + backward; pretraining only)",
        f"  GPU                  {a.gpu} bf16, peak {a.peak_flops / 1e12:.0f} TFLOP/s, "
        f"at {a.mfu:.0%} MFU (--gpu-type, --mfu)",
        f"  GPU-hours            {plan.gpu_hours:,.1f}",
        f"  cluster              {plan.cluster.get('GPU', 0):g} GPU(s), "
        f"{plan.cluster.get('CPU', 0):g} CPU(s) (--cluster-gpus, --cluster-cpus)",
        f"  concurrency          {plan.concurrency} trial(s) at a time, "
        f"{per.gpus:g} GPU(s) and {per.cpus:g} CPU(s) each",
        f"  expected wall time   {_duration(plan.wall_seconds)} "
        f"(+ {a.overhead_s:.0f} s fixed cost per trial, --overhead-s)",
    ]
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def plan_metrics(plan: Plan) -> dict[str, float]:
    """The plan as MLflow metrics (`plan/...`), logged on a sweep's parent run."""
    return {
        "plan/trials": float(len(plan.trials)),
        "plan/tokens_per_trial": float(plan.trials[0].tokens),
        "plan/flops": plan.total_flops,
        "plan/flops_per_trial": plan.total_flops / len(plan.trials),
        "plan/gpu_hours": plan.gpu_hours,
        "plan/mfu": plan.assumptions.mfu,
        "plan/concurrency": float(plan.concurrency),
        "plan/wall_s": plan.wall_seconds,
    }


def measured_metrics(rows: list[dict[str, Any]], seconds: float) -> dict[str, float]:
    """What a finished sweep measured, beside the plan (`measured/...`)."""
    done = [r for r in rows if r.get("status") == "FINISHED"]
    out = {"measured/wall_s": seconds, "measured/trials_finished": float(len(done))}
    for key, name in (("trial/overhead_s", "overhead_s"), ("trial/wall_s", "trial_wall_s")):
        values = [float(r[key]) for r in done if _finite(r.get(key))]
        if values:
            out[f"measured/mean_{name}"] = sum(values) / len(values)
    return out


def log_sweep_plan(parent, spec, name, assumptions, concurrency, folder, search) -> Plan | None:
    """A real sweep: the plan (at the concurrency Ray actually allows) on its parent run, as
    `plan/...` metrics and `plan.txt`; the measured figures follow at the end."""
    if search:  # random samples of one cell: the grid's plan does not describe it
        return None
    plan = sweep_plan(spec, assumptions or Assumptions(), fit=lambda _: concurrency, name=name)
    path = folder / "plan.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_plan(plan) + "\n")
    parent.log_metrics(plan_metrics(plan), step=0)
    parent.log_artifact(path)
    return plan


def add_arguments(p) -> None:
    """--dry-run and the plan's assumptions, for the CLIs that plan."""
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the cost plan (trials, tokens, FLOPs, GPU-hours, wall time); start nothing",
    )
    p.add_argument("--gpu-type", default=DEFAULT_GPU, help=f"plan: GPU (default {DEFAULT_GPU})")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="plan: MFU (default 0.4)")
    p.add_argument("--cluster-gpus", type=int, help="plan: GPUs of the cluster")
    p.add_argument("--cluster-cpus", type=float, help="plan: CPUs of the cluster")
    p.add_argument(
        "--overhead-s", type=float, default=DEFAULT_OVERHEAD_S, help="plan: fixed cost per trial"
    )


def assumptions_from(args) -> Assumptions:
    return Assumptions(
        gpu=args.gpu_type,
        mfu=args.mfu,
        cluster_gpus=args.cluster_gpus,
        cluster_cpus=args.cluster_cpus,
        overhead_s=args.overhead_s,
    )


def vocab_size_of(cfg: Config) -> int:
    """The vocabulary a run will have: the BPE size asked for, or a tokenizer file's size."""
    if cfg.tokenizer.kind == "bpe":
        return cfg.tokenizer.vocab_size
    return _file_vocab_size(cfg.tokenizer.path, cfg.tokenizer.vocab_size)


@cache
def _file_vocab_size(path: str | None, fallback: int) -> int:
    """A tokenizer file's size, loaded once per path (a plan prices every trial); a hub name
    only from the local cache: a plan is made offline, without the hub's retries."""
    try:
        from hlm_ray.tokenizer import load_tokenizer

        return len(load_tokenizer(path, None, offline=True))
    except Exception:  # no data folder here (a laptop): the config's figure
        return fallback


def _cluster(a: Assumptions, needs_gpu: bool) -> tuple[dict[str, float], list[str]]:
    notes = []
    gpus = a.cluster_gpus
    if gpus is None:
        gpus = _local_gpus()
        if gpus == 0 and needs_gpu:
            gpus = 8
            notes.append("no GPU here: assumed one node with 8 GPUs (set --cluster-gpus)")
    cpus = a.cluster_cpus
    if cpus is None:
        cpus = float(os.cpu_count() or 1) if not needs_gpu else max(8.0 * gpus, os.cpu_count() or 1)
    return {"CPU": float(cpus), "GPU": float(gpus)}, notes


def _local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def _peak(gpu: str) -> float | None:
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key.upper() in gpu.upper():
            return PEAK_FLOPS[key]
    return None


def _si(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:g}"


def _span(values: list[float], fmt) -> str:
    low, high = min(values), max(values)
    return fmt(low) if low == high else f"{fmt(low)} to {fmt(high)}"


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)
