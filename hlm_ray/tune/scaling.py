"""The compute sweep (`sweeps/scaling.py`): both arms of a decoder at budgets in FLOPs, each arm at
learning rates searched at the smallest and at the largest budget.

    Axis("scaling", "budget.flops", ..., settings=budget_settings, check=check_budgets)
    search = search_spec(spec)               # each arm × lr × {smallest, largest budget} × seeds
    found = search_scores(rows)              # {arm: {budget: {lr: [bits per byte per seed]}}}
    picks = choose_lrs(found)                # {arm: {budget: lr}}: the lowest mean
    more = extensions(spec, found, picks)    # {arm: ["2T@0.0316"]}: past an edge of the grid
    rates = lr_schedule(spec, picks)         # {arm: {budget: lr}}: found at the ends, between
    main = with_lrs(spec, rates)             #   interpolated in (ln lr, ln budget)
    print(plan_text(spec, args, "scaling-cpu"))   # --dry-run: every trial, steps, head share
    arm_lines(spec); generator_cost(spec)    # the head's share, each arm's steps; the fine-tune

One run is several sweeps, each its own folder and MLflow parent run: `<name>-lr` (the search:
both arms, each rate of the grid, `sweep.search_seeds` seeds, at the smallest and the largest
budget, scored on bits per byte); where an arm's best rate at a budget is the lowest or highest
it tried there, `<name>-lr+<k>-<arm>` tries one grid step past that edge (round k, that arm
alone), up to `sweep.search_extend` rounds, and the report says where a best rate still sits on
an edge; then `<name>`, every budget × arm × seed, each arm at the rate found at each end and at
rates interpolated between them (recorded as `sweep.arm_overrides`, `arm@budget:optim.lr=`).
`hlm_ray.tune.scaling_report` reads them. Budgets are FLOPs with an SI prefix (`"400G"`,
`"1.6T"`; a plain number works too): strings, so run names and tables stay short. A search
value is a budget and a rate, `"500G@0.001"`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

from hlm_ray.errors import HLMError
from hlm_ray.tune.axis import Axis, Value
from hlm_ray.tune.spec import SweepSpec

ARMS = ("headless", "vanilla")
SI = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
AT = "@"
"""Joins a search value's budget and learning rate: `500G@0.001`."""
TIMING_FILE = "timing.json"
"""Wall seconds of the last invocation's parts, in the main sweep's folder."""
SEARCH_FILE = "lr_search.json"
"""What the search found (scores, picks, extensions, edges, the schedule), beside TIMING_FILE."""


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
    without bits per byte, a search grid of fewer than 3 rates: `HLMError` before anything
    runs."""
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
    if spec.search_samples < 2 or (spec.search_extend and spec.search_samples < 3):
        raise HLMError(
            f"sweep.search_samples={spec.search_samples}: the learning-rate grid needs 3 or more "
            "rates (2 with sweep.search_extend=0: then the best is always on an edge, said so)"
        )


def budgets(spec: SweepSpec) -> list[str]:
    """The budgets from the smallest."""
    return sorted((str(v) for v in spec.values), key=flops_of)


def search_budgets(spec: SweepSpec) -> list[str]:
    """Where the rates are searched: the smallest and the largest budget."""
    b = budgets(spec)
    return [b[0], b[-1]] if len(b) > 1 else b


def search_lrs(spec: SweepSpec) -> list[float]:
    """`sweep.search_samples` learning rates spaced evenly in log over `sweep.search_lr`, to 3
    significant digits (they name runs)."""
    return [grid_rate(spec, i) for i in range(spec.search_samples)]


def grid_step(spec: SweepSpec) -> float:
    """The ratio between neighbouring rates of the grid (what an extension steps by)."""
    low, high = spec.search_lr
    return (high / low) ** (1.0 / max(1, spec.search_samples - 1))


def grid_rate(spec: SweepSpec, k: int) -> float:
    """The grid's k-th rate (k < 0 or past the end: the grid continued), to 3 significant
    digits."""
    return float(f"{spec.search_lr[0] * grid_step(spec) ** k:.3g}")


def grid_index(spec: SweepSpec, lr: float) -> int:
    return round(math.log(lr / spec.search_lr[0]) / math.log(grid_step(spec)))


def search_value(budget: str, lr: float) -> str:
    return f"{budget}{AT}{float(f'{lr:.3g}'):g}"


def parse_search_value(value: Value) -> tuple[str, float]:
    budget, at, lr = str(value).partition(AT)
    if not at:
        raise HLMError(f"search value {value!r} must look like budget{AT}lr, e.g. 500G{AT}0.001")
    return budget, float(lr)


def _search_settings(value: Value, workers: int) -> dict[str, Any]:
    budget, lr = parse_search_value(value)
    return {**budget_settings(budget, workers), "optim.lr": lr}


def search_spec(
    spec: SweepSpec, values: list[str] | None = None, objectives: tuple[str, ...] | None = None
) -> SweepSpec:
    """Each arm at each rate of the grid at the smallest and the largest budget,
    `sweep.search_seeds` seeds (or the given search `values` and arms: an extension round)."""
    axis = spec.axis
    lr_axis = dataclasses.replace(
        axis,
        name=f"{axis.name}-lr",
        field="optim.lr",
        label="budget and learning rate",
        column=("budget @ learning rate", "budget_lr"),
        settings=_search_settings,
        check=None,
        figures=(),
        short="lr",
        log_x=False,
    )
    values = values or [
        search_value(b, lr) for b in search_budgets(spec) for lr in search_lrs(spec)
    ]
    return dataclasses.replace(
        spec,
        axis=lr_axis,
        values=tuple(values),
        num_seeds=spec.search_seeds,
        objectives=tuple(objectives or spec.objectives),
    )


def search_scores(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[float, list[float]]]]:
    """{arm: {budget: {lr: [score of each finished seed]}}} from search summary rows (`value`
    the search value, `downstream/score` bits per byte)."""
    out: dict[str, dict[str, dict[float, list[float]]]] = {}
    for r in rows:
        score = r.get("downstream/score")
        if r["status"] != "FINISHED" or not _finite(score):
            continue
        budget, lr = parse_search_value(r["value"])
        out.setdefault(r["objective"], {}).setdefault(budget, {}).setdefault(lr, []).append(
            float(score)
        )
    return out


def choose_lrs(
    found, objectives=ARMS, where: list[str] | None = None
) -> dict[str, dict[str, float]]:
    """Each arm's rate with the lowest mean bits per byte over its seeds, at each searched
    budget (`where`: the budgets that must have one)."""
    picks: dict[str, dict[str, float]] = {}
    for arm in objectives:
        for budget in where or sorted(found.get(arm, {}), key=flops_of):
            scores = found.get(arm, {}).get(budget)
            if not scores:
                raise HLMError(
                    f"the learning-rate search has no finished {arm} trial at {budget}; see its "
                    "summary, fix the cause and run the same command again (finished trials "
                    "are kept)"
                )
            mean = {lr: sum(v) / len(v) for lr, v in scores.items()}
            picks.setdefault(arm, {})[budget] = min(mean, key=mean.get)
    return picks


def edge(found, arm: str, budget: str, lr: float) -> str | None:
    """ "low" or "high" when `lr` is the lowest or highest rate tried for the arm there."""
    tried = sorted(found[arm][budget])
    if len(tried) < 2:
        return None
    return "low" if lr == tried[0] else "high" if lr == tried[-1] else None


def extensions(spec: SweepSpec, found, picks: dict[str, dict[str, float]]) -> dict[str, list[str]]:
    """{arm: [search values]}: one grid step past the edge where an arm's best rate sits on the
    edge of what it tried, unless `sweep.search_extend` steps were already taken there."""
    grid = search_lrs(spec)
    more: dict[str, list[str]] = {}
    for arm, at in picks.items():
        for budget, lr in at.items():
            side = edge(found, arm, budget, lr)
            tried = found[arm][budget]
            taken = sum(1 for x in tried if x < grid[0] * 0.999 or x > grid[-1] * 1.001)
            if side and taken < spec.search_extend:
                k = grid_index(spec, lr) + (-1 if side == "low" else 1)
                more.setdefault(arm, []).append(search_value(budget, grid_rate(spec, k)))
    return more


def lr_schedule(spec: SweepSpec, picks: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """{arm: {budget: lr}}: the rate found at the smallest and the largest budget, and between
    them the straight line in (ln budget, ln lr), to 3 significant digits."""
    ends = search_budgets(spec)
    out: dict[str, dict[str, float]] = {}
    for arm, found in picks.items():
        lo, hi = found[ends[0]], found[ends[-1]]
        x0, x1 = math.log(flops_of(ends[0])), math.log(flops_of(ends[-1]))
        for budget in budgets(spec):
            t = 0.0 if x1 == x0 else (math.log(flops_of(budget)) - x0) / (x1 - x0)
            lr = math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo)))
            out.setdefault(arm, {})[budget] = float(f"{lr:.3g}")
    return out


def with_lrs(spec: SweepSpec, rates: dict[str, dict[str, float]]) -> SweepSpec:
    """`spec` with each arm at its rate at each budget (`arm@budget:optim.lr=...`)."""
    items = tuple(
        f"{arm}{AT}{budget}:optim.lr={lr!r}"
        for arm, at in rates.items()
        for budget, lr in at.items()
    )
    return dataclasses.replace(spec, arm_overrides=(*spec.arm_overrides, *items))


def names(name: str) -> dict[str, str]:
    """The sweeps' names (their folders in runs/sweeps and their MLflow runs)."""
    return {"search": f"{name}-lr", "tuned": name, "prior": f"{name}-prior"}


