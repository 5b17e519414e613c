"""The sweep's summary: one row per trial (failed ones included), as CSV, Markdown and figures.

    rows = [trial_row(trial_id=..., status="FINISHED", metrics=result.metrics, ...), ...]
    files = write_summary(rows, folder, axis=VOCAB)     # summary.csv, summary.md, figures
    print(markdown_table(rows, VOCAB))
    steps = result_metrics(rows, VOCAB)   # {step: {"ablation/downstream_score/headless": ...}}
    text = results_note(rows, VOCAB, "vocab-tiny")      # the parent run's MLflow description

The swept value's column and the figures come from the sweep's `Axis` (each figure one summary
column against the value, one line per objective). Each point is the mean over seeds (each seed
a faint dot); only finished trials count. Two bits-per-byte columns, never mixed: `text_bpb`
(held-out text scored by a model with a head, `hlm_ray.evaluate.bpb`; the decoders' generators)
and `token_bpb` (pretraining validation: the vanilla head's nats over the target tokens' bytes,
from the tokenizer's byte table).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from hlm_ray.tune.axis import Axis, Value

# (column, header, format) in table order; missing values print as "-".
COLUMNS = [
    ("trial_id", "trial", "{}"),
    ("status", "status", "{}"),
    ("objective", "objective", "{}"),
    ("value", "value", "{}"),
    ("seed", "seed", "{}"),
    ("V", "V", "{:.0f}"),
    ("downstream/score", "downstream", "{:.4f}"),
    ("lambada/accuracy", "LAMBADA acc", "{:.4f}"),
    ("lambada/perplexity", "LAMBADA ppl", "{:.4g}"),
    ("text_bpb", "text bpb", "{:.4f}"),
    ("token_bpb", "val token bpb", "{:.4f}"),
    ("loss", "loss", "{:.4f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("peak_mem_mb", "peak MB", "{:,.0f}"),
    ("head_flop_share", "head FLOPs", "{:.3f}"),
    ("K", "K", "{:.0f}"),
    ("K_over_V", "K/V", "{:.3f}"),
    ("train/U", "U", "{:.0f}"),
    ("trial/wall_s", "trial s", "{:.0f}"),
    ("trial/overhead_s", "overhead s", "{:.0f}"),
    ("lr", "lr", "{:.3g}"),
    ("warmup_steps", "warm-up", "{}"),
    ("run", "run", "{}"),
    ("error", "error", "{}"),
]


def trial_row(
    *,
    trial_id: str,
    run: str,
    status: str,
    value: Any,
    objective: str,
    seed: int,
    metrics: dict[str, Any],
    error: str = "",
    lr: float | None = None,
    warmup_steps: int | None = None,
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "trial_id": trial_id,
        "run": run,
        "status": status,
        "objective": objective,
        "value": value,
        "seed": seed,
        "error": error,
        "lr": lr,
        "warmup_steps": warmup_steps,
    }
    if "loss" not in metrics and "val/loss" in metrics:  # stopped early: its last report
        metrics = {**metrics, "loss": metrics["val/loss"]}
    for key, _, _ in COLUMNS:
        if key not in row and _number(metrics.get(key)) is not None:
            row[key] = float(metrics[key])
    for key, value in metrics.items():  # where its time went: what plans here are priced with
        if key.startswith("trial/") and key not in row and _number(value) is not None:
            row[key] = float(value)
    return row


def markdown_table(rows: list[dict[str, Any]], axis: Axis) -> str:
    columns = [_named(c, axis) for c in COLUMNS if any(_present(r.get(c[0])) for r in rows)]
    lines = [
        "| " + " | ".join(h for _, h, _ in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        cells = [_format(row.get(key), fmt) for key, _, fmt in columns]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


RESULTS_PREFIX = "ablation"
"""Sorts first among the sections of MLflow's chart views (they are in name order)."""


def result_scores(axis: Axis) -> list[tuple[str, str]]:
    """(summary column, label) of the scores a sweep compares: the downstream score and each
    figure's column."""
    scores = {"downstream/score": "downstream score"}
    for figure in axis.figures:
        scores.setdefault(figure.metric, figure.label)
    return list(scores.items())


def result_steps(values: list[Value]) -> dict[Value, int]:
    """The MLflow step of each swept value: the value itself when every value is a
    non-negative integer (the chart's x axis then reads as the axis), else its position in the
    grid (strings, fractions; `results_note` prints the key)."""
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        return {v: v for v in values}
    return {v: i for i, v in enumerate(values)}


