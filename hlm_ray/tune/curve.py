"""Data efficiency (paper Figures 3-4 at laptop scale): each trial's downstream score at 25%, 50%
and 100% of its pretraining budget, scored from the checkpoints it kept there.

    curve_steps(600)                       # [150, 300, 600]
    checkpoint_settings(600)               # run.checkpoint_every=150, keep 4: all kept
    points = score_checkpoints(folder, "headline-cpu", flops_per_step={...}, processes=2)
    plot_curve(points, Path("curve.png"), title="...", y_label="GLUE avg")

A trial's 100% point is its own `downstream.json`; the earlier ones run the same downstream
protocol (`hlm_ray.downstream.run_downstream`) on `checkpoint_<step>/model`, in `processes`
worker processes, and are cached in the trial folder as `curve.json` (a rerun scores only what
is missing). Each point is drawn against pretraining tokens and against FLOPs (steps × the
arm's FLOPs per step), one line per arm: the mean over seeds with ±1 sd bars.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

FRACTIONS = (0.25, 0.5, 1.0)
CURVE_FILE = "curve.json"


def curve_steps(total: int, fractions: tuple[float, ...] = FRACTIONS) -> list[int]:
    """The steps at `fractions` of a `total`-step run (at least step 1)."""
    return [max(1, round(total * f)) for f in fractions]


def checkpoint_settings(total: int) -> dict[str, int]:
    """Run settings that checkpoint (and evaluate) at every curve step and keep them all."""
    every = math.gcd(*curve_steps(total))
    return {
        "run.checkpoint_every": every,
        "run.eval_every": every,
        "run.keep_checkpoints": math.ceil(total / every),
    }


def _score(model_dir: str, recipe: str, output_dir: str) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)  # one core per process: they run side by side
    from hlm_ray.downstream import run_downstream
    from hlm_ray.tracking import Tracker

    scores = run_downstream(Path(model_dir), recipe=recipe, output_dir=Path(output_dir),
                            tracker=Tracker())  # fmt: skip
    return {k: float(v) for k, v in scores.items() if isinstance(v, int | float)}


def score_checkpoints(
    folder: Path,
    recipe: str,
    *,
    flops_per_step: dict[tuple[str, str], float],
    value_column: str,
    processes: int = 2,
) -> list[dict[str, Any]]:
    """One point per (finished trial, curve step): value, objective, seed, step, tokens,
    flops, scores. `flops_per_step`: {(value, objective): FLOPs of one step}."""
    import csv

    trials, jobs = [], {}
    with (folder / "summary.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            out = folder / "trials" / row["run"]
            if row["status"] != "FINISHED" or not (out / "downstream.json").is_file():
                continue
            summary = json.loads((out / "summary.json").read_text())
            cached = (
                json.loads((out / CURVE_FILE).read_text()) if (out / CURVE_FILE).is_file() else {}
            )
            total = int(summary["steps"])
            cached[str(total)] = json.loads((out / "downstream.json").read_text())
            trials.append((row, out, summary, cached))
            for step in curve_steps(total)[:-1]:
                model = out / f"checkpoint_{step:08d}" / "model"
                if str(step) not in cached and model.is_dir():
                    jobs[(str(out), str(step))] = (str(model), recipe, str(out / f"curve_{step}"))
    with ProcessPoolExecutor(max_workers=max(1, processes)) as pool:
        futures = {key: pool.submit(_score, *args) for key, args in jobs.items()}
        done = {key: future.result() for key, future in futures.items()}
    points = []
    for row, out, summary, cached in trials:
        for (where, step), scores in done.items():
            if where == str(out):
                cached[step] = scores
        (out / CURVE_FILE).write_text(json.dumps(cached, indent=1))
        per_step = flops_per_step[(row[value_column], row["objective"])]
        tokens_per_step = summary["tokens"] / summary["steps"]
        for step, scores in sorted(cached.items(), key=lambda kv: int(kv[0])):
            points.append({
                "value": row[value_column], "objective": row["objective"],
                "seed": int(row["seed"]), "step": int(step),
                "tokens": int(step) * tokens_per_step, "flops": int(step) * per_step,
                "scores": scores,
            })  # fmt: skip
    return points


def plot_curve(
    points: list[dict[str, Any]], out_png: Path, *, title: str, y_label: str, key: str,
    baseline: float | None = None,
):  # fmt: skip
    """Score `key` against pretraining tokens (left) and FLOPs (right), one line per arm: the
    mean over seeds at each step with ±1 sd bars, each seed a faint dot. Returns the Figure."""
    from matplotlib.figure import Figure

    from hlm_ray.tune import stats
    from hlm_ray.tune.vocab_report import ARM_COLORS

    fig = Figure(figsize=(10.0, 4.0), layout="constrained")
    fig.suptitle(title, fontsize=10)
    for i, (x_key, x_label) in enumerate((("tokens", "pretraining tokens"),
                                          ("flops", "pretraining FLOPs"))):  # fmt: skip
        ax = fig.add_subplot(1, 2, i + 1)
        for arm in sorted({p["objective"] for p in points}):
            mine = [p for p in points if p["objective"] == arm and key in p["scores"]]
            steps = sorted({p["step"] for p in mine})
            xs, means, sds = [], [], []
            for step in steps:
                at = [p for p in mine if p["step"] == step]
                s = stats.describe([p["scores"][key] for p in at])
                xs.append(sum(p[x_key] for p in at) / len(at))
                means.append(s.mean)
                sds.append(s.sd if math.isfinite(s.sd) else 0.0)
            color = ARM_COLORS.get(arm)
            ax.errorbar(xs, means, yerr=sds, fmt="o-", capsize=3, label=arm, color=color)
            ax.scatter([p[x_key] for p in mine], [p["scores"][key] for p in mine],
                       color=color, alpha=0.35, s=12)  # fmt: skip
        if baseline is not None:
            ax.axhline(baseline, color="gray", ls="--", lw=1, label="majority-class baseline")
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return fig
