"""A cost plan before spending: trials, tokens, FLOPs, and the wall time on the hardware the
trials will run on (nothing is started: no Ray, no data, no MLflow).

    python sweeps/vocab.py --preset paper --dry-run --gpu-type A100 --mfu 0.35   # on GPUs
    python sweeps/headline.py --preset cpu --dry-run             # this machine's CPUs, measured
    plan = sweep_plan(spec, Assumptions(), fit=lambda nodes: 2)  # then plan.wall_seconds
    print(format_plan(plan)); tracker.log_metrics(plan_metrics(plan), step=0)

Counted: pretraining, `optim.max_steps` steps of `global_batch_size` sequences (or the steps a
`budget.tokens` / `budget.flops` becomes, `hlm_ray.budget`), each micro-batch priced by
`hlm_ray.flops.config_step_flops`, the dedup CWT at its bound U = min(W·K, V) (runs log the
measured `train/U`): a headless trial's FLOPs are an upper bound. Wall time on GPUs (trials
with GPU workers; `hlm train --gpu`, --gpu-type, --mfu or --cluster-gpus): FLOPs / (MFU × peak
× the trial's GPUs). On CPUs (everything else): each trial's step timed on this machine on its
own model (`hlm_ray.cpu_plan`, kept per machine and shape) times its steps (a `budget.seconds`
trial stops at its deadline), plus its validations. Either way plus a fixed cost per trial
(start-up, validation, checkpoints, the downstream step), on CPUs what the latest sweep here
measured where there was one; trials packed onto the concurrency the cluster allows.
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from hlm_ray.budget import resolve_budget
from hlm_ray.config import Config
from hlm_ray.errors import HLMError
from hlm_ray.flops import PEAK_FLOPS, config_step_flops

DEFAULT_GPU = "H100"
DEFAULT_MFU = 0.40
DEFAULT_OVERHEAD_S = 60.0
"""A GPU trial's fixed cost when none is given (a CPU plan takes what sweeps here measured)."""


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
    overhead_s: float | None = None
    """Fixed cost of one trial: start-up, checkpoints, the downstream step. None: on GPUs
    `DEFAULT_OVERHEAD_S`, on CPUs what sweeps on this machine measured (`cpu_plan`)."""
    gpu_asked: bool = False
    """--gpu-type, --mfu or --cluster-gpus was given: `hlm train` plans on GPUs."""
    measure: bool = True
    """A CPU plan may time a step not timed here yet (a dry run; not a sweep's own plan)."""

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
    """Optimizer steps (a budget's with the bound U; on CPUs a deadline's at the measured rate)."""
    family: str = "decoder"
    seconds: float | None = None
    """CPU plans: training and validation seconds at the measured rate (None: no rate here)."""
    step_s: float | None = None
    """CPU plans: the measured seconds of one optimizer step."""


@dataclass(frozen=True)
class Plan:
    name: str
    trials: list[TrialPlan]
    assumptions: Assumptions
    concurrency: int
    cluster: dict[str, float]
    notes: list[str] = field(default_factory=list)
    hardware: str = "gpu"  # "gpu": FLOPs at the assumed MFU; "cpu": steps timed on this machine
    fixed: dict[str, tuple] = field(default_factory=dict)
    """CPU plans: {family: (start-up, downstream) FixedCosts, "sweep": (its own start, end)}."""
    rates: dict[str, float] = field(default_factory=dict)  # CPU plans: where step times came from

    @property
    def total_flops(self) -> float:
        return sum(t.flops for t in self.trials)

    @property
    def total_tokens(self) -> int:
        return sum(t.tokens for t in self.trials)

    def trial_seconds(self, trial: TrialPlan) -> float:
        """Training time of one trial (no fixed cost): on its GPUs at the stated MFU, or on
        CPUs at the measured step time (0 for a trial with no rate here)."""
        if self.hardware == "cpu":
            return trial.seconds or 0.0
        return trial.flops / (
            self.assumptions.mfu * self.assumptions.peak_flops * max(trial.gpus, 1)
        )

    def fixed_seconds(self, trial: TrialPlan) -> float:
        """One trial's fixed cost: --overhead-s when given, else on CPUs the measured (or
        assumed) start-up and downstream of its family, on GPUs `DEFAULT_OVERHEAD_S`."""
        if self.assumptions.overhead_s is not None:
            return self.assumptions.overhead_s
        if self.hardware == "cpu" and trial.family in self.fixed:
            start, downstream = self.fixed[trial.family]
            return start.seconds + downstream.seconds
        return DEFAULT_OVERHEAD_S

    @property
    def cpu_hours(self) -> float:
        return sum(self.trial_seconds(t) * t.cpus for t in self.trials) / 3600

    @property
    def gpu_hours(self) -> float:
        a = self.assumptions
        return self.total_flops / (a.mfu * a.peak_flops) / 3600

    @property
    def wall_seconds(self) -> float:
        """Longest-first list scheduling of the trials onto `concurrency` slots."""
        durations = sorted(
            (self.trial_seconds(t) + self.fixed_seconds(t) for t in self.trials), reverse=True
        )
        slots = [0.0] * max(1, self.concurrency)
        for d in durations:
            heapq.heapreplace(slots, slots[0] + d)
        return max(slots) + sum(cost.seconds for cost in self.fixed.get("sweep", ()))


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
        family=cfg.model.family,
    )