def result_key(column: str, objective: str) -> str:
    """``ablation/<score>/<objective>``: one metric per (score, arm) on the sweep's parent run,
    its steps the swept values. MLflow's chart views draw each as a line over the axis and file
    the arms of one score side by side in one section (named by the key up to its last ``/``),
    the first section of the parent run's "Model metrics" tab: a comparison with no clicks.
    (One scalar per (score, arm, value) would be a chart of one bar each.)"""
    return f"{RESULTS_PREFIX}/{column.replace('/', '_')}/{objective}"


def result_metrics(rows: list[dict[str, Any]], axis: Axis) -> dict[int, dict[str, float]]:
    """{step: {result_key: mean over the finished seeds}}, for the sweep's parent run. MLflow
    draws each metric on its own chart, scaled alone, so the two arms' charts never share a
    y-range: `.../headless_minus_vanilla` (where both arms have a mean) is the one chart that
    compares them (0: a tie)."""
    values = list(dict.fromkeys(r["value"] for r in rows))
    steps = result_steps(values)
    out: dict[int, dict[str, float]] = {}
    for column, _ in result_scores(axis):
        means = _means(rows, column)
        for (objective, value), mean in means.items():
            out.setdefault(steps[value], {})[result_key(column, objective)] = mean
        for value in values:
            if ("headless", value) in means and ("vanilla", value) in means:
                delta = means["headless", value] - means["vanilla", value]
                out[steps[value]][result_key(column, DELTA)] = delta
    return out


DELTA = "headless_minus_vanilla"  # the arms' difference, on the parent run


def results_note(
    rows: list[dict[str, Any]],
    axis: Axis,
    name: str,
    images: list[tuple[str, str]] = (),
) -> str:
    """The parent run's description (MLflow's ``mlflow.note.content``, Markdown): a line on
    what was swept, each score per value and arm (mean over seeds), then `images` ((label,
    URL): the figures, each arm a line) and where the rest is. The table comes first: MLflow
    shows the first few lines of a description until "Show more" is clicked."""
    values = list(dict.fromkeys(r["value"] for r in rows))
    objectives = list(dict.fromkeys(r["objective"] for r in rows))
    seeds = len({r["seed"] for r in rows})
    statuses = dict.fromkeys(r["status"] for r in rows)
    counts = {s: sum(r["status"] == s for r in rows) for s in statuses}
    steps = result_steps(values)
    lines = [
        f"**Sweep `{name}`**: {axis.label} ∈ {{{', '.join(map(str, values))}}} × "
        f"{{{', '.join(objectives)}}}"
        + (f" × {seeds} seeds" if seeds > 1 else "")
        + ". "
        + ", ".join(f"{n} {s.lower()}" for s, n in counts.items())
        + f" of {len(rows)} trials"
        + (" (mean over seeds)." if seeds > 1 else "."),
        "",
    ]
    scores = result_scores(axis)
    means = {column: _means(rows, column) for column, _ in scores}
    header = [axis.column[0]] + [f"{label}, {o}" for _, label in scores for o in objectives]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for value in values:
        cells = [str(value)]
        for column, _ in scores:
            fmt = next((f for key, _, f in COLUMNS if key == column), "{:.4g}")
            cells += [_format(means[column].get((o, value)), fmt) for o in objectives]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"![{label}]({url})" for label, url in images]
    lines += [
        "",
        f"Charts: the `{RESULTS_PREFIX}/<score>/<objective>` metrics (Model metrics tab), one "
        "point per value, "
        + (
            f"step = {axis.label}."
            if all(steps[v] == v for v in values)
            else "step = position: " + ", ".join(f"{steps[v]} = {v}" for v in values) + "."
        )
        + " Each trial is a child run of this one; `summary.md` (artifacts) has every trial.",
    ]
    failed = [r for r in rows if r["status"] == "FAILED"]
    if failed:
        lines += ["", "Failed: " + "; ".join(f"`{r['run']}`: {r['error']}" for r in failed)]
    return "\n".join(lines) + "\n"


def _means(rows: list[dict[str, Any]], column: str) -> dict[tuple[str, Value], float]:
    """{(objective, value): mean of `column` over the finished trials that have it}."""
    groups: dict[tuple[str, Value], list[float]] = {}
    for r in rows:
        if r["status"] == "FINISHED" and _number(r.get(column)) is not None:
            groups.setdefault((r["objective"], r["value"]), []).append(r[column])
    return {k: sum(v) / len(v) for k, v in groups.items()}


