"""The vocabulary sweep's report (paper Figure 7): the headline statistics per size, the two
figures with what they measure, and two closing sentences computed from the data.

    rows = read_rows(folder)                   # summary.csv: one dict per trial
    files = write_vocab_report(spec, "vocab-tiny", "tiny")  # [report.md, fig7a, fig7b]
    speed_sentence({"vanilla": {1024: 9000.0, 32768: 2000.0}, "headless": {...}}, updates)
    scores_sentence(compared_rows)             # can the scores be told apart at this scale?

Figure 7a draws the downstream score (its task and metric named) against V, one line per arm
with ±1 sd error bars over seeds, the task's majority-class baseline dashed, and a hollow ring
around each point at chance (`stats.near_baseline`: the 95% interval of the mean includes the
baseline, or the mean is no better). Figure 7b draws training tokens/s, each arm's legend
saying which embedding update it used. Per size, `hlm_ray.tune.report.compare` gives the
headline report's mean ± sd, Welch 95% interval and verdict (the size is the row's family).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from hlm_ray.tune import report, stats

# What the encoder recipes score (`hlm_ray.downstream`): tiny, SST-2 accuracy; paper, a GLUE-style
# average.
TASK_LABELS = {"glue:sst2": "SST-2 accuracy", "glue:cola": "CoLA MCC", "glue:mrpc": "MRPC accuracy",
               "glue:qnli": "QNLI accuracy", "glue:rte": "RTE accuracy"}  # fmt: skip
ARM_COLORS = {"vanilla": "tab:orange", "headless": "tab:blue"}


def read_rows(folder: Path) -> list[dict[str, Any]]:
    """The finished trials of summary.csv: value (the requested size), objective, seed, the
    numeric columns as floats, the steady per-step tokens/s of its training (`steps`) and, for a
    headless trial, its embedding-update probe (`probe`, or None)."""
    import json

    from hlm_ray.bench.update_probe import read_probe
    from hlm_ray.tune.speed import steady_tokens_per_s

    rows = []
    with (folder / "summary.csv").open(newline="") as f:
        for r in csv.DictReader(f):
            if r["status"] != "FINISHED":
                continue
            row: dict[str, Any] = {"objective": r["objective"], "seed": int(r["seed"])}
            row["value"] = int(float(r["vocab_size"]))
            for key in ("downstream/score", "tokens_per_s", "V"):
                row[key] = float(r[key]) if r.get(key) not in (None, "") else math.nan
            trial = folder / "trials" / r.get("run", "")
            summary = trial / "summary.json"
            row["steps"] = (
                steady_tokens_per_s(json.loads(summary.read_text())) if summary.is_file() else []
            )
            row["probe"] = read_probe(trial / "downstream")
            rows.append(row)
    return rows


def by_arm(rows: list[dict[str, Any]], key: str) -> dict[str, dict[int, list[float]]]:
    """{objective: {value: [key of each seed]}} over the finite values."""
    out: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        if math.isfinite(r.get(key, math.nan)):
            out.setdefault(r["objective"], {}).setdefault(r["value"], []).append(r[key])
    return out


def at_chance(values: list[float], baseline: float | None) -> bool:
    """A point (one arm at one size, over its seeds) that cannot be told from the baseline."""
    return stats.near_baseline(stats.describe(values), baseline)


def plot_vs_vocab(
    points: dict[str, dict[int, list[float]]],
    out_png: Path,
    *,
    title: str,
    y_label: str,
    labels: dict[str, str] | None = None,
    baseline: tuple[float, str] | None = None,
    dashed: tuple[str, ...] = (),
):
    """One line per arm (mean over seeds, ±1 sd bars, each seed a faint dot) against the size on
    a log axis; `baseline` (value, legend text) dashed, points at chance ringed. Returns the
    matplotlib Figure (also saved to `out_png`)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 4.2), layout="constrained")
    ax = fig.add_subplot()
    ringed = False
    for arm in sorted(points):
        xs = sorted(points[arm])
        means = [sum(points[arm][x]) / len(points[arm][x]) for x in xs]
        sds = [stats.describe(points[arm][x]).sd for x in xs]
        sds = [s if math.isfinite(s) else 0.0 for s in sds]
        label = (labels or {}).get(arm, arm)
        color = ARM_COLORS.get(arm.split(" ")[0])
        style = "o--" if arm in dashed else "o-"
        ax.errorbar(xs, means, yerr=sds, fmt=style, capsize=3, label=label, color=color,
                    mfc="white" if arm in dashed else None)  # fmt: skip
        for x in xs:
            ax.scatter([x] * len(points[arm][x]), points[arm][x], color=color, alpha=0.35, s=12)
        if baseline is not None:
            chance = [(x, m) for x, m in zip(xs, means, strict=True)
                      if at_chance(points[arm][x], baseline[0])]  # fmt: skip
            if chance:
                ax.scatter(*zip(*chance, strict=True), s=160, facecolors="none",
                           edgecolors="red", linewidths=1.2,
                           label=None if ringed else "at chance (95% CI includes baseline)")  # fmt: skip
                ringed = True
    if baseline is not None:
        ax.axhline(baseline[0], color="gray", ls="--", lw=1, label=baseline[1])
    values = sorted({x for arm in points.values() for x in arm})
    if values:
        ax.set_xscale("log", base=2)
        ax.set_xticks(values, [f"{v:,}" for v in values])
        ax.minorticks_off()
    ax.set_xlabel("vocabulary size V")
    ax.set_ylabel(y_label)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    return fig