def sweep_plan(
    spec,
    assumptions: Assumptions,
    *,
    fit: Callable[[list[dict[str, float]]], int],
    name: str | None = None,
    say: Callable[[str], None] | None = None,
) -> Plan:
    """The plan of a `SweepSpec`'s grid (one trial per cell); `fit(nodes)` is how many trials
    run side by side on those nodes (`hlm_ray.tune.placement.plan_concurrency`). Trials with
    GPU workers are priced on GPUs, the others on this machine's CPUs (one thread per CPU of a
    worker, as Ray gives its workers); `say(line)` announces a step being timed."""
    cells = [
        (
            spec.cell_config(c["value"], c["objective"], c["seed"]),
            f"{c['objective']} {spec.axis.name}={c['value']} seed {c['seed']}",
        )
        for c in spec.cells()
    ]
    from hlm_ray.cpu_plan import fixed_costs, sweep_cost

    hardware = "gpu" if spec.gpus_per_worker > 0 else "cpu"
    cluster, notes = _cluster(assumptions, hardware == "gpu")
    if hardware == "cpu" and assumptions.gpu_asked:
        notes.append("--gpu-type, --mfu and --cluster-gpus do not apply: the trials run on CPUs")
    plan = Plan(name or spec.axis.name, [], assumptions, fit([cluster]), cluster, notes, hardware)
    workers, threads = spec.workers_per_trial, max(1, int(spec.cpus_per_worker))
    for cfg, label in cells:
        trial = trial_plan(
            cfg,
            label,
            workers=workers,
            gpus_per_worker=spec.gpus_per_worker,
            cpus_per_worker=spec.cpus_per_worker,
        )
        if hardware == "cpu":
            trial = _priced_on_cpus(plan, cfg, trial, workers, threads, say)
            if trial.family not in plan.fixed:
                plan.fixed[trial.family] = fixed_costs(spec.recipe, trial.family)
        plan.trials.append(trial)
    if hardware == "cpu":
        plan.fixed["sweep"] = (sweep_cost(),)
    return plan


def train_plan(
    cfg: Config,
    assumptions: Assumptions,
    *,
    workers: int,
    gpus_per_worker: float,
    cpus_per_worker: float,
    threads: int | None = None,
    say: Callable[[str], None] | None = None,
) -> Plan:
    """The plan of one `hlm train` run; its fixed cost (start-up, checkpoints) is the
    assumptions' `overhead_s` (`hlm train --dry-run` makes it 0 unless `--overhead-s` says).
    `gpus_per_worker` 0: priced on this machine's CPUs, `threads` per worker (default: one per
    CPU of a worker, as Ray gives them)."""
    trial = trial_plan(
        cfg,
        f"{cfg.objective.name} {cfg.preset or cfg.model.arch}",
        workers=workers,
        gpus_per_worker=gpus_per_worker,
        cpus_per_worker=cpus_per_worker,
    )
    hardware = "gpu" if gpus_per_worker > 0 else "cpu"
    cluster, notes = _cluster(assumptions, hardware == "gpu")
    plan = Plan("hlm train", [], assumptions, 1, cluster, notes, hardware)
    if hardware == "cpu":
        threads = threads or max(1, int(cpus_per_worker))
        trial = _priced_on_cpus(plan, cfg, trial, workers, threads, say)
    plan.trials.append(trial)
    return plan