PRIOR_ARM = "vanilla+prior"
"""The vanilla arm trained with its head's bias started at the log prior (`init.prior_bias`)."""


def prior_spec(spec: SweepSpec, rates: dict[str, dict[str, float]]) -> SweepSpec:
    """Every budget × seed of the vanilla arm, its head's bias started at the log prior of the
    training tokens, at the vanilla arm's rates (not searched again: the bias changes where the
    head starts, not the optimizer)."""
    alone = dataclasses.replace(
        spec,
        objectives=("vanilla",),
        # An arm's setting: the base preset's objective is headless, which refuses the bias.
        arm_overrides=(*(a for a in spec.arm_overrides if a.startswith("vanilla")),
                       "vanilla:init.prior_bias=true"),
    )  # fmt: skip
    return with_lrs(alone, {"vanilla": rates["vanilla"]})


def extension_name(name: str, round_: int, arm: str) -> str:
    return f"{name}-lr+{round_}-{arm}"


# ------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class GeneratorCost:
    """The headless arm's generator fine-tune: the same at every budget."""

    steps: int
    tokens: int
    flops: float
    """Its tokens at the vanilla arm's FLOPs per token (a new head of the same vocabulary)."""


def generator_cost(spec: SweepSpec) -> GeneratorCost:
    from hlm_ray.budget import flops_per_step, tokens_per_step
    from hlm_ray.config import apply_overrides
    from hlm_ray.downstream import DOWNSTREAM
    from hlm_ray.finetune.clm import RECIPES
    from hlm_ray.tune.families import vocab_size_of

    plan = DOWNSTREAM[spec.recipe]
    settings = {**RECIPES[plan["clm_recipe"]], **plan.get("clm_settings", {})}
    vanilla = spec.cell_config(budgets(spec)[0], "vanilla", 0)
    per_token = flops_per_step(vanilla, vocab_size_of(vanilla)) / tokens_per_step(vanilla)
    clm = apply_overrides(vanilla, {"optim.global_batch_size": settings["optim.global_batch_size"],
                                    "optim.micro_batch_size": 1})  # fmt: skip
    steps = int(settings["optim.max_steps"])
    tokens = steps * tokens_per_step(clm)
    return GeneratorCost(steps, tokens, tokens * per_token)


