"""The compute sweep (`sweeps/scaling.py`): both arms of a decoder at budgets in FLOPs, each arm
at the learning rate its own search chose, then the same budgets at one shared learning rate.

    Axis("scaling", "budget.flops", ..., settings=budget_settings, check=check_budgets)
    lrs = search_lrs(spec)                        # log-spaced: sweep.search_lr, search_samples
    lr_spec = search_spec(spec)                   # every arm × lr at the smallest budget
    chosen = choose_lrs(rows)                     # {"headless": 3e-3, "vanilla": 1e-3}
    main = with_lrs(spec, chosen)                 # every budget of an arm at its lr
    shared = shared_spec(spec, chosen)            # the arms whose lr was not the shared one
    print(plan_text(spec, args, "scaling-cpu"))   # --dry-run: every trial of the three parts

One run is three sweeps, each its own folder and MLflow parent run: `<name>-lr` (the search:
each arm at each learning rate, seed 0, at the smallest budget, scored on bits per byte),
`<name>` (every budget × arm × seed at the arm's chosen rate: the chosen rates
are `sweep.arm_overrides` there, recorded on its parent run) and `<name>-shared-lr` (every
budget × seed of the arms whose chosen rate is not the shared one, `optim.lr` of the preset,
at that rate; skipped when both arms chose it). `hlm_ray.tune.scaling_report` fits and
compares them. Budgets are FLOPs with an SI prefix (`"400G"`, `"1.6T"`; a plain number works
too): strings, so run names and tables stay short.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Any

from hlm_ray.errors import HLMError
from hlm_ray.tune.axis import Axis, Figure, Value
from hlm_ray.tune.spec import SweepSpec

ARMS = ("headless", "vanilla")
SI = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
SEARCH_SEEDS = 1
"""Seeds of the learning-rate search (0..n-1)."""
TIMING_FILE = "timing.json"
"""Wall seconds of the last invocation's three parts, in the tuned sweep's folder."""


def flops_of(value: Value) -> float:
    """A budget's FLOPs: `"400G"` -> 4e11, `"1.6T"` -> 1.6e12, a number as it is."""
    text = str(value).strip()
    if text[-1:] in SI:
        return float(text[:-1]) * SI[text[-1]]
    return float(text)


def budget_settings(value: Value, workers: int) -> dict[str, Any]:
    """The `Axis.settings` of a budget: `budget.flops`, which each trial's worker turns into its
    arm's steps (with the U it measures); its warm-up is `budget.warmup_share` of them."""
    return {"budget.flops": flops_of(value)}


def check_budgets(spec: SweepSpec) -> None:
    """Budgets that are not positive numbers, arms other than headless and vanilla, a recipe
    without bits per byte: `HLMError` before anything runs."""
    for value in spec.values:
        try:
            ok = flops_of(value) > 0
        except ValueError:
            ok = False
        if not ok:
            raise HLMError(
                f"sweep.values: budget {value!r} is not a positive number of FLOPs (e.g. 4e11 "
                f"or 400G; prefixes {', '.join(SI)})"
            )
    if set(spec.objectives) - set(ARMS):
        raise HLMError("the scaling sweep compares sweep.objectives=[headless,vanilla]")
    if not spec.recipe.startswith("scaling-"):
        raise HLMError(
            f"sweep.recipe={spec.recipe}: the scaling report reads bits per byte; use "
            "scaling-tiny, scaling-cpu or scaling-paper"
        )


def budgets(spec: SweepSpec) -> list[str]:
    """The budgets from the smallest."""
    return sorted((str(v) for v in spec.values), key=flops_of)


def search_lrs(spec: SweepSpec) -> list[float]:
    """`sweep.search_samples` learning rates spaced evenly in log over `sweep.search_lr`, to 3
    significant digits (they name runs)."""
    low, high = spec.search_lr
    n = spec.search_samples
    if n == 1:
        return [float(f"{low:.3g}")]
    ratio = math.log(high / low) / (n - 1)
    return [float(f"{low * math.exp(i * ratio):.3g}") for i in range(n)]


def shared_lr(spec: SweepSpec) -> float:
    """The learning rate both arms share untuned: the preset's `optim.lr`."""
    return spec.base_config().optim.lr


def search_spec(spec: SweepSpec) -> SweepSpec:
    """Each arm at each searched learning rate, at the smallest budget, `SEARCH_SEEDS` seeds."""
    smallest = budgets(spec)[0]
    axis = spec.axis
    lr_axis = dataclasses.replace(
        axis,
        name=f"{axis.name}-lr",
        field="optim.lr",
        label="learning rate",
        column=("learning rate", "learning_rate"),
        settings=lambda value, workers: {**axis.settings(smallest, workers), "optim.lr": value},
        check=None,
        figures=(Figure("bpb_vs_lr.png", "text_bpb", "bits per byte of held-out text"),),
        short="lr",
    )
    values = tuple(search_lrs(spec))
    return dataclasses.replace(spec, axis=lr_axis, values=values, num_seeds=SEARCH_SEEDS)