def _priced_on_cpus(plan: Plan, cfg: Config, trial: TrialPlan, workers, threads, say):
    """`trial` with its seconds at the step time measured here (kept, or timed now when the
    plan may measure); the plan's `rates` count where they came from."""
    from hlm_ray.cpu_plan import price_trial

    cfg, _ = resolve_budget(cfg, trial.vocab_size, world_size=workers)
    priced = price_trial(cfg, trial.vocab_size, trial.steps, workers=workers, threads=threads,
                         measure=plan.assumptions.measure, say=say, counts=plan.rates)  # fmt: skip
    if priced is None:
        return trial
    seconds, steps, step_s = priced
    share = steps / trial.steps if trial.steps else 1.0
    return replace(trial, seconds=seconds, step_s=step_s, steps=steps,
                   tokens=round(trial.tokens * share), flops=trial.flops * share)  # fmt: skip


def format_plan(plan: Plan) -> str:
    a = plan.assumptions
    cpu = plan.hardware == "cpu"
    lines = [f"plan for {plan.name}: {len(plan.trials)} trial(s), nothing started", ""]
    last = f"{'step s':>8s} {'train s':>8s}" if cpu else f"{'GPU-h':>8s}"
    header = (
        f"  {'trial':34s} {'steps':>8s} {'V':>8s} {'tokens':>10s} {'FLOPs':>10s} {'head':>6s} "
        f"{last}"
    )
    lines.append(header)
    for t in plan.trials:
        if cpu:
            step_s, train_s = (
                ("-", "-") if t.seconds is None else (f"{t.step_s:.3g}", f"{t.seconds:,.0f}")
            )
            cost = f"{step_s:>8s} {train_s:>8s}"
        else:
            cost = f"{t.flops / (a.mfu * a.peak_flops) / 3600:>8.2f}"
        lines.append(
            f"  {t.label:34s} {t.steps:>8,d} {t.vocab_size:>8,d} {_si(t.tokens):>10s} {t.flops:>10.3g} "
            f"{t.head_share:>6.1%} {cost}"
        )
    per = plan.trials[0]
    lines += [
        "",
        f"  tokens per trial     {_span([t.tokens for t in plan.trials], _si)} "
        f"(all trials: {_si(plan.total_tokens)})",
        f"  FLOPs per trial      {_span([t.flops for t in plan.trials], '{:.3g}'.format)}",
        f"  FLOPs                {plan.total_flops:.3g} in all "
        f"(FLOP model: matmuls, forward + backward; pretraining only)",
    ]
    if cpu:
        from hlm_ray.cpu_plan import rate_lines

        lines += rate_lines(plan.rates, plan.cpu_hours)
    else:
        lines += [
            f"  GPU                  {a.gpu} bf16, peak {a.peak_flops / 1e12:.0f} TFLOP/s, "
            f"at {a.mfu:.0%} MFU (--gpu-type, --mfu)",
            f"  GPU-hours            {plan.gpu_hours:,.1f}",
        ]
    flag = "--cluster-cpus" if cpu else "--cluster-gpus, --cluster-cpus"
    lines += [
        f"  cluster              {plan.cluster.get('GPU', 0):g} GPU(s), "
        f"{plan.cluster.get('CPU', 0):g} CPU(s) ({flag})",
        f"  concurrency          {plan.concurrency} trial(s) at a time, "
        f"{per.gpus:g} GPU(s) and {per.cpus:g} CPU(s) each",
        *_fixed_lines(plan),
        f"  expected wall time   {_duration(plan.wall_seconds)}, {_included(plan)}",
    ]
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _fixed_lines(plan: Plan) -> list[str]:
    """The fixed cost per trial and where it comes from (included in the wall time)."""
    a = plan.assumptions
    if plan.hardware == "cpu" and plan.fixed:
        from hlm_ray.cpu_plan import fixed_lines

        return fixed_lines(plan.fixed, a.overhead_s)
    seconds = DEFAULT_OVERHEAD_S if a.overhead_s is None else a.overhead_s
    said = "--overhead-s" if a.overhead_s is not None else "assumed, --overhead-s"
    return [f"  fixed cost per trial {seconds:.0f} s: start-up, checkpoints, downstream ({said})"]