def arm_lines(spec: SweepSpec) -> list[str]:
    """The dry run's lines: the head's share of a vanilla step, then per budget each arm's
    optimizer steps and tokens and the fine-tune's share of the headless arm's FLOPs."""
    from hlm_ray.budget import flops_per_step
    from hlm_ray.flops import config_step_flops
    from hlm_ray.tune.families import flops_steps, vocab_size_of

    first = budgets(spec)[0]
    vanilla = spec.cell_config(first, "vanilla", 0)
    headless = spec.cell_config(first, "headless", 0)
    v = vocab_size_of(vanilla)
    share = config_step_flops(vanilla, v).head_share
    ratio = flops_per_step(vanilla, v) / flops_per_step(headless, v)
    gen = generator_cost(spec)
    per_step = vanilla.optim.global_batch_size * vanilla.data.seq_len
    lines = [
        f"the vocabulary head is {share:.0%} of a vanilla step's FLOPs (V = {v:,}, d = "
        f"{vanilla.model.hidden_size}, {vanilla.model.num_layers} layers); a vanilla step costs "
        f"{ratio:.2f}× a headless one; embedding update: headless "
        f"{headless.optim.embedding_update}, vanilla {vanilla.optim.embedding_update}",
        f"the headless arm's generator fine-tune: {gen.steps} optimizer steps, {gen.tokens:,} "
        f"tokens, {gen.flops:.3g} FLOPs (charged to the headless arm)",
        "",
        "| budget | vanilla steps | headless steps (bound U) | tokens per step | fine-tune share "
        "of the headless arm's FLOPs |",
        "|---|---|---|---|---|",
    ]
    for budget in budgets(spec):
        flops = flops_of(budget)
        steps = {
            a: flops_steps(spec.cell_config(budget, a, 0), flops) for a in ("vanilla", "headless")
        }
        lines.append(
            f"| {budget} | {steps['vanilla']:,} | {steps['headless']:,} | {per_step:,} | "
            f"{gen.flops / (flops + gen.flops):.1%} |"
        )
    return lines