LAZY_ARM = "headless lazy"
"""Figure 7b's third line: the headless arm's speed with the lazy embedding update."""


def lazy_points(rows: list[dict[str, Any]]) -> dict[int, list[float]]:
    """{V: [tokens/s]}: each headless trial's training tokens/s (dense update) times its probe's
    ratio of median step times, dense over lazy (measured side by side in one process)."""
    import statistics

    out: dict[int, list[float]] = {}
    for r in rows:
        probe = r.get("probe")
        if r["objective"] == "headless" and probe and math.isfinite(r["tokens_per_s"]):
            t = probe["seconds"]
            ratio = statistics.median(t["dense"]) / statistics.median(t["lazy"])
            out.setdefault(r["value"], []).append(r["tokens_per_s"] * ratio)
    return out


def speed_rows_from_steps(rows: list[dict[str, Any]], compared: list[report.Row]) -> list:
    """The tokens/s rows with their interval from the runs' own step times
    (`hlm_ray.tune.speed`): over steps with one run per arm, over runs with two or more."""
    from dataclasses import replace

    from hlm_ray.tune.speed import speed_difference

    out = []
    for row in compared:
        runs = {a: [r["steps"] for r in rows if str(r["value"]) == row.score.family
                    and r["objective"] == a] for a in report.ARMS}  # fmt: skip
        if all(any(runs[a]) for a in report.ARMS):
            diff = speed_difference(runs["headless"], runs["vanilla"])
            verdict = stats.verdict(diff, higher_is_better=True)
            row = replace(row, diff=diff, verdict=verdict)
        out.append(row)
    return out


