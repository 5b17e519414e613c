"""What a plan costs on this machine's CPUs: each trial's optimizer step timed on the model it
will train, kept per machine and shape, and the fixed costs of a trial as earlier sweeps here
measured them.

    rate = step_rate(cfg, vocab, workers=1, threads=1)   # kept, else one short timed step now
    rate.step_s, rate.eval_batch_s                        # seconds: an optimizer step, a val batch
    costs = fixed_costs("headline-cpu", "encoder")        # start-up and downstream, with source
    record_fixed_costs(rows, recipe, families)            # a finished sweep's, for later plans

A rate is measured by building the trial's model (its config, vocabulary, objective, optimizer),
one warm-up optimizer step on random token ids (its micro-batches accumulated as the run
accumulates them), then timed steps until half a second has passed (at least one), and one
validation forward, on `threads` threads (a Ray worker's: one per CPU it holds). The machine's
load average is kept beside it: a rate measured on a busy machine is slower than an idle
machine's, and the plan says so. Rates are kept in ``$HLM_PLAN_RATES`` (default
``$HLM_CACHE_DIR/plan_rates.json``) under the machine (CPU model, logical CPUs, torch version);
delete the file to measure again.

Fixed costs are what a trial spends besides its optimizer steps: Ray Train's start-up and
teardown, the worker's set-up, validation and checkpoints (`trial/pretrain_overhead_s`), and
the downstream protocol (`trial/downstream_s`). A finished sweep records their means here per
(recipe, model family); a plan takes the start-up from the latest sweep on this machine and the
downstream from the latest one with the same recipe and family, else it assumes (and says so).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hlm_ray.config import Config

RATES_ENV = "HLM_PLAN_RATES"
MEASURE_S = 0.5
"""Timed steps of one shape: until this many seconds have passed (at least one step)."""
MAX_TIMED_STEPS = 5


@dataclass(frozen=True)
class StepRate:
    step_s: float
    """Seconds of one optimizer step (every micro-batch of this worker, clip, update)."""
    eval_batch_s: float
    """Seconds of one validation micro-batch (forward only)."""
    threads: int
    load: float
    """The machine's 1-minute load average when it was measured."""
    measured_at: str
    fresh: bool = False
    """Measured by this call (not read from the file)."""


@dataclass(frozen=True)
class FixedCost:
    seconds: float
    source: str
    """"measured: ..." (a sweep here) or "assumed: ..."."""
    measured: bool


def machine() -> str:
    """This machine, as rates are kept: CPU model, logical CPUs, torch version."""
    import torch

    return f"{cpu_model()} × {os.cpu_count()} CPUs, torch {torch.__version__}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def rates_path() -> Path:
    from hlm_ray.paths import cache_dir

    given = os.environ.get(RATES_ENV)
    return Path(given).expanduser() if given else cache_dir() / "plan_rates.json"


def shape_key(cfg: Config, vocab: int, *, accum: int, threads: int) -> str:
    """What a step's time depends on: the model, its objective and optimizer settings, the
    micro-batch, the accumulation, the vocabulary and the threads."""
    m, o, p = cfg.model, cfg.objective, cfg.optim
    parts = [
        f"{m.arch} L{m.num_layers} D{m.hidden_size} H{m.num_heads} I{m.intermediate_size}",
        f"attn {m.attn_impl}",
        f"{o.name} ce {o.ce_impl} {o.vanilla_impl} cwt {o.cwt_chunk_size} mlm {o.mlm_full_logits}",
        f"V{vocab} B{p.micro_batch_size}x{accum} L{cfg.data.seq_len}",
        f"{p.embedding_update} {p.precision} compile {p.compile} threads {threads}",
    ]
    return " | ".join(str(x) for x in parts)


def step_rate(
    cfg: Config, vocab: int, *, workers: int, threads: int, measure: bool = True, say=None
) -> StepRate | None:
    """The kept rate of this shape on this machine, else (with `measure`) one measured now and
    kept; None when there is none and `measure` is False. `say(line)` announces a measurement."""
    accum = cfg.optim.grad_accum_steps(workers)
    key = shape_key(cfg, vocab, accum=accum, threads=threads)
    here = machine()
    kept = _read().get("rates", {}).get(here, {}).get(key)
    if kept is not None:
        return StepRate(**kept)
    if not measure:
        return None
    if say is not None:
        say(
            f"plan: timing a step of {cfg.preset} {cfg.objective.name} V={vocab:,} on "
            f"{threads} thread(s) (once per machine and shape)"
        )
    rate = _measure(cfg, vocab, accum=accum, threads=threads)
    _update(lambda data: data.setdefault("rates", {}).setdefault(here, {}).update({key: rate}))
    return StepRate(**rate, fresh=True)


