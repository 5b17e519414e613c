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
from hlm_ray.tune.spec import SweepSpec

COLORS = {"headless": "tab:blue", "vanilla": "tab:orange"}
UNITS = {"flops": "FLOPs", "seconds": "training seconds"}
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
            pretrain = trial_compute(summary, {}, cfg)[0]
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
                    "floor": float(scores.get(FLOOR_METRIC, math.nan)),
                    "finetune_steps": int(scores.get("finetune/steps", 0)),
                    "finetune_share": (flops - pretrain) / flops if flops else 0.0,
                }
            )
    return points


def floor_of(points: list[dict[str, Any]]) -> float | None:
    """The floor the trials measured (they share tokenizer and corpus: one number)."""
    found = [p["floor"] for p in points if math.isfinite(p["floor"])]
    return sum(found) / len(found) if found else None


def compare(
    points: list[dict[str, Any]], against: str, floor: float | None = None
) -> scaling_fit.Comparison:
    """Headless against vanilla, loss against `against` ("flops" or "seconds")."""
    pts = [
        scaling_fit.Point(p["arm"], p["seed"], p["budget"], p[against], p["bpb"]) for p in points
    ]
    try:
        return scaling_fit.compare_arms(pts, method="headless", baseline="vanilla", floor=floor)
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
    keys = sorted({(p["arm"], p["budget"]) for p in points},
                  key=lambda k: (k[0], scaling.flops_of(k[1])))  # fmt: skip
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


def plot(comparisons: dict[str, scaling_fit.Comparison], out_png: Path, title: str) -> Path:
    """One panel per compute unit: each seed a dot, each arm's mean per budget joined by lines
    (what the multiplier is read from), its fit dashed (a description), the floor, and the
    multiplier at the largest budget where it is read."""
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    fig = Figure(figsize=(5.2 * len(comparisons), 4.2), layout="constrained")
    fig.suptitle(title, fontsize=10)
    for i, (against, c) in enumerate(comparisons.items()):
        ax = fig.add_subplot(1, len(comparisons), i + 1)
        curves = scaling_fit.fit_arms(c.points)
        for arm in (c.baseline, c.method):
            mine = [p for p in c.points if p.arm == arm]
            color = COLORS.get(arm)
            ax.scatter([p.x for p in mine], [p.loss for p in mine], s=12, alpha=0.4, color=color)
            means = scaling_fit.budget_means(mine)
            ys = [np.mean([p.loss for p in mine if p.budget == b]) for b in means]
            ax.plot(list(means.values()), ys, "o-", color=color, mfc="white", label=arm)
            if arm in curves:
                grid = np.geomspace(min(means.values()), max(means.values()), 100)
                ax.plot(grid, curves[arm](grid), "--", lw=0.8, color=color,
                        label=f"fit: {curves[arm].describe()}")  # fmt: skip
        if c.floor is not None:
            ax.axhline(c.floor, color="gray", ls=":", lw=1.2,
                       label=f"floor: unigram of the training tokens ({c.floor:.3f})")  # fmt: skip
        read = [r for r in c.rows if math.isfinite(r.estimate)]
        if read:
            last = read[-1]
            need = last.estimate * last.method_x
            ax.annotate("", xy=(need, last.target), xytext=(last.method_x, last.target),
                        arrowprops={"arrowstyle": "->", "color": "k"})  # fmt: skip
            ax.text(math.sqrt(need * last.method_x), last.target,
                    scaling_fit.format_multiplier(last), ha="center", va="bottom", fontsize=8)  # fmt: skip
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # a decade's minor labels overlap
        ax.set_xlabel(f"{UNITS[against]} (log)")
        ax.set_ylabel("bits per byte of held-out text")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    return out_png