# ------------------------------------------------------------------------------ the command


def refuse_search(args: argparse.Namespace, axis: Axis) -> None:
    if args.search:
        raise HLMError(
            "the scaling sweep runs its own learning-rate grid for each arm (sweep.search_lr, "
            "sweep.search_samples, sweep.search_seeds); run it without --search"
        )


def plan_text(spec: SweepSpec, args: argparse.Namespace, name: str) -> str:
    """--dry-run: the search's and the budgets' trials (budget, arm, learning rate, seed), each
    arm's optimizer and fine-tune steps, the head's share of a vanilla step, and the cost."""
    from hlm_ray.plan import assumptions_from, format_plan, sweep_plan
    from hlm_ray.tune.placement import plan_concurrency

    part = names(name)
    ends = search_budgets(spec)
    guess = lr_schedule(
        spec, dict.fromkeys(spec.objectives, dict.fromkeys(ends, search_lrs(spec)[1]))
    )
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    parts = [
        (search_spec(spec), part["search"], "1. the learning-rate search (value = budget@lr)"),
        (with_lrs(spec, guess), part["tuned"], "2. every budget, each arm at the rates its "
         "search found (priced here at the grid's middle rate)"),
    ]  # fmt: skip
    if spec.vanilla_prior_arm:
        parts.append((prior_spec(spec, guess), part["prior"], "3. every budget, vanilla with its "
                      "head's bias started at the log prior (init.prior_bias), at vanilla's rates"))  # fmt: skip
    lines = [
        f"scaling sweep {name}: budgets {', '.join(budgets(spec))} FLOPs "
        f"({flops_of(ends[-1]) / flops_of(ends[0]):.0f}× span) × {{{', '.join(spec.objectives)}}}"
        f" × {spec.num_seeds} seed(s)",
        f"learning rates searched: {', '.join(f'{x:g}' for x in search_lrs(spec))} at "
        f"{' and '.join(ends)}, seeds 0..{spec.search_seeds - 1}; where an arm's best rate is the "
        f"lowest or highest it tried at a budget, one step past it (×{grid_step(spec):.3g}) is "
        f"tried too, at most {spec.search_extend} step(s) per edge (sweeps {name}-lr+<round>-<arm>); "
        "between the two budgets each arm's rate is interpolated in (ln budget, ln lr)",
        "",
        *arm_lines(spec),
        "",
    ]
    total = 0
    for part_spec, part_name, title in parts:
        trials = len(part_spec.cells())
        total += trials
        fit = lambda nodes, s=part_spec, n=trials: plan_concurrency(s, n, nodes)  # noqa: E731
        plan = sweep_plan(part_spec, assumptions_from(args), fit=fit, name=part_name, say=say)
        lines += [f"== {title}", format_plan(plan), ""]
    per_round = 2 * spec.search_seeds
    lines.append(
        f"{total} trials, plus {per_round} per grid extension (an arm's {spec.search_seeds} seeds "
        "at one budget), at most "
        f"{spec.search_extend * len(ends) * 2 * len(spec.objectives) * spec.search_seeds} "
        "more in all"
    )
    return "\n".join(lines)