def _measure(cfg: Config, vocab: int, *, accum: int, threads: int) -> dict[str, Any]:
    import torch

    from hlm_ray.bench.presets import StepModel
    from hlm_ray.bench.train_step import SPECIAL, make_batches
    from hlm_ray.device import autocast, autocast_dtype
    from hlm_ray.models import build_model
    from hlm_ray.train.lm_objective import LMObjective
    from hlm_ray.train.optim import build_optimizer, clip_grad_norm

    device = torch.device("cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = build_model(
            cfg.model, vocab_size=vocab, objective=cfg.objective.name, special_ids=SPECIAL
        )
        model.train()
        module = LMObjective(model, cfg.objective)
        optimizer = build_optimizer(model, cfg.optim)
        amp = autocast_dtype(cfg.optim.precision, device)
        micro = cfg.optim.micro_batch_size
        shape = StepModel(cfg.preset, cfg.model, cfg.data.seq_len, ((vocab, micro),))
        batches = make_batches(shape, vocab, micro, max(accum, 2), device)

        def step() -> float:
            started = time.perf_counter()
            for i in range(accum):
                ids, labels = batches[i % len(batches)]
                with autocast(device, amp):
                    out = module(ids, labels)["loss"]
                (out.loss / accum).backward()
            clip_grad_norm(model.parameters(), cfg.optim.grad_clip or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - started

        step()  # warm-up: first-call allocations, lazy optimizer state
        times = [step()]
        while sum(times) < MEASURE_S and len(times) < MAX_TIMED_STEPS:
            times.append(step())
        ids, labels = batches[0]
        started = time.perf_counter()
        with torch.no_grad(), autocast(device, amp):
            module(ids, labels)
        eval_s = time.perf_counter() - started
    finally:
        torch.set_num_threads(before)
    return {
        "step_s": statistics.median(times),
        "eval_batch_s": eval_s,
        "threads": threads,
        "load": round(os.getloadavg()[0], 2),
        "measured_at": time.strftime("%Y-%m-%d %H:%M"),
    }


def trial_train_seconds(cfg: Config, steps: int, rate: StepRate) -> tuple[float, int]:
    """(seconds, steps) of a trial's training at `rate`: its optimizer steps, stopped by a
    `budget.seconds` deadline, plus its validations (`run.eval_batches` micro-batches every
    `run.eval_every` steps and at the end)."""
    if cfg.budget.seconds is not None:
        steps = min(steps, max(1, int(cfg.budget.seconds / rate.step_s) + 1))
    evals = steps // cfg.run.eval_every + (steps % cfg.run.eval_every != 0)
    return steps * rate.step_s + evals * cfg.run.eval_batches * rate.eval_batch_s, steps


def price_trial(
    cfg: Config, vocab: int, steps: int, *, workers: int, threads: int, measure: bool, say,
    counts: dict[str, Any],
) -> tuple[float, int, float] | None:  # fmt: skip
    """(seconds, steps, step seconds) of a trial of `steps` optimizer steps (its budget
    resolved) at this machine's rate, None without one; `counts` tallies where rates came from
    ("measured_now", "kept", "missing") and the highest load they were measured at."""
    rate = step_rate(cfg, vocab, workers=workers, threads=threads, measure=measure, say=say)
    if rate is None:
        counts["missing"] = counts.get("missing", 0) + 1
        return None
    source = "measured_now" if rate.fresh else "kept"
    counts[source] = counts.get(source, 0) + 1
    counts["load"] = max(counts.get("load", 0.0), rate.load)
    counts["threads"] = threads
    seconds, steps = trial_train_seconds(cfg, steps, rate)
    return seconds, steps, rate.step_s


def rate_lines(rates: dict[str, Any], cpu_hours: float) -> list[str]:
    """A CPU plan's lines: where its step times come from, the load they were measured at."""
    lines = [
        f"  CPUs                 this machine's ({cpu_model()}): each trial's step timed here "
        f"on its own model, {rates.get('threads', 1)} thread(s) per worker, kept in "
        f"{rates_path()}",
        f"  CPU-hours            {cpu_hours:,.2f} of training and validation",
    ]
    if "load" in rates:
        lines.append(
            f"  measured at          load average up to {rates['load']:.1f} on "
            f"{os.cpu_count()} cores (a busy machine's times are slower than an idle one's)"
        )
    if rates.get("missing"):
        lines.append(
            f"  not priced           {rates['missing']} trial(s) without a step time measured "
            "here: their training is not counted (the dry run of the same command measures it)"
        )
    return lines


def fixed_lines(fixed: dict[str, tuple], overhead_s: float | None = None) -> list[str]:
    """Per model family: the fixed cost of one trial, its parts and where each comes from (or
    `overhead_s`, given); then the sweep's own start and end."""
    if overhead_s is not None:
        lines = [f"  fixed cost per trial {overhead_s:.0f} s: start-up, downstream (--overhead-s)"]
    else:
        families = {family: costs for family, costs in fixed.items() if family != "sweep"}
        lines = [
            f"  fixed cost per trial {start.seconds + downstream.seconds:.0f} s ({family}s): "
            f"start-up, validation, checkpoints {start.seconds:.0f} s ({start.source}); "
            f"downstream {downstream.seconds:.0f} s ({downstream.source}); --overhead-s sets both"
            for family, (start, downstream) in sorted(families.items())
        ]
    for cost in fixed.get("sweep", ()):
        lines.append(
            f"  the sweep's own      {cost.seconds:.0f} s: Ray's start, the inputs, the MLflow "
            f"server, the summary ({cost.source})"
        )
    return lines


# ------------------------------------------------------------------- a trial's fixed costs

DEFAULT_START_S = 30.0
"""Assumed when no sweep ran here: Ray Train's start-up and teardown, the worker's set-up,
validation and checkpoints of one trial on 2 shared cores."""
DEFAULT_DOWNSTREAM_S = 30.0
"""Assumed when no sweep with the recipe ran here (recipe "none": no downstream step)."""
DEFAULT_SWEEP_S = 45.0
"""Assumed when no sweep ran here: a sweep's own start and end (Ray's start, the inputs'
preparation, the MLflow server, the summary)."""


def sweep_cost() -> FixedCost:
    """A sweep's own start and end on this machine: the latest sweep's (its inputs' preparation
    included, when it prepared them), else `DEFAULT_SWEEP_S`, said."""
    kept = _read().get("fixed", {}).get(machine(), {}).get("sweep")
    if kept:
        return FixedCost(kept["s"], f"measured: sweep {kept['sweep']}, {kept['at']}", True)
    return FixedCost(DEFAULT_SWEEP_S, "assumed: no sweep measured here yet", False)


def fixed_costs(recipe: str, family: str) -> tuple[FixedCost, FixedCost]:
    """(start-up, downstream) of one trial of `recipe` for a model `family` (encoder/decoder)
    on this machine: the latest sweep's measured means, else the defaults, said."""
    here = _read().get("fixed", {}).get(machine(), {})
    start = here.get("start")
    start_cost = (
        FixedCost(start["s"], f"measured: {_said(start)}", True)
        if start
        else FixedCost(DEFAULT_START_S, "assumed: no sweep measured here yet", False)
    )
    if recipe == "none":
        return start_cost, FixedCost(0.0, "none: recipe none", True)
    down = here.get("downstream", {}).get(f"{recipe} {family}")
    down_cost = (
        FixedCost(down["s"], f"measured: {_said(down)}", True)
        if down
        else FixedCost(
            DEFAULT_DOWNSTREAM_S, f"assumed: no {recipe} sweep of {family}s measured here", False
        )
    )
    return start_cost, down_cost


def record_fixed_costs(
    rows: list[dict[str, Any]],
    recipe: str,
    sweep: str,
    family_of: Callable[[dict], str],
    sweep_s: float | None = None,
) -> dict[str, Any]:
    """Keep a finished sweep's measured fixed costs for later plans on this machine: the mean
    start-up of the trials that trained in this attempt, the mean downstream step per model
    family (`family_of(row)`: "encoder" or "decoder"), and `sweep_s`, the sweep's own start and
    end. Returns what it kept (nothing from a sweep without a finished trial)."""
    done = [{**r, "family": family_of(r)} for r in rows if r.get("status") == "FINISHED"]
    start = [r["trial/pretrain_overhead_s"] for r in done if _trained(r)]
    kept: dict[str, Any] = {}
    stamp = {"sweep": sweep, "at": time.strftime("%Y-%m-%d %H:%M")}
    if start:
        kept["start"] = {"s": statistics.mean(start), "n": len(start), **stamp}
    if start and sweep_s is not None:  # (a resumed sweep with nothing left to train: not one)
        kept["sweep"] = {"s": sweep_s, **stamp}
    down = {}
    for family in sorted({r.get("family") for r in done if r.get("family")}):
        values = [
            r["trial/downstream_s"]
            for r in done
            if r.get("family") == family and _number(r.get("trial/downstream_s"))
        ]
        if values:
            down[f"{recipe} {family}"] = {"s": statistics.mean(values), "n": len(values), **stamp}
    if not kept and not down:
        return {}
    here = machine()

    def merge(data: dict) -> None:
        fixed = data.setdefault("fixed", {}).setdefault(here, {})
        fixed.update(kept)
        fixed.setdefault("downstream", {}).update(down)

    _update(merge)
    return {**kept, "downstream": down}


def _trained(row: dict[str, Any]) -> bool:
    """The trial trained in this attempt (a resumed one's start-up is not a start-up)."""
    return _number(row.get("trial/pretrain_overhead_s")) and _number(row.get("trial/train_s"))


def _number(x) -> bool:
    return isinstance(x, int | float) and x == x and x >= 0


def _said(entry: dict[str, Any]) -> str:
    return f"mean of {entry['n']} trial(s) of sweep {entry['sweep']}, {entry['at']}"


# ------------------------------------------------------------------------------ the file


def _read() -> dict[str, Any]:
    try:
        return json.loads(rates_path().read_text())
    except (OSError, ValueError):
        return {}


def _update(change) -> None:
    """Read, change and write the file (atomically: a plan beside a sweep reads it whole)."""
    path = rates_path()
    data = _read()
    change(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