def _included(plan: Plan) -> str:
    fixed = {plan.fixed_seconds(t) for t in plan.trials}
    if "sweep" in plan.fixed:
        return "including the fixed costs above"
    if fixed == {0.0}:
        return "training only (no fixed cost counted: --overhead-s adds one per trial)"
    if len(fixed) == 1:
        return f"including the fixed cost of {fixed.pop():.0f} s per trial"
    return "including the fixed costs per trial above"


def plan_metrics(plan: Plan) -> dict[str, float]:
    """The plan as MLflow metrics (`plan/...`), logged on a sweep's parent run."""
    return {
        "plan/trials": float(len(plan.trials)),
        "plan/tokens_per_trial": float(plan.trials[0].tokens),
        "plan/flops": plan.total_flops,
        "plan/flops_per_trial": plan.total_flops / len(plan.trials),
        **(
            {"plan/cpu_hours": plan.cpu_hours}
            if plan.hardware == "cpu"
            else {"plan/gpu_hours": plan.gpu_hours, "plan/mfu": plan.assumptions.mfu}
        ),
        "plan/concurrency": float(plan.concurrency),
        "plan/wall_s": plan.wall_seconds,
    }


def measured_metrics(rows: list[dict[str, Any]], seconds: float) -> dict[str, float]:
    """What a finished sweep measured, beside the plan (`measured/...`)."""
    done = [r for r in rows if r.get("status") == "FINISHED"]
    out = {"measured/wall_s": seconds, "measured/trials_finished": float(len(done))}
    for key, name in (
        ("trial/overhead_s", "overhead_s"),
        ("trial/wall_s", "trial_wall_s"),
        ("trial/train_s", "train_s"),
        ("trial/pretrain_overhead_s", "pretrain_overhead_s"),
        ("trial/downstream_s", "downstream_s"),
    ):
        values = [float(r[key]) for r in done if _finite(r.get(key))]
        if values:
            out[f"measured/mean_{name}"] = sum(values) / len(values)
    return out


def log_sweep_plan(parent, spec, name, assumptions, concurrency, folder, search) -> Plan | None:
    """A real sweep: the plan (at the concurrency Ray actually allows) on its parent run, as
    `plan/...` metrics and `plan.txt`; the measured figures follow at the end."""
    if search:  # random samples of one cell: the grid's plan does not describe it
        return None
    # Kept step times only: timing the missing shapes here would hold up the trials.
    assumptions = replace(assumptions or Assumptions(), measure=False)
    plan = sweep_plan(spec, assumptions, fit=lambda _: concurrency, name=name)
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
    p.add_argument(
        "--gpu-type", help=f"plan: the GPU (default {DEFAULT_GPU}; a plan on GPUs for hlm train)"
    )
    p.add_argument("--mfu", type=float, help=f"plan: MFU on GPUs (default {DEFAULT_MFU})")
    p.add_argument("--cluster-gpus", type=int, help="plan: GPUs of the cluster")
    p.add_argument("--cluster-cpus", type=float, help="plan: CPUs of the cluster")
    p.add_argument(
        "--overhead-s",
        type=float,
        help="plan: fixed cost per trial, included in the wall time (default: on CPUs what "
        f"sweeps here measured, on GPUs {DEFAULT_OVERHEAD_S:.0f} s)",
    )


def assumptions_from(args) -> Assumptions:
    return Assumptions(
        gpu=args.gpu_type or DEFAULT_GPU,
        mfu=DEFAULT_MFU if args.mfu is None else args.mfu,
        cluster_gpus=args.cluster_gpus,
        cluster_cpus=args.cluster_cpus,
        overhead_s=args.overhead_s,
        gpu_asked=any(x is not None for x in (args.gpu_type, args.mfu, args.cluster_gpus)),
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
    if not needs_gpu:  # a CPU plan: the cluster's GPUs are not used
        return {"CPU": float(a.cluster_cpus or os.cpu_count() or 1), "GPU": 0.0}, notes
    gpus = a.cluster_gpus
    if gpus is None:
        gpus = _local_gpus()
        if gpus == 0:
            gpus = 8
            notes.append("no GPU here: assumed one node with 8 GPUs (set --cluster-gpus)")
    cpus = a.cluster_cpus
    if cpus is None:
        cpus = max(8.0 * gpus, os.cpu_count() or 1)
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