def plot_search(points: list[dict[str, Any]], out_png: Path, title: str, floor) -> Path:
    """The search's curves: one panel per arm, bits per byte against the rate, a line per
    budget (mean over seeds, ±1 sd), each seed a dot, the floor dotted."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    from hlm_ray.tune.stats import describe

    arms = sorted({p["arm"] for p in points})
    fig = Figure(figsize=(4.6 * max(1, len(arms)), 3.8), layout="constrained")
    fig.suptitle(title, fontsize=10)
    for i, arm in enumerate(arms):
        ax = fig.add_subplot(1, len(arms), i + 1)
        for budget in sorted(
            {p["budget"] for p in points if p["arm"] == arm}, key=scaling.flops_of
        ):
            at = [p for p in points if p["arm"] == arm and p["budget"] == budget]
            lrs = sorted({p["lr"] for p in at})
            stats = [describe([p["bpb"] for p in at if p["lr"] == lr]) for lr in lrs]
            sds = [s.sd if math.isfinite(s.sd) else 0.0 for s in stats]
            line = ax.errorbar(lrs, [s.mean for s in stats], yerr=sds, fmt="o-", capsize=3,
                               label=f"{budget} FLOPs")  # fmt: skip
            ax.scatter([p["lr"] for p in at], [p["bpb"] for p in at], s=10, alpha=0.4,
                       color=line[0].get_color())  # fmt: skip
        if floor is not None:
            ax.axhline(floor, color="gray", ls=":", lw=1.2, label=f"floor ({floor:.3f})")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 0.001, not 10^-3
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(sorted({p["lr"] for p in points if p["arm"] == arm}))
        ax.set_xlabel("learning rate (log)")
        ax.set_ylabel("bits per byte of held-out text")
        ax.set_title(arm, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    return out_png


def time_line(root: Path, name: str) -> str:
    """Where the command's time went: its parts' wall time (the last invocation's) against its
    trials' optimizer steps and their whole time (sums over every trial of every part)."""
    part = scaling.names(name)
    wall, train, n = 0.0, 0.0, 0
    folders = [root / part["tuned"], *sorted(root.glob(f"{part['search']}*"))]
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
        f"budgets {parts['tuned']:.0f} s); "
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


def write_report(spec: SweepSpec, name: str, preset: str) -> list[Path]:
    """report.md, scaling.png and lr_search.png in runs/sweeps/<name>, logged on its parent run;
    the files, report.md first."""
    from hlm_ray.paths import resolve_output
    from hlm_ray.tune.report import log_to_parent
    from hlm_ray.tune.sweep import SWEEPS_DIR

    root = resolve_output(SWEEPS_DIR)
    folder = root / scaling.names(name)["tuned"]
    record_path = folder / scaling.SEARCH_FILE
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    points = read_points(folder)
    searched = search_points(root, name)
    floor = floor_of(points + searched)
    c = {k: compare(points, k, floor) for k in UNITS}
    seeds = f"{spec.num_seeds} seed{'s' if spec.num_seeds > 1 else ''} per arm"
    scale = f"the {preset} scale"
    rates = record.get("rates", {})
    said_rates = "; ".join(f"{arm} " + ", ".join(f"{b} {lr:g}" for b, lr in at.items())
                           for arm, at in rates.items())  # fmt: skip
    text = [
        f"# Compute multiplier: preset {preset}, {seeds}",
        "",
        "- **Against FLOPs** (each arm at its searched rates): "
        + scaling_fit.closing_sentence(c["flops"], "FLOPs", scale),
        "- **Against measured training seconds** (what a user pays): "
        + scaling_fit.closing_sentence(c["seconds"], "training seconds", scale),
        f"- **Floors**: {floor_line(points, floor)}",
        "",
        "## The learning-rate search (the smallest and the largest budget)",
        "",
        *search_table(searched, record, floor),
        "",
        f"Rates used at each budget (found at the ends, interpolated between): {said_rates}.",
        "",
        "![The learning-rate search: bits per byte against the rate](lr_search.png)",
        "",
        "## The budgets",
        "",
        *budget_table(points, floor),
        "",
        "## Multiplier against FLOPs",
        "",
        *multiplier_table(c["flops"], "FLOPs"),
        "",
        "## Multiplier against training seconds",
        "",
        *multiplier_table(c["seconds"], "s"),
        "",
        "How to read it: the multiplier at a budget is the compute the vanilla arm needs to reach "
        "the bits per byte the headless arm reaches there, over the headless arm's compute (> 1: "
        "headless saves compute). It is read for each seed pair (headless seed i against vanilla "
        "seed i, whose measured points are joined in ln compute) and only between vanilla's "
        "measured budgets: outside them the row says so and gives no number. The estimate is the "
        "geometric mean over seed pairs, the interval a 95% t interval of their logarithms; "
        "*holds* when it lies above 1, *reversed* below 1, else *cannot be told apart*; *no "
        "verdict* where an arm does not beat the floor. Compute: pretraining FLOPs of the FLOP "
        "model with the measured U, plus the headless arm's generator fine-tune (its share "
        "printed per budget); seconds: measured optimizer steps, plus the fine-tune. Both arms "
        "update their embeddings densely: the arms differ only in the objective.",
        "",
        time_line(root, name),
        "",
        "![Bits per byte against FLOPs and seconds](scaling.png)",
    ]
    png = plot(c, folder / "scaling.png", f"{name}: each arm at its searched rates, {seeds}")
    png_search = plot_search(searched, folder / "lr_search.png",
                             f"{name}: the learning-rate search", floor)  # fmt: skip
    md = folder / "report.md"
    md.write_text("\n".join(text) + "\n")
    params = {f"scaling.lr.{arm}.{b}": lr for arm, at in rates.items() for b, lr in at.items()}
    params["scaling.search_sweep"] = scaling.names(name)["search"]
    files = [md, png, png_search]
    log_to_parent(folder, files, md.read_text(), spec.experiment, params=params)
    return files
