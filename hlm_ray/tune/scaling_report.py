"""The compute sweep's report (`sweeps/scaling.py`): each trial placed at the compute it spent,
both arms fitted, the compute multiplier with its interval, against FLOPs and against seconds,
at the tuned and at the shared learning rate.

    files = write_report(spec, "scaling-cpu", "cpu")   # [report.md, scaling.png, ...]
    points = read_points(folder)                       # one dict per finished trial
    c = compare(points, "flops")                       # `scaling_fit.Comparison`

A trial's compute: FLOPs = its optimizer steps × the FLOPs per step of the FLOP model with the
U it measured, plus, for a headless decoder, its generator fine-tune (the fine-tune's tokens at
the vanilla arm's FLOPs per token: a new head of the same vocabulary); seconds = its measured
optimizer-step seconds, plus the fine-tune's seconds. Its loss: bits per byte of held-out text
(the generator's, for a headless decoder). Everything lands in runs/sweeps/<name> and on the
sweep's parent MLflow run (artifacts, description, the chosen learning rates as parameters).
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


def read_points(folder: Path) -> list[dict[str, Any]]:
    """The finished trials of one scaling sweep's folder: arm, seed, budget, lr, steps,
    tokens, flops, seconds, bpb."""
    from hlm_ray.config import Config

    points = []
    with (folder / "summary.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            trial = folder / "trials" / row["run"]
            if row["status"] != "FINISHED" or not (trial / "downstream.json").is_file():
                continue
            summary = json.loads((trial / "summary.json").read_text())
            scores = json.loads((trial / "downstream.json").read_text())
            cfg = Config.from_dict(yaml.safe_load((trial / "config.yaml").read_text()))
            flops, seconds = trial_compute(summary, scores, cfg)
            points.append(
                {
                    "arm": row["objective"],
                    "seed": int(row["seed"]),
                    "budget": row["budget_flops"],
                    "lr": cfg.optim.lr,
                    "steps": int(summary["steps"]),
                    "tokens": int(summary["tokens"]),
                    "flops": flops,
                    "seconds": seconds,
                    "bpb": float(scores["bpb/bits_per_byte"]),
                }
            )
    return points


def compare(points: list[dict[str, Any]], against: str) -> scaling_fit.Comparison:
    """Headless against vanilla, loss against `against` ("flops" or "seconds")."""
    pts = [
        scaling_fit.Point(p["arm"], p["seed"], p["budget"], p[against], p["bpb"]) for p in points
    ]
    try:
        return scaling_fit.compare_arms(pts, method="headless", baseline="vanilla")
    except ValueError as err:  # too few finished trials to fit an arm
        raise HLMError(
            f"no report: {err}; see the sweep's summary.md, and run the same command again to "
            "retry the failed trials"
        ) from None


def search_rows(folder: Path) -> list[dict[str, Any]]:
    """The learning-rate search's summary rows, as `scaling.choose_lrs` reads them."""
    rows = []
    with (folder / "summary.csv").open(newline="") as f:
        for r in csv.DictReader(f):
            score = float(r["downstream/score"]) if r["downstream/score"] else math.nan
            rows.append({**r, "value": float(r["learning_rate"]), "downstream/score": score})
    return rows


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def multiplier_table(c: scaling_fit.Comparison, unit: str) -> list[str]:
    lines = [
        f"| budget | headless {unit} | headless bpb (fit) | vanilla {unit} to reach it | "
        "multiplier [95% CI] | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for r in c.rows:
        need = _fmt(r.baseline_x) if r.estimate not in (0.0, math.inf) else "outside its budgets"
        verdict = r.verdict + (f" ({r.note})" if r.note else "")
        lines.append(
            f"| {r.budget} | {_fmt(r.method_x)} | {r.target:.4f} | {need} | "
            f"{scaling_fit.format_multiplier(r)} | {verdict} |"
        )
    return lines


def budget_table(points: list[dict[str, Any]]) -> list[str]:
    from hlm_ray.tune.stats import describe

    lines = [
        "| arm | budget | lr | steps | tokens | FLOPs | seconds | bits per byte (mean ± sd, n) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(p["arm"], p["budget"]) for p in points},
                  key=lambda k: (k[0], scaling.flops_of(k[1])))  # fmt: skip
    for arm, budget in keys:
        at = [p for p in points if (p["arm"], p["budget"]) == (arm, budget)]
        s = describe([p["bpb"] for p in at])
        sd = f" ± {s.sd:.4f}" if math.isfinite(s.sd) else ""
        lrs = ", ".join(sorted({f"{p['lr']:g}" for p in at}))

        def mean(key, pts=at):
            return sum(p[key] for p in pts) / len(pts)

        lines.append(
            f"| {arm} | {budget} | {lrs} | {mean('steps'):,.0f} | {mean('tokens'):,.0f} | "
            f"{mean('flops'):.3g} | {mean('seconds'):.1f} | {s.mean:.4f}{sd} (n={s.n}) |"
        )
    return lines


def search_table(rows: list[dict[str, Any]], chosen: dict[str, float], shared: float) -> list:
    lines = ["| arm | lr | bits per byte | |", "|---|---|---|---|"]
    for arm in chosen:
        mine = sorted((r for r in rows if r["objective"] == arm), key=lambda r: r["value"])
        for r in mine:
            marks = [m for m, on in (("chosen", r["value"] == chosen[arm]),
                                     ("shared", math.isclose(r["value"], shared))) if on]  # fmt: skip
            score = r["downstream/score"]
            text = f"{score:.4f}" if math.isfinite(score) else r["status"]
            lines.append(f"| {arm} | {r['value']:g} | {text} | {', '.join(marks)} |")
    edge = [a for a, lr in chosen.items() if lr in (min(r["value"] for r in rows),
                                                    max(r["value"] for r in rows))]  # fmt: skip
    if edge:
        lines += ["", f"The search's best rate for {' and '.join(edge)} is at the edge of the "
                      "grid: a better one may lie beyond (widen `sweep.search_lr`)."]  # fmt: skip
    return lines


def plot(comparisons: dict[str, scaling_fit.Comparison], out_png: Path, title: str) -> Path:
    """One panel per compute unit: each seed a dot, each arm's mean per budget and its fit,
    the multiplier drawn as the horizontal gap between the fits at the headless arm's final
    loss (dashed to the vanilla arm's last budget where that gap is only a bound)."""
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    fig = Figure(figsize=(5.2 * len(comparisons), 4.2), layout="constrained")
    fig.suptitle(title, fontsize=10)
    for i, (against, c) in enumerate(comparisons.items()):
        ax = fig.add_subplot(1, len(comparisons), i + 1)
        for arm in (c.baseline, c.method):
            mine = [p for p in c.points if p.arm == arm]
            ax.scatter([p.x for p in mine], [p.loss for p in mine], s=12, alpha=0.4,
                       color=COLORS.get(arm))  # fmt: skip
            xs = sorted({p.x for p in mine})
            grid = np.geomspace(min(xs), max(xs), 100)
            curve = c.curves[arm]
            ax.plot(grid, curve(grid), color=COLORS.get(arm), label=f"{arm}: {curve.describe()}")
            means = scaling_fit.budget_means(mine)
            ys = [np.mean([p.loss for p in mine if p.budget == b]) for b in means]
            ax.plot(list(means.values()), ys, "o", color=COLORS.get(arm), mfc="white")
        last = c.rows[-1]
        base_xs = [p.x for p in c.points if p.arm == c.baseline]
        bound = {math.inf: max(base_xs), 0.0: min(base_xs)}.get(last.estimate)
        end, style = (last.baseline_x, "-") if bound is None else (bound, "--")
        ax.annotate("", xy=(end, last.target), xytext=(last.method_x, last.target),
                    arrowprops={"arrowstyle": "->", "ls": style, "color": "k"})  # fmt: skip
        ax.text(math.sqrt(end * last.method_x), last.target, scaling_fit.format_multiplier(last),
                ha="center", va="bottom", fontsize=8)  # fmt: skip
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # a decade's minor labels overlap
        ax.set_xlabel(f"{UNITS[against]} (log)")
        ax.set_ylabel("bits per byte of held-out text")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    return out_png


def time_line(root: Path, name: str) -> str:
    """Where the command's time went: its parts' wall time (the last invocation's) against its
    trials' optimizer steps and their whole time (sums over every trial of the three parts)."""
    part = scaling.names(name)
    wall, train, n = 0.0, 0.0, 0
    for folder in (root / p for p in part.values()):
        if (folder / "summary.csv").is_file():
            with (folder / "summary.csv").open(newline="") as f:
                for r in csv.DictReader(f):
                    if r["trial/wall_s"] and r["trial/overhead_s"]:
                        n += 1
                        wall += float(r["trial/wall_s"])
                        train += float(r["trial/wall_s"]) - float(r["trial/overhead_s"])
    path = root / part["tuned"] / scaling.TIMING_FILE
    parts = json.loads(path.read_text()) if path.is_file() else None
    head = (
        f"Time: {parts['all']:.0f} s for the command (the search {parts['search']:.0f} s, the "
        f"tuned budgets {parts['tuned']:.0f} s, the shared rate {parts['shared']:.0f} s); "
        if parts
        else "Time: "
    )
    return (
        head + f"its {n} trials spent {train:.0f} s in optimizer steps, {wall:.0f} s in all "
        "(sums over the trials; they run side by side as the cluster allows)."
    )


def _drawn(c: scaling_fit.Comparison) -> str:
    if not c.resamples:
        return f"none drawn here: fewer than {scaling_fit.MIN_SEEDS} seeds per arm"
    return (
        f"{c.resamples} resamples of each arm's seeds, whole curves at a time, {c.distinct} "
        "of them distinct"
    )


def _section(title: str, c: scaling_fit.Comparison, unit: str) -> list[str]:
    fits = [f"- {arm}: {c.curves[arm].describe()} over {c.curves[arm].n} points"
            for arm in (c.method, c.baseline)]  # fmt: skip
    return [f"## {title}", "", *multiplier_table(c, unit), "", *fits, ""]


def write_report(spec: SweepSpec, name: str, preset: str) -> list[Path]:
    """report.md, scaling.png and (when a shared-rate part ran) scaling_shared_lr.png in
    runs/sweeps/<name>, logged on its parent run; the files, report.md first."""
    from hlm_ray.paths import resolve_output
    from hlm_ray.tune.report import log_to_parent
    from hlm_ray.tune.sweep import SWEEPS_DIR

    root = resolve_output(SWEEPS_DIR)
    part = scaling.names(name)
    folder = root / part["tuned"]
    rows = search_rows(root / part["search"])
    chosen = scaling.choose_lrs(rows, spec.objectives)
    shared = scaling.shared_lr(spec)
    tuned = read_points(folder)
    redone = read_points(root / part["shared"]) if (root / part["shared"]).is_dir() else []
    again = {p["arm"] for p in redone}
    at_shared = [p for p in tuned if p["arm"] not in again] + redone
    c = {k: compare(tuned, k) for k in UNITS}
    c_shared = compare(at_shared, "flops")
    seeds = f"{spec.num_seeds} seed{'s' if spec.num_seeds > 1 else ''} per arm"
    lrs = ", ".join(f"{arm} {lr:g}" for arm, lr in chosen.items())
    scale = f"the {preset} scale"
    text = [
        f"# Compute multiplier: preset {preset}, {seeds}",
        "",
        f"- **Each arm at its tuned learning rate** ({lrs}): "
        + scaling_fit.closing_sentence(c["flops"], "FLOPs", scale),
        "- **The same against measured training seconds** (what a user pays): "
        + scaling_fit.closing_sentence(c["seconds"], "training seconds", scale),
        f"- **Both arms at the shared learning rate {shared:g}** (the preset's, untuned): "
        + scaling_fit.closing_sentence(c_shared, "FLOPs", scale),
        "",
        "## The learning-rate search (the smallest budget, seed 0)",
        "",
        *search_table(rows, chosen, shared),
        "",
        "## The budgets, each arm at its tuned learning rate",
        "",
        *budget_table(tuned),
        "",
        *_section("Multiplier against FLOPs, tuned learning rates", c["flops"], "FLOPs"),
        *_section("Multiplier against training seconds, tuned learning rates", c["seconds"], "s"),
        *_section(f"Multiplier against FLOPs, shared learning rate {shared:g}", c_shared, "FLOPs"),
        "How to read it: the multiplier at a budget is the compute the vanilla arm needs to reach "
        "the bits per byte the headless arm's fitted curve has there, over the headless arm's "
        "compute (> 1: headless saves compute), read inside the vanilla arm's measured budgets "
        "only: `> X` / `< X` where the vanilla curve would have to be extrapolated. The interval "
        f"is a percentile bootstrap over seeds ({_drawn(c['flops'])}); verdicts: *holds* when "
        "it lies above 1, *reversed* below 1, else *cannot be told apart* (always with fewer "
        f"than {scaling_fit.MIN_SEEDS} seeds per arm). Compute: pretraining FLOPs of the FLOP "
        "model with the measured U, plus the headless arm's generator fine-tune; seconds: "
        "measured optimizer steps, plus the fine-tune. Loss: bits per byte of held-out text.",
        "",
        time_line(root, name),
        "",
        "![Bits per byte against FLOPs and seconds, tuned learning rates](scaling.png)",
        "",
        "![Bits per byte against FLOPs, shared learning rate](scaling_shared_lr.png)",
    ]
    png = plot(c, folder / "scaling.png", f"{name}: each arm at its tuned lr ({lrs}), {seeds}")
    png_shared = plot({"flops": c_shared}, folder / "scaling_shared_lr.png",
                      f"{name}: both arms at lr {shared:g}, {seeds}")  # fmt: skip
    md = folder / "report.md"
    md.write_text("\n".join(text) + "\n")
    params = {f"scaling.lr.{arm}": lr for arm, lr in chosen.items()}
    params.update({"scaling.lr.shared": shared, "scaling.search_sweep": part["search"]})
    files = [md, png, png_shared]
    log_to_parent(folder, files, md.read_text(), spec.experiment, params=params)
    return files
