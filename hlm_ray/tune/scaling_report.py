"""The compute sweep's report (`sweeps/scaling.py`): the learning-rate search and its curves, each
trial placed at the compute it spent beside its floor, and the compute multiplier with its
interval, against FLOPs and against seconds.

    files = write_report(spec, "scaling-cpu", "cpu")   # [report.md, scaling.png, lr_search.png]
    points = read_points(folder)                       # one dict per finished trial
    c = compare(points, "flops", floor=3.55)           # `scaling_fit.Comparison`

A trial's compute: FLOPs = its optimizer steps × the FLOPs per step of the FLOP model with the
U it measured, plus, for a headless decoder, its generator fine-tune (the fine-tune's tokens at
the vanilla arm's FLOPs per token: a new head of the same vocabulary); seconds = its measured
optimizer-step seconds, plus the fine-tune's. Its loss: bits per byte of held-out text (the
generator's, for a headless decoder); its floor: the unigram model of its training tokens on the
same texts (`bpb/unigram_floor`). Everything lands in runs/sweeps/<name> and on the sweep's parent
MLflow run (artifacts, description, the searched rates as parameters).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import yaml

from hlm_ray.errors import HLMError
from hlm_ray.tune import scaling, scaling_fit
from hlm_ray.tune.scaling_figures import UNITS, plot_fits, plot_search
from hlm_ray.tune.spec import SweepSpec

HEADLESS_READOUTS = {
    # arm: (what it is, its downstream metric, whether the generator fine-tune is charged)
    "headless": ("headless, fine-tuned into a generator (the paper's protocol)",
                 "bpb/bits_per_byte", True),
    "headless·prior": ("headless, never fine-tuned, read through its prior readout", "bpb/prior",
                       False),
    "headless·tied": ("headless, never fine-tuned, read through its tied embeddings", "bpb/tied",
                      False),
}  # fmt: skip
VANILLA_VARIANTS = {
    "vanilla": "vanilla",
    "vanilla+prior": "vanilla, its head's bias started at the log prior (init.prior_bias)",
}
FLOOR_METRIC = "bpb/unigram_floor"
MARGIN = 0.1
"""Bits per byte below the floor that the cpu preset is sized to reach at every budget."""


def trial_compute(summary: dict[str, Any], scores: dict[str, Any], cfg) -> tuple[float, float]:
    """(FLOPs, seconds) one trial spent: pretraining as measured, plus the headless arm's
    generator fine-tune (module docstring)."""
    from hlm_ray.budget import flops_per_step, tokens_per_step
    from hlm_ray.config import apply_overrides

    budget = summary.get("budget") or {}
    per_step = budget.get("budget/flops_per_step_measured", budget.get("budget/flops_per_step"))
    if per_step is None:
        per_step = flops_per_step(cfg, int(summary["vocab_size"]))
    flops = float(per_step) * int(summary["steps"])
    seconds = float(budget.get("budget/train_seconds", summary["seconds"]["train"]))
    tokens = float(scores.get("finetune/tokens", 0.0))
    if tokens:
        vanilla = apply_overrides(
            cfg, {"objective.name": "vanilla", "optim.embedding_update": "dense"}
        )
        per_token = flops_per_step(vanilla, int(summary["vocab_size"])) / tokens_per_step(cfg)
        flops += tokens * per_token
        seconds += float(scores.get("finetune/seconds", 0.0))
    return flops, seconds


def read_points(folder: Path, value_column: str = "budget_flops") -> list[dict[str, Any]]:
    """The finished trials of one sweep's folder: arm, seed, value, lr, steps, tokens, flops,
    seconds, bpb, its floor, the fine-tune's steps and FLOPs share."""
    from hlm_ray.config import Config

    points = []
    if not (folder / "summary.csv").is_file():
        return points
    with (folder / "summary.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            trial = folder / "trials" / row["run"]
            if row["status"] != "FINISHED" or not (trial / "downstream.json").is_file():
                continue
            summary = json.loads((trial / "summary.json").read_text())
            scores = json.loads((trial / "downstream.json").read_text())
            cfg = Config.from_dict(yaml.safe_load((trial / "config.yaml").read_text()))
            flops, seconds = trial_compute(summary, scores, cfg)
            pretrain, pretrain_s = trial_compute(summary, {}, cfg)
            points.append(
                {
                    "arm": row["objective"],
                    "seed": int(row["seed"]),
                    "budget": row[value_column],
                    "lr": cfg.optim.lr,
                    "steps": int(summary["steps"]),
                    "tokens": int(summary["tokens"]),
                    "flops": flops,
                    "seconds": seconds,
                    "bpb": float(scores["bpb/bits_per_byte"]),
                    "pretrain_flops": pretrain,
                    "pretrain_seconds": pretrain_s,
                    "readouts": {
                        k: float(v) for k, v in scores.items() if k in ("bpb/prior", "bpb/tied")
                    },  # fmt: skip
                    "floor": float(scores.get(FLOOR_METRIC, math.nan)),
                    "finetune_steps": int(scores.get("finetune/steps", 0)),
                    "finetune_share": (flops - pretrain) / flops if flops else 0.0,
                }
            )
    return points


def arm_points(points, prior_points=()) -> list[dict[str, Any]]:
    """One point per trial and way of reading it: the headless trials through each readout
    (`HEADLESS_READOUTS`: the fine-tuned generator charged its fine-tune, the others not), the
    vanilla trials as they are, and those of the prior-bias sweep as `vanilla+prior`."""
    out = []
    for p in points:
        if p["arm"] != "headless":
            out.append(p)
            continue
        for arm, (_, metric, charged) in HEADLESS_READOUTS.items():
            bpb = p["bpb"] if metric == "bpb/bits_per_byte" else p["readouts"].get(metric)
            if bpb is None:
                continue
            out.append({**p, "arm": arm, "bpb": bpb,
                        **({} if charged else {"flops": p["pretrain_flops"],
                                               "seconds": p["pretrain_seconds"],
                                               "finetune_steps": 0, "finetune_share": 0.0})})  # fmt: skip
    out += [{**p, "arm": scaling.PRIOR_ARM} for p in prior_points]
    return out


def floor_of(points: list[dict[str, Any]]) -> float | None:
    """The floor the trials measured (they share tokenizer and corpus: one number)."""
    found = [p["floor"] for p in points if math.isfinite(p["floor"])]
    return sum(found) / len(found) if found else None


def compare(
    points: list[dict[str, Any]],
    against: str,
    floor: float | None = None,
    method: str = "headless",
    baseline: str = "vanilla",
) -> scaling_fit.Comparison:
    """`method` against `baseline` (arms of `arm_points`), loss against `against` ("flops" or
    "seconds")."""
    pts = [
        scaling_fit.Point(p["arm"], p["seed"], p["budget"], p[against], p["bpb"])
        for p in points
        if p["arm"] in (method, baseline)
    ]
    try:
        return scaling_fit.compare_arms(pts, method=method, baseline=baseline, floor=floor)
    except ValueError as err:  # too few finished trials to read an arm
        raise HLMError(
            f"no report: {err}; see the sweep's summary.md, and run the same command again to "
            "retry the failed trials"
        ) from None


def search_points(root: Path, name: str) -> list[dict[str, Any]]:
    """Every finished trial of the search and its extension rounds, `budget` and `lr` apart."""
    out = []
    for folder in sorted(root.glob(f"{scaling.names(name)['search']}*")):
        if folder.name == scaling.names(name)["search"] or folder.name.startswith(
            f"{scaling.names(name)['search']}+"
        ):
            for p in read_points(folder, "budget_lr"):
                budget, lr = scaling.parse_search_value(p["budget"])
                out.append({**p, "budget": budget, "lr": lr})
    return out


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def _mean_sd(values: list[float]) -> str:
    from hlm_ray.tune.stats import describe

    s = describe(values)
    sd = f" ± {s.sd:.4f}" if math.isfinite(s.sd) else ""
    return f"{s.mean:.4f}{sd} (n={s.n})"


def search_table(points, record: dict[str, Any], floor: float | None) -> list[str]:
    lines = ["| arm | budget | lr | bits per byte (mean ± sd, n) | |", "|---|---|---|---|---|"]
    picks, edges = record.get("picks", {}), record.get("edges", {})
    for arm in sorted({p["arm"] for p in points}):
        for budget in sorted(
            {p["budget"] for p in points if p["arm"] == arm}, key=scaling.flops_of
        ):
            at = [p for p in points if p["arm"] == arm and p["budget"] == budget]
            for lr in sorted({p["lr"] for p in at}):
                bpb = [p["bpb"] for p in at if p["lr"] == lr]
                marks = []
                if math.isclose(picks.get(arm, {}).get(budget, -1), lr, rel_tol=1e-6):
                    marks.append("chosen")
                    if edges.get(arm, {}).get(budget):
                        marks.append(f"on the {edges[arm][budget]} edge of what was tried")
                if floor is not None and not scaling_fit.beats_floor(bpb, floor):
                    marks.append("not below the floor")
                lines.append(
                    f"| {arm} | {budget} | {lr:g} | {_mean_sd(bpb)} | {', '.join(marks)} |"
                )
    on_edge = [f"{a} at {b}" for a, at in edges.items() for b, side in at.items() if side]
    lines.append("")
    if on_edge:
        lines.append(
            f"Still on an edge after {record.get('extend', 0)} step(s) past it: "
            f"{'; '.join(on_edge)}: a better rate may lie beyond (widen `sweep.search_lr` or "
            "raise `sweep.search_extend`)."
        )
    else:
        lines.append("Every chosen rate lies inside what its arm tried at that budget.")
    return lines


def budget_table(points: list[dict[str, Any]], floor: float | None) -> list[str]:
    lines = [
        "| arm | budget | lr | steps | tokens | FLOPs | fine-tune (steps, share of the FLOPs) "
        "| seconds | bits per byte (mean ± sd, n) | below the floor by |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = [*HEADLESS_READOUTS, *VANILLA_VARIANTS]
    keys = sorted({(p["arm"], p["budget"]) for p in points},
                  key=lambda k: (order.index(k[0]) if k[0] in order else 99, k[0],
                                 scaling.flops_of(k[1])))  # fmt: skip
    for arm, budget in keys:
        at = [p for p in points if (p["arm"], p["budget"]) == (arm, budget)]
        lrs = ", ".join(sorted({f"{p['lr']:g}" for p in at}))

        def mean(key, pts=at):
            return sum(p[key] for p in pts) / len(pts)

        bpb = [p["bpb"] for p in at]
        ft = (f"{mean('finetune_steps'):.0f}, {mean('finetune_share'):.1%}"
              if mean("finetune_steps") else "none")  # fmt: skip
        gap = "–"
        if floor is not None:
            gap = f"{floor - mean('bpb'):+.3f}" + ("" if scaling_fit.beats_floor(bpb, floor)
                                                  else " (not below it)")  # fmt: skip
        lines.append(
            f"| {arm} | {budget} | {lrs} | {mean('steps'):,.0f} | {mean('tokens'):,.0f} | "
            f"{mean('flops'):.3g} | {ft} | {mean('seconds'):.1f} | {_mean_sd(bpb)} | {gap} |"
        )
    return lines


def multiplier_table(c: scaling_fit.Comparison, unit: str) -> list[str]:
    lines = [
        f"| budget | headless {unit} | headless bpb | vanilla {unit} to reach it (per seed) | "
        "multiplier [95% CI] | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(c.rows, key=lambda r: scaling.flops_of(r.budget)):
        reads = ", ".join("> range" if x == math.inf else "< range" if x == 0 else _fmt(x * r.method_x)
                          for x in r.reads)  # fmt: skip
        verdict = r.verdict + (f" ({r.note})" if r.note else "")
        lines.append(
            f"| {r.budget} | {_fmt(r.method_x)} | {r.target:.4f} | {reads} | "
            f"{scaling_fit.format_multiplier(r)} | {verdict} |"
        )
    return lines


def time_line(root: Path, name: str) -> str:
    """Where the command's time went: its parts' wall time (the last invocation's) against its
    trials' optimizer steps and their whole time (sums over every trial of every part)."""
    part = scaling.names(name)
    wall, train, n = 0.0, 0.0, 0
    folders = [root / part["tuned"], root / part["prior"], *sorted(root.glob(f"{part['search']}*"))]
    for folder in folders:
        if (folder / "summary.csv").is_file():
            with (folder / "summary.csv").open(newline="") as f:
                for r in csv.DictReader(f):
                    if r.get("trial/wall_s") and r.get("trial/overhead_s"):
                        n += 1
                        wall += float(r["trial/wall_s"])
                        train += float(r["trial/wall_s"]) - float(r["trial/overhead_s"])
    path = root / part["tuned"] / scaling.TIMING_FILE
    parts = json.loads(path.read_text()) if path.is_file() else None
    head = (
        f"Time: {parts['all']:.0f} s for the command (the search {parts['search']:.0f} s, the "
        f"budgets {parts['tuned']:.0f} s"
        + (f", the prior-bias arm {parts['prior']:.0f} s" if "prior" in parts else "")
        + "); "
        if parts
        else "Time: "
    )
    return (
        head + f"its {n} trials spent {train:.0f} s in optimizer steps, {wall:.0f} s in all "
        "(sums over the trials; they run side by side as the cluster allows)."
    )


def floor_line(points: list[dict[str, Any]], floor: float | None) -> str:
    """Whether every arm beats the floor at every budget, and by how much at the least."""
    if floor is None:
        return "No floor: the trials' training tokens were not found to count."
    gaps = {}
    for arm in sorted({p["arm"] for p in points}):
        for budget in {p["budget"] for p in points if p["arm"] == arm}:
            bpb = [p["bpb"] for p in points if p["arm"] == arm and p["budget"] == budget]
            gaps[(arm, budget)] = (floor - sum(bpb) / len(bpb), scaling_fit.beats_floor(bpb, floor))
    late = [f"{a} at {b}" for (a, b), (_, ok) in gaps.items() if not ok]
    least = min(gaps.items(), key=lambda kv: kv[1][0])
    said = (
        f"The floor (the unigram model of the training tokens, scored on the same texts) is "
        f"{floor:.4f} bits per byte; the smallest gap below it is {least[1][0]:+.3f} ({least[0][0]} "
        f"at {least[0][1]})"
    )
    if late:
        return said + f"; not below it: {', '.join(late)} (no verdict is read there)."
    return said + "; every arm is below it at every budget."


def readout_table(points, floor, against: str) -> list[str]:
    """The multiplier of every headless readout against every vanilla variant (budgets as
    columns): which readout, with which knowledge on either side, saves compute."""
    budgets = sorted({p["budget"] for p in points}, key=scaling.flops_of)
    lines = ["| headless read | against | " + " | ".join(budgets) + " |",
             "|---|---|" + "---|" * len(budgets)]  # fmt: skip
    present = {p["arm"] for p in points}
    for method in (m for m in HEADLESS_READOUTS if m in present):
        for baseline in (b for b in VANILLA_VARIANTS if b in present):
            try:
                c = compare(points, against, floor, method, baseline)
            except HLMError:
                continue
            cells = {r.budget: scaling_fit.format_multiplier(r)
                     + ("" if r.verdict == scaling_fit.OUTSIDE else f" {r.verdict}")
                     for r in c.rows}  # fmt: skip
            lines.append(f"| {method} | {baseline} | "
                         + " | ".join(cells.get(b, "–") for b in budgets) + " |")  # fmt: skip
    return lines


def arms_legend(points) -> list[str]:
    present = {p["arm"] for p in points}
    said = {**{k: v[0] for k, v in HEADLESS_READOUTS.items()}, **VANILLA_VARIANTS}
    return [f"- `{arm}`: {what}" for arm, what in said.items() if arm in present]


def read_time_prior(points) -> list[str]:
    """The vanilla arm with the log prior added when it is read (a check, not an arm: its
    softmax head has learnt the frequencies already, so it should score worse)."""
    rows = [p for p in points if p["arm"] == "vanilla" and "bpb/prior" in p["readouts"]]
    if not rows:
        return []
    lines = ["| budget | vanilla | vanilla with log q added when read |", "|---|---|---|"]
    for budget in sorted({p["budget"] for p in rows}, key=scaling.flops_of):
        at = [p for p in rows if p["budget"] == budget]
        lines.append(f"| {budget} | {_mean_sd([p['bpb'] for p in at])} | "
                     f"{_mean_sd([p['readouts']['bpb/prior'] for p in at])} |")  # fmt: skip
    return lines


def write_report(spec: SweepSpec, name: str, preset: str) -> list[Path]:
    """report.md, scaling.png and lr_search.png in runs/sweeps/<name>, logged on its parent run;
    the files, report.md first."""
    from hlm_ray.paths import resolve_output
    from hlm_ray.tune.report import log_to_parent
    from hlm_ray.tune.sweep import SWEEPS_DIR

    root = resolve_output(SWEEPS_DIR)
    part = scaling.names(name)
    folder = root / part["tuned"]
    record_path = folder / scaling.SEARCH_FILE
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    trials = read_points(folder)
    points = arm_points(trials, read_points(root / part["prior"]))
    searched = search_points(root, name)
    floor = floor_of(trials + searched)
    c = {k: compare(points, k, floor) for k in UNITS}
    prior = {k: compare(points, k, floor, "headless·prior") for k in UNITS}
    seeds = f"{spec.num_seeds} seed{'s' if spec.num_seeds > 1 else ''} per arm"
    scale = f"the {preset} scale"
    rates = record.get("rates", {})
    said_rates = "; ".join(f"{arm} " + ", ".join(f"{b} {lr:g}" for b, lr in at.items())
                           for arm, at in rates.items())  # fmt: skip
    text = [
        f"# Compute multiplier: preset {preset}, {seeds}",
        "",
        "- **The paper's protocol, against FLOPs** (headless fine-tuned into a generator, the "
        "fine-tune charged; each arm at its searched rates): "
        + scaling_fit.closing_sentence(c["flops"], "FLOPs", scale),
        "- **The same against measured training seconds** (what a user pays): "
        + scaling_fit.closing_sentence(c["seconds"], "training seconds", scale),
        "- **Headless read through its prior, never fine-tuned, against FLOPs**: "
        + scaling_fit.closing_sentence(prior["flops"], "FLOPs", scale),
        f"- **Floors**: {floor_line(points, floor)}",
        "",
        *arms_legend(points),
        "",
        "## The learning-rate search (the smallest and the largest budget)",
        "",
        *search_table(searched, record, floor),
        "",
        f"Rates used at each budget (found at the ends, interpolated between): {said_rates}."
        + (
            " The prior-bias vanilla arm trains at vanilla's rates."
            if scaling.PRIOR_ARM in {p["arm"] for p in points}
            else ""
        ),
        "",
        "![The learning-rate search: bits per byte against the rate](lr_search.png)",
        "",
        "## The budgets",
        "",
        *budget_table(points, floor),
        "",
        *read_time_prior(trials),
        "",
        "## Multiplier against FLOPs: every headless readout against every vanilla arm",
        "",
        *readout_table(points, floor, "flops"),
        "",
        "## The paper's protocol against FLOPs, per seed pair",
        "",
        *multiplier_table(c["flops"], "FLOPs"),
        "",
        "## Multiplier against training seconds",
        "",
        *readout_table(points, floor, "seconds"),
        "",
        "How to read it: the multiplier at a budget is the compute a vanilla arm needs to reach "
        "the bits per byte a headless readout reaches there, over the headless arm's compute (> 1: "
        "headless saves compute). It is read for each seed pair (headless seed i against vanilla "
        "seed i, whose measured points are joined in ln compute) and only between vanilla's "
        "measured budgets: outside them the row says so and gives no number. The estimate is the "
        "geometric mean over seed pairs, the interval a 95% t interval of their logarithms; "
        "*holds* when it lies above 1, *reversed* below 1, else *cannot be told apart*; *no "
        "verdict* where an arm does not beat the floor. Compute: pretraining FLOPs of the FLOP "
        "model with the measured U, plus, for the fine-tuned headless arm only, its generator "
        "fine-tune (its share printed per budget); counting tokens for the prior is free; "
        "seconds: measured optimizer steps, plus the fine-tune. Both arms update their "
        "embeddings densely: the arms differ only in the objective (and `vanilla+prior` in where "
        "its head's bias starts).",
        "",
        time_line(root, name),
        "",
        "![Bits per byte against FLOPs and seconds](scaling.png)",
    ]
    png = plot_fits({k: _with_points(c[k], points, k) for k in UNITS}, folder / "scaling.png",
               f"{name}: each arm at its searched rates, {seeds}")  # fmt: skip
    png_search = plot_search(searched, folder / "lr_search.png",
                             f"{name}: the learning-rate search", floor)  # fmt: skip
    md = folder / "report.md"
    md.write_text("\n".join(text) + "\n")
    params = {f"scaling.lr.{arm}.{b}": lr for arm, at in rates.items() for b, lr in at.items()}
    params["scaling.search_sweep"] = part["search"]
    files = [md, png, png_search]
    log_to_parent(folder, files, md.read_text(), spec.experiment, params=params)
    return files


def _with_points(c: scaling_fit.Comparison, points, against: str) -> scaling_fit.Comparison:
    """`c` drawn with every arm's points (its multiplier stays the protocol's)."""
    from dataclasses import replace

    pts = [scaling_fit.Point(p["arm"], p["seed"], p["budget"], p[against], p["bpb"])
           for p in points]  # fmt: skip
    return replace(c, points=pts)