def probe_table(rows: list[dict[str, Any]]) -> list[str]:
    """The lazy embedding update's row per size: the headless step with each update, timed in
    alternation in each headless trial (tokens/s of the probe's steps), Welch over the steps
    (over the trials' means with two or more)."""
    from hlm_ray.tune.speed import speed_difference

    probes: dict[int, list[dict]] = {}
    for r in rows:
        if r["objective"] == "headless" and r.get("probe"):
            probes.setdefault(r["value"], []).append(r["probe"])
    if not probes:
        return []
    lines = [
        "The lazy embedding update, its own row (each headless trial times its model's step with "
        "the dense and the lazy update in alternation: tokens/s of those steps):",
        "",
        "| V | headless, dense update | headless, lazy update | Δ lazy − dense [95% CI] | verdict |",
        "|---|---|---|---|---|",
    ]
    for value in sorted(probes):
        runs = {k: [[p["tokens_per_step"] / t for t in p["seconds"][k]] for p in probes[value]]
                for k in ("dense", "lazy")}  # fmt: skip
        d = speed_difference(runs["lazy"], runs["dense"])
        means = {k: sum(x for r in v for x in r) / sum(len(r) for r in v) for k, v in runs.items()}
        verdict = {stats.HOLDS: "lazy faster", stats.REVERSED: "dense faster"}.get(
            stats.verdict(d, higher_is_better=True), "cannot be told apart"
        )
        lines.append(
            f"| {value:,} | {means['dense']:,.0f} | {means['lazy']:,.0f} | {d.estimate:+,.0f} "
            f"[{d.low:+,.0f}, {d.high:+,.0f}] | {verdict} ({d.method}) |"
        )
    return lines


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def speed_sentence(tokens_per_s: dict[str, dict[int, list[float]]], updates: dict[str, str]) -> str:
    """What Figure 7b shows, from the smallest to the largest size of each arm."""
    parts = []
    for arm in ("vanilla", "headless", LAZY_ARM):
        points = tokens_per_s.get(arm)
        if not points or len(points) < 2:
            continue
        lo, hi = min(points), max(points)
        a, b = _mean(points[lo]), _mean(points[hi])
        means = [_mean(v) for v in points.values()]
        change, spread = (b - a) / a, (max(means) - min(means)) / a
        if abs(change) > 0.15:
            trend = "falls" if change < 0 else "rises"
        elif spread <= 0.3:
            trend = "stays within 15%"
        else:
            trend = (f"ends within 15% of where it starts but is uneven between "
                     f"({min(means):,.0f} to {max(means):,.0f} tokens/s)")  # fmt: skip
        update = "lazy" if arm == LAZY_ARM else updates.get(arm, "?")
        name = "headless" if arm == LAZY_ARM else arm
        parts.append(
            f"{name}'s training speed ({update} embedding update) {trend} from "
            f"V={lo:,} to V={hi:,} ({a:,.0f} to {b:,.0f} tokens/s, {change:+.0%})"
        )
    if not parts:
        return "The speed figure has fewer than two sizes per arm: it shows no trend."
    return "Speed: " + "; ".join(parts) + "."


def scores_sentence(rows: list[report.Row]) -> str:
    """Whether the downstream scores can be told apart at this scale (one row per size); sizes
    where an arm is at chance get no verdict and are counted as such."""
    if not rows:
        return "Scores: no size has finished trials in both arms."
    told = [r for r in rows if r.verdict in (stats.HOLDS, stats.REVERSED)]
    withheld = [r.score.family for r in rows if r.verdict == stats.WITHHELD]
    chance = sum(r.near_chance.get(a, False) for r in rows for a in report.ARMS)
    points = sum(r.arms[a].n > 0 for r in rows for a in report.ARMS)
    tail = f" {chance} of the {points} points are at chance." if chance else ""
    if withheld:
        tail = (
            f" No verdict at V={', '.join(withheld)}: an arm there does not beat the baseline."
            + tail
        )
    if not told:
        seeds = min(r.arms[a].n for r in rows for a in report.ARMS)
        flat = [r.score.family for r in rows if r.diff.reason.startswith("zero spread")]
        why = (
            " (one seed per point gives no interval)"
            if seeds < stats.MIN_SEEDS
            else f" (zero spread at V={', '.join(flat)}: each arm's seeds scored exactly alike)"
            if flat
            else ""
        )
        where = "at any size" if not withheld else "at any size where both beat the baseline"
        return (
            f"Scores: headless and vanilla cannot be told apart {where} at this scale{why}.{tail}"
        )
    said = ", ".join(f"V={r.score.family}: {r.verdict}" for r in told)
    return (
        f"Scores: the difference is outside the noise at {len(told)} of {len(rows)} sizes "
        f"({said}; *holds* = headless better).{tail}"
    )


def downstream_score(recipe: str) -> tuple[str, float | None, str]:
    """(label, baseline, baseline note) of `downstream/score` for an encoder `recipe`: one
    task's main metric, or the mean over its tasks (baseline: the mean of their majority
    classes)."""
    from hlm_ray.downstream import DOWNSTREAM
    from hlm_ray.tune.report import majority_of

    if recipe not in DOWNSTREAM:  # sweep.recipe=none: pretraining only
        return "no downstream score (sweep.recipe=none)", None, ""
    plan = DOWNSTREAM[recipe]
    tasks = [t for t in plan["glue_tasks"] if t not in plan.get("average_excludes", ())]
    bases = [majority_of(plan, task) for task in tasks]
    names = [TASK_LABELS.get(t, t) for t in tasks]
    if len(tasks) == 1:
        return f"{names[0]} (fine-tuned, held-out rows)", bases[0], "majority class"
    label = "GLUE-style average (" + ", ".join(names) + ")"
    return label, sum(bases) / len(bases), "mean of the tasks' majority classes"