def run_parts(spec: SweepSpec, args: argparse.Namespace, name: str, verbose: int = 0):
    """The search (and its extensions), then the budgets; the main sweep's outcome, its rows
    joined by the search's failed ones (the exit status counts them). Each part's table is
    said on the console (`say`); Ray's and Tune's output go to the main sweep's sweep.log."""
    from hlm_ray.console import say
    from hlm_ray.plan import assumptions_from
    from hlm_ray.tune.sweep import run_sweep

    started = time.perf_counter()
    part = names(name)
    kw = {"assumptions": assumptions_from(args), "storage_path": args.storage_path,
          "verbose": verbose}  # fmt: skip
    search = run_sweep(search_spec(spec), name=part["search"], **kw)
    say(f"\n== {part['search']}: the learning-rate search\n{search.table}")
    if search.interrupted:
        return search
    rows, failed = list(search.rows), [r for r in search.rows if r["status"] == "FAILED"]
    seconds = {"search": search.seconds}
    for round_ in range(1, spec.search_extend + 1):
        found = search_scores(rows)
        more = extensions(spec, found, choose_lrs(found, spec.objectives, search_budgets(spec)))
        if not more:
            break
        for arm, values in more.items():
            ext = run_sweep(search_spec(spec, values, (arm,)),
                            name=extension_name(name, round_, arm), **kw)  # fmt: skip
            say(f"\n== {ext.name}: {arm}, one step past the grid's edge\n{ext.table}")
            rows += ext.rows
            failed += [r for r in ext.rows if r["status"] == "FAILED"]
            seconds["search"] += ext.seconds
            if ext.interrupted:
                return ext
    found = search_scores(rows)
    picks = choose_lrs(found, spec.objectives, search_budgets(spec))
    rates = lr_schedule(spec, picks)
    say("rates: " + "; ".join(
        f"{arm} " + ", ".join(f"{b} {lr:g}" for b, lr in at.items()) for arm, at in rates.items()
    ))  # fmt: skip
    tuned = run_sweep(with_lrs(spec, rates), name=part["tuned"], **kw)
    seconds["tuned"] = tuned.seconds
    if spec.vanilla_prior_arm and not tuned.interrupted:
        prior = run_sweep(prior_spec(spec, rates), name=part["prior"], **kw)
        say(f"\n== {part['prior']}: vanilla, its head's bias started at the log prior\n"
              f"{prior.table}")  # fmt: skip
        failed += [r for r in prior.rows if r["status"] == "FAILED"]
        seconds["prior"] = prior.seconds
        tuned.interrupted = prior.interrupted
    seconds["all"] = time.perf_counter() - started  # the report's time line reads it
    (tuned.folder / TIMING_FILE).write_text(json.dumps(seconds, indent=1))
    record = {
        "scores": {a: {b: {f"{lr:g}": v for lr, v in at.items()} for b, at in by.items()}
                   for a, by in found.items()},
        "picks": picks,
        "edges": {a: {b: edge(found, a, b, lr) for b, lr in at.items()} for a, at in picks.items()},
        "rates": rates,
        "extend": spec.search_extend,
    }  # fmt: skip
    (tuned.folder / SEARCH_FILE).write_text(json.dumps(record, indent=1))
    tuned.rows = [*tuned.rows, *failed]
    return tuned


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)
