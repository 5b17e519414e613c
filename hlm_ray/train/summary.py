"""Run summaries for the terminal, a run's loss curve, and the side-by-side plot of several runs.

print(format_summary([summary_headless, summary_vanilla]))
plot_loss_curve(read_metrics(out_dir), out_dir / "loss_curve.png")
plot_runs([Path("runs/x/headless"), Path("runs/x/vanilla")], Path("runs/x/compare.png"))
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hlm_ray.tracking.base import read_metrics
from hlm_ray.tracking.store import is_number

# The summary's keys in table order; a header is its key unless renamed, a value prints as is
# unless it is a large count (thousands separators).
_COLUMNS = ("objective", "arch", "steps", "tokens", "tokens_per_s", "vocab_size", "parameters")
_HEADERS = {"tokens_per_s": "tokens/s", "vocab_size": "vocab", "parameters": "params"}
_FORMATS = {"tokens": "{:,}", "tokens_per_s": "{:,.0f}", "parameters": "{:,}"}
_METRICS = [
    ("train loss", "train/loss"),
    ("val loss", "val/loss"),
    ("val acc", "val/accuracy"),
    ("val ppl", "val/perplexity"),
    ("val token bpb", "val/token_bpb"),
]


def format_summary(summaries: list[dict[str, Any]]) -> str:
    """A Markdown table, one row per run, then where each model is."""
    metric_cols = [(h, k) for h, k in _METRICS if any(k in s["metrics"] for s in summaries)]
    header = [_HEADERS.get(key, key) for key in _COLUMNS] + [h for h, _ in metric_cols]
    rows = []
    for s in summaries:
        row = [_FORMATS.get(key, "{}").format(s[key]) if s[key] is not None else "-"
               for key in _COLUMNS]  # fmt: skip
        row += [f"{s['metrics'][k]:.4f}" if k in s["metrics"] else "-" for _, k in metric_cols]
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += [f"{s['objective']} model: {s['model_dir']}" for s in summaries]
    return "\n".join(lines)


def plot_runs(run_dirs: list[Path], out_path: Path) -> Path:
    """Training loss by step, one panel per run (each its own objective: a CWT loss and a
    cross-entropy are not on one scale, so they never share an axis), and training tokens/s
    (the runs' summary.json figure, as in the table), for runs that wrote metrics.jsonl."""
    from matplotlib.figure import Figure

    runs = []
    for run in run_dirs:
        rows = [r for r in read_metrics(run) if "train/loss" in r]
        if rows:
            speed = json.loads((Path(run) / "summary.json").read_text())["tokens_per_s"]
            runs.append((Path(run).name, rows, speed))
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    fig = Figure(figsize=(3.6 * (len(runs) + 1), 3.8), layout="constrained")
    axes = fig.subplots(1, len(runs) + 1, squeeze=False)[0]
    for ax, (name, rows, _), color in zip(axes, runs, colors, strict=False):
        ax.plot([r["step"] for r in rows], [r["train/loss"] for r in rows], color=color)
        ax.set_title(f"{name}: its own training loss", fontsize=9)
        ax.set_xlabel("step")
        plain_log_axis(ax)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss (log)")
    names = [name for name, _, _ in runs]
    axes[-1].bar(names, [speed for _, _, speed in runs], color=colors[: len(runs)])
    axes[-1].set_ylabel("tokens / s (training only)")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    return out_path


def plain_log_axis(ax) -> None:
    """A log-scale y axis labelled in plain numbers (5.6, 6, 6.4), not matplotlib's default
    `6×10⁰` for the ticks inside one decade, where a loss curve usually lies; every tick
    labelled when the range is under a decade."""
    from matplotlib.ticker import LogFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(LogFormatter())
    ax.yaxis.set_minor_formatter(LogFormatter(minor_thresholds=(2, 1)))


def plot_loss_curve(
    metrics_rows: Iterable[dict[str, Any]], out_png: str | Path, *, title: str | None = None
) -> Path:
    """`train/loss` and `val/loss` against `step` (rows as from `read_metrics`) as a PNG."""
    # The object-oriented API with no pyplot: it never switches the process's global backend
    # (Agg is what Figure.savefig uses for PNG) and never opens windows.
    from matplotlib.figure import Figure

    rows = list(metrics_rows)
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    plotted = False
    for key, style in (("train/loss", "-"), ("val/loss", "o-")):
        points = [
            (row["step"], float(row[key]))
            for row in rows
            if "step" in row and is_number(row.get(key)) and math.isfinite(float(row[key]))
        ]
        if points:
            steps, values = zip(*sorted(points), strict=True)
            ax.plot(steps, values, style, label=key, markersize=3)
            plotted = True
    if plotted:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no loss logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