def write_vocab_report(spec, name: str, preset: str) -> list[Path]:
    """report.md (ending with the two closing sentences) and the two figures in
    runs/sweeps/<name>, logged on the parent run; the three files, report.md first."""
    from hlm_ray.paths import resolve_output
    from hlm_ray.tune.sweep import SWEEPS_DIR

    folder = resolve_output(SWEEPS_DIR) / name
    rows = read_rows(folder)
    task_label, baseline, baseline_note = downstream_score(spec.recipe)
    updates = {o: spec.cell_config(spec.values[0], o, 0).optim.embedding_update
               for o in spec.objectives}  # fmt: skip
    seeds = spec.num_seeds
    budget = spec.base_config().budget
    at = f"equal FLOPs ({budget.flops:.3g} each)" if budget.flops else "equal steps"
    scale = f"{name}, {seeds} seed{'s' if seeds > 1 else ''} per point, {at}"
    fig_a = folder / "fig7a_score_vs_vocab.png"
    plot_vs_vocab(by_arm(rows, "downstream/score"), fig_a, y_label=task_label,
                  title=f"Figure 7a: {task_label} vs V\n{scale}",
                  baseline=None if baseline is None else
                  (baseline, f"{baseline_note} ({baseline:.3f})"))  # fmt: skip
    fig_b = folder / "fig7b_tokens_per_s_vs_vocab.png"
    speed = by_arm(rows, "tokens_per_s")
    lazy = lazy_points(rows)
    plot_vs_vocab({**speed, **({LAZY_ARM: lazy} if lazy else {})}, fig_b,
                  y_label="training tokens / s", dashed=(LAZY_ARM,),
                  title=f"Figure 7b: training speed vs V\n{scale}",
                  labels={**{o: f"{o} ({u} embedding update)" for o, u in updates.items()},
                          LAZY_ARM: "headless, lazy embedding update (its probe's ratio × the "
                                    "dense speed)"})  # fmt: skip
    trials = [report.Trial(str(r["value"]), r["objective"], r["seed"],
                           {"downstream/score": r["downstream/score"],
                            "tokens_per_s": r["tokens_per_s"]}) for r in rows]  # fmt: skip
    values = [str(v) for v in spec.values]
    score_rows = report.compare(trials, [
        report.Score("downstream/score", task_label.split(" (")[0], v, baseline=baseline,
                     baseline_note=baseline_note, headline=True) for v in values])  # fmt: skip
    speed_rows = speed_rows_from_steps(rows, report.compare(
        trials, [report.Score("tokens_per_s", "tokens/s", v, fmt="{:,.0f}") for v in values]
    ))  # fmt: skip
    closing = [speed_sentence({**speed, **({LAZY_ARM: lazy} if lazy else {})}, updates),
               scores_sentence(score_rows)]  # fmt: skip
    if baseline is None:
        score_rows, closing[1] = [], "Scores: none (sweep.recipe=none: pretraining only)."
    title = f"Figure 7 at the {preset} scale: headless vs vanilla per vocabulary size"
    text = report.markdown(
        [*score_rows, *speed_rows],
        title=title,
        scale=f"the {preset} scale",
        notes=[f"Each row's family is the vocabulary size V ({scale}). Headless arms: "
               f"{updates.get('headless')} embedding update; vanilla: {updates.get('vanilla')}.",
               f"Score: {task_label}; baseline: {baseline_note} of the evaluation rows "
               f"({baseline or 0:.4f})."],
        figure=fig_a.name,
    )  # fmt: skip
    text += "\n" + "\n".join(probe_table(rows)) + "\n"
    text += f"\n![Figure 7b]({fig_b.name})\n\n" + "\n\n".join(closing) + "\n"
    md = folder / "report.md"
    md.write_text(text)
    report.log_to_parent(folder, [md, fig_a, fig_b], text, spec.experiment)
    return [md, fig_a, fig_b]