def choose_lrs(rows: list[dict[str, Any]], objectives=ARMS) -> dict[str, float]:
    """Each arm's learning rate with the lowest mean bits per byte over its finished search
    trials (`rows`: the search sweep's summary rows, `value` the rate)."""
    chosen = {}
    for arm in objectives:
        scores: dict[float, list[float]] = {}
        for r in rows:
            score = r.get("downstream/score")
            if r["objective"] == arm and r["status"] == "FINISHED" and _finite(score):
                scores.setdefault(float(r["value"]), []).append(float(score))
        if not scores:
            raise HLMError(
                f"the learning-rate search has no finished {arm} trial; see its summary, fix "
                "the cause and run the same command again (finished trials are kept)"
            )
        chosen[arm] = min(scores, key=lambda lr: sum(scores[lr]) / len(scores[lr]))
    return chosen


def with_lrs(spec: SweepSpec, lrs: dict[str, float], objectives=None) -> SweepSpec:
    """`spec` (on `objectives`, default all) with each arm at its rate (`sweep.arm_overrides`)."""
    items = tuple(f"{arm}:optim.lr={lr!r}" for arm, lr in lrs.items())
    objectives = tuple(objectives or spec.objectives)
    return dataclasses.replace(
        spec, objectives=objectives, arm_overrides=(*spec.arm_overrides, *items)
    )


def shared_spec(spec: SweepSpec, chosen: dict[str, float]) -> SweepSpec | None:
    """The arms whose chosen rate is not the shared one, at the shared one (None: none)."""
    lr = shared_lr(spec)
    arms = [a for a in spec.objectives if not math.isclose(chosen[a], lr, rel_tol=1e-9)]
    return with_lrs(spec, {a: lr for a in arms}, arms) if arms else None


def names(name: str) -> dict[str, str]:
    """The three sweeps' names (their folders in runs/sweeps and their MLflow runs)."""
    return {"search": f"{name}-lr", "tuned": name, "shared": f"{name}-shared-lr"}


# ------------------------------------------------------------------------------ the command


def refuse_search(args: argparse.Namespace, axis: Axis) -> None:
    if args.search:
        raise HLMError(
            "the scaling sweep runs its own learning-rate grid for each arm (sweep.search_lr, "
            "sweep.search_samples); run it without --search"
        )


def plan_text(spec: SweepSpec, args: argparse.Namespace, name: str) -> str:
    """--dry-run: the three parts' trials (budget, arm, learning rate, seed) and their cost."""
    from hlm_ray.plan import assumptions_from, format_plan, sweep_plan
    from hlm_ray.tune.placement import plan_concurrency

    lr = shared_lr(spec)
    part = names(name)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    worst = with_lrs(spec, dict.fromkeys(spec.objectives, lr))
    parts = [
        (search_spec(spec), part["search"], "1. the learning-rate search (value = lr)"),
        (spec, part["tuned"], "2. every budget, each arm at the rate its search chose"),
        (worst, part["shared"], f"3. at most: every budget at the shared lr {lr:g}, for "
                                "the arms whose search chose another"),
    ]  # fmt: skip
    lines = [
        f"scaling sweep {name}: budgets {', '.join(budgets(spec))} FLOPs × "
        f"{{{', '.join(spec.objectives)}}} × {spec.num_seeds} seed(s); learning rates searched "
        f"{', '.join(f'{x:g}' for x in search_lrs(spec))} at the smallest budget, seed 0",
        "",
    ]
    total = 0
    for part_spec, part_name, title in parts:
        trials = len(part_spec.cells())
        total += trials
        fit = lambda nodes, s=part_spec, n=trials: plan_concurrency(s, n, nodes)  # noqa: E731
        plan = sweep_plan(part_spec, assumptions_from(args), fit=fit, name=part_name, say=say)
        lines += [f"== {title}", format_plan(plan), ""]
    lines.append(f"{total} trials at most (part 3 runs only for an arm whose search chose a rate "
                 f"other than {lr:g})")  # fmt: skip
    return "\n".join(lines)


def run_parts(spec: SweepSpec, args: argparse.Namespace, name: str):
    """The search, the tuned budgets, the shared-rate budgets; the tuned sweep's outcome, its
    rows joined by the other parts' failed ones (the exit status counts them)."""
    from hlm_ray.plan import assumptions_from
    from hlm_ray.tune.sweep import run_sweep

    started = time.perf_counter()
    part = names(name)
    kw = {"assumptions": assumptions_from(args), "storage_path": args.storage_path}
    search = run_sweep(search_spec(spec), name=part["search"], **kw)
    print(f"\n== {part['search']}: the learning-rate search\n{search.table}")
    if search.interrupted:
        return search
    chosen = choose_lrs(search.rows)
    print("chosen: " + ", ".join(f"{arm} lr {lr:g}" for arm, lr in chosen.items()))
    tuned = run_sweep(with_lrs(spec, chosen), name=part["tuned"], **kw)
    failed = [r for r in search.rows if r["status"] == "FAILED"]
    shared = shared_spec(spec, chosen)
    seconds = {"search": search.seconds, "tuned": tuned.seconds, "shared": 0.0}
    if shared is not None and not tuned.interrupted:
        other = run_sweep(shared, name=part["shared"], **kw)
        print(f"\n== {part['shared']}: at the shared lr {shared_lr(spec):g}\n{other.table}")
        failed += [r for r in other.rows if r["status"] == "FAILED"]
        tuned.interrupted = other.interrupted
        seconds["shared"] = other.seconds
    seconds["all"] = time.perf_counter() - started  # the report's time line reads it
    (tuned.folder / TIMING_FILE).write_text(json.dumps(seconds, indent=1))
    tuned.rows = [*tuned.rows, *failed]
    return tuned


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)
