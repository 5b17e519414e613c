"""The compute sweep's figures (`hlm_ray.tune.scaling_report` writes them): each arm's bits per
byte against FLOPs and seconds with the floor and the multiplier, and the learning-rate search's
curves.

    plot_fits({"flops": c, "seconds": c_s}, Path("scaling.png"), "title")
    plot_search(search_points, Path("lr_search.png"), "title", floor=3.55)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hlm_ray.tune import scaling, scaling_fit

COLORS = {"headless": "tab:blue", "headless·prior": "tab:green", "headless·tied": "tab:cyan",
          "vanilla": "tab:orange", "vanilla+prior": "tab:red"}  # fmt: skip
UNITS = {"flops": "FLOPs", "seconds": "training seconds"}


def plot_fits(comparisons: dict[str, scaling_fit.Comparison], out_png: Path, title: str) -> Path:
    """One panel per compute unit: each seed a dot, each arm's mean per budget joined by lines
    (what the multiplier is read from), its fit dashed (a description), the floor, and the
    multiplier at the largest budget where it is read. A comparison's points may hold more
    arms than its two (`Comparison.points`): all are drawn."""
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    fig = Figure(figsize=(5.2 * len(comparisons), 4.2), layout="constrained")
    fig.suptitle(title, fontsize=10)
    for i, (against, c) in enumerate(comparisons.items()):
        ax = fig.add_subplot(1, len(comparisons), i + 1)
        curves = scaling_fit.fit_arms(c.points)
        for arm in dict.fromkeys(p.arm for p in c.points):
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