def write_summary(
    rows: list[dict[str, Any]], folder: Path, *, axis: Axis, figures: bool = True
) -> list[Path]:
    """summary.csv, summary.md and the axis's figures in `folder`; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    csv_path = folder / "summary.csv"
    with csv_path.open("w", newline="") as f:
        names = {key: axis.column[1] if key == "value" else key for key, _, _ in COLUMNS}
        writer = csv.DictWriter(f, fieldnames=list(names.values()))
        writer.writeheader()
        for row in rows:
            writer.writerow({names[key]: _csv(row.get(key)) for key in names})
    md_path = folder / "summary.md"
    md_path.write_text(markdown_table(rows, axis) + "\n")
    paths = [csv_path, md_path]
    if figures:
        for figure in axis.figures:
            out_png = folder / figure.filename
            seeds = len({r["seed"] for r in rows})
            title = (
                f"{figure.label} vs {axis.label}\n{folder.name}, "
                f"{seeds} seed{'s' if seeds != 1 else ''} per point"
            )
            paths.append(
                plot_by_objective(
                    rows, figure.metric, out_png, axis=axis, y_label=figure.label, title=title
                )
            )
    return paths


def plot_by_objective(
    rows: list[dict[str, Any]],
    key: str,
    out_png: Path,
    *,
    axis: Axis,
    y_label: str,
    title: str = "",
) -> Path:
    """`key` against the swept value, one line per objective (mean over seeds, each seed a dot,
    error bars of ±1 sample sd where a point has several seeds), under `title` (what, sweep,
    seeds). String values (categories) are placed in the order they first appear, evenly
    spaced."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.6, 4.0), layout="constrained")
    ax = fig.add_subplot()
    finished = [r for r in rows if r["status"] == "FINISHED" and _number(r.get(key)) is not None]
    values = list(dict.fromkeys(r["value"] for r in finished))
    categorical = any(isinstance(v, str) for v in values)
    where = {v: i for i, v in enumerate(values)} if categorical else {v: v for v in values}
    for objective in sorted({r["objective"] for r in finished}):
        points = [(where[r["value"]], r[key]) for r in finished if r["objective"] == objective]
        xs = sorted({x for x, _ in points})
        at = {x: [y for x2, y in points if x2 == x] for x in xs}
        means = [sum(at[x]) / len(at[x]) for x in xs]
        sds = [_sd(at[x]) for x in xs]
        line = ax.errorbar(xs, means, yerr=sds, fmt="o-", capsize=3, label=objective)[0]
        ax.scatter(*zip(*points, strict=True), color=line.get_color(), alpha=0.35, s=12)
    if finished:
        ax.legend()
        if axis.log_x and not categorical:
            ax.set_xscale("log", base=2)
        ticks = sorted(values, key=lambda v: where[v])
        ax.set_xticks([where[v] for v in ticks])
        ax.set_xticklabels([str(v) for v in ticks])
    else:
        ax.text(0.5, 0.5, "no finished trials", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(axis.label)
    ax.set_ylabel(y_label)
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    return out_png


def _sd(values: list[float]) -> float:
    """Sample sd (ddof=1); 0 for a single seed (no error bar)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _named(column: tuple[str, str, str], axis: Axis) -> tuple[str, str, str]:
    key, header, fmt = column
    return (key, axis.column[0], fmt) if key == "value" else column


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _present(value: Any) -> bool:
    return value not in (None, "") and not (isinstance(value, float) and math.isnan(value))


def _format(value: Any, fmt: str) -> str:
    if not _present(value):
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def _csv(value: Any) -> Any:
    return "" if value is None else value


def sweep_status(rows: list[dict[str, Any]], interrupted: bool) -> tuple[str, str]:
    """The parent run's status and a line saying what happened to its trials: FAILED when a
    trial failed (its cell is missing from the comparison; such a sweep ended FINISHED before),
    KILLED after Ctrl-C, else FINISHED."""
    failed = sum(r["status"] == "FAILED" for r in rows)
    done = sum(r["status"] == "FINISHED" for r in rows)
    outcome = f"{done} of {len(rows)} trial(s) finished, {failed} failed"
    if interrupted:
        return "KILLED", outcome + "; interrupted"
    return ("FAILED" if failed else "FINISHED"), outcome
