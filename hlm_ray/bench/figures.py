"""Benchmark figures (PNG): the loss head against V and K, training tokens/s against V, the
measured speed-up over the strongest vanilla next to the FLOP model's, and a two-panel headline.

    paths = write_figures(out_dir, loss_rows, step_rows)   # the PNGs that could be drawn

Matplotlib's object API only (no pyplot): never touches the global backend.
"""

from __future__ import annotations

from pathlib import Path

from hlm_ray.bench.report import ok_rows

METHOD_STYLE = {
    "cwt_plain": ("tab:blue", "--"),
    "cwt_dedup": ("tab:blue", "-"),
    "cwt_chunked": ("tab:cyan", ":"),
    "ce_full": ("tab:red", "-"),
    "ce_chunked": ("tab:orange", "--"),
    "ce_linear": ("tab:purple", "-."),
    "ce_compiled": ("tab:brown", ":"),
    "ce_liger": ("tab:pink", "-"),
    "ce_cce": ("tab:olive", "-"),
    "ce_cce_compile": ("tab:olive", ":"),
}


ARM_COLORS = {
    "headless/dense": "tab:blue",
    "headless/lazy": "tab:green",
    "vanilla/full": "tab:red",
    "vanilla/chunked": "tab:orange",
    "vanilla/linear": "tab:purple",
    "vanilla/full-seq": "tab:brown",
    "vanilla/liger": "tab:pink",
    "vanilla/cce": "tab:olive",
    "strongest vanilla": "tab:red",
}


def _figure(ncols: int, width: float = 4.6, height: float = 3.6):
    from matplotlib.figure import Figure  # no pyplot: never touches the global backend

    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def plot_loss_head(rows: list[dict], path: Path) -> Path | None:
    sweeps = sorted({(r["sweep_index"], r["sweep"]) for r in rows})
    if not sweeps:
        return None
    fig, axes = _figure(len(sweeps))
    for ax, (index, sweep) in zip(axes, sweeps, strict=True):
        _loss_head_axes(ax, [r for r in rows if r["sweep_index"] == index], sweep)
    return _save(fig, path)


def _loss_head_axes(ax, rows: list[dict], sweep: str, methods=None) -> None:
    over = sweep.split("@")[0]
    fixed = int(sweep.split("=")[1])
    for method in methods or dict.fromkeys(r["method"] for r in rows):
        pts = sorted(
            (r[over], r["time_ms"]) for r in rows if r["method"] == method and r["status"] == "ok"
        )
        if pts:
            color, style = METHOD_STYLE.get(method, (None, "-"))
            ax.plot(*zip(*pts, strict=True), style, color=color, marker="o", ms=3, label=method)
    ax.axvline(fixed, color="grey", lw=0.8, ls=":")
    ax.text(
        fixed, ax.get_ylim()[1] if ax.lines else 1, " K = V", color="grey", va="top", fontsize=8
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(over)
    ax.set_ylabel("forward + backward (ms)")
    ax.set_title(f"loss head, {sweep.split('@')[1]}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)


def _main_points(rows: list[dict]) -> dict[str, list[dict]]:
    """Per model, the rows at its main micro-batch (the one with most vocabulary sizes)."""
    rows = [r for r in rows if r.get("experiment", "points") == "points"]
    out = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        batches = [r["micro_batch"] for r in mine]
        main = max(set(batches), key=lambda b: len({r["V"] for r in mine if r["micro_batch"] == b}))
        out[model] = [r for r in mine if r["micro_batch"] == main]
    return out


def plot_train_step(rows: list[dict], path: Path) -> Path | None:
    by_model = _main_points(ok_rows(rows))
    if not by_model:
        return None
    fig, axes = _figure(len(by_model))
    for ax, (model, mine) in zip(axes, by_model.items(), strict=True):
        _step_axes(ax, model, mine)
    return _save(fig, path)


def _step_axes(ax, model: str, rows: list[dict], arms=None) -> None:
    for arm in arms or dict.fromkeys(r["arm"] for r in rows):
        pts = sorted((r["V"], r["tokens_per_s"]) for r in rows if r["arm"] == arm)
        if pts:
            style = "-" if arm.startswith("headless") else "--"
            color = ARM_COLORS.get(arm)
            ax.plot(*zip(*pts, strict=True), style, color=color, marker="o", ms=3, label=arm)
    batch = rows[0]["micro_batch"] if rows else "?"
    ax.set_xscale("log", base=2)
    ax.set_xlabel("vocabulary size V")
    ax.set_ylabel("training tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{model}, micro-batch {batch}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_speedup(rows: list[dict], path: Path) -> Path | None:
    ok = ok_rows(rows)
    points = []
    for model, mine in _main_points(ok).items():
        for vocab in sorted({r["V"] for r in mine}):
            here = [r for r in mine if r["V"] == vocab]
            strongest = next((r for r in here if r["strongest_vanilla"]), None)
            headless = [r for r in here if r["objective"] == "headless" and "+" not in r["arm"]]
            if strongest and headless:
                best = min(headless, key=lambda r: r["step_ms"])
                points.append((f"{model}\nV={vocab // 1024}k", strongest["step_ms"] / best["step_ms"],
                               strongest["flops_vs_headless"]))  # fmt: skip
    if not points:
        return None
    fig, (ax,) = _figure(1, width=max(5.0, 1.1 * len(points)))
    xs = range(len(points))
    ax.bar([x - 0.2 for x in xs], [p[1] for p in points], 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [p[2] for p in points], 0.4, label="FLOP model", alpha=0.6)
    ax.set_xticks(list(xs), [p[0] for p in points], fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("headless speed-up over strongest vanilla", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def plot_headline(loss_rows: list[dict], step_rows: list[dict], path: Path) -> Path | None:
    """Two panels: training tokens/s vs V (first model), and the loss head vs V (first sweep)."""
    by_model = _main_points(ok_rows(step_rows))
    v_sweeps = sorted(
        {(r["sweep_index"], r["sweep"]) for r in loss_rows if r["sweep"].startswith("V")}
    )
    if not by_model and not v_sweeps:
        return None
    fig, axes = _figure(int(bool(by_model)) + int(bool(v_sweeps)), width=4.4, height=3.3)
    i = 0
    if by_model:
        model, mine = next(iter(by_model.items()))
        rows = [dict(r) for r in mine if r["objective"] == "headless" and "+" not in r["arm"]]
        strongest = [dict(r, arm="strongest vanilla") for r in mine if r["strongest_vanilla"]]
        _step_axes(axes[i], model, rows + strongest)
        i += 1
    if v_sweeps:
        index, sweep = v_sweeps[0]
        _loss_head_axes(axes[i], [r for r in loss_rows if r["sweep_index"] == index], sweep,
                        methods=["cwt_plain", "cwt_dedup", "ce_full", "ce_chunked"])  # fmt: skip
    return _save(fig, path, dpi=90)


def _save(fig, path: Path, dpi: int = 100) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def write_figures(out: Path, loss_rows: list[dict], step_rows: list[dict]) -> list[Path]:
    made = [
        plot_loss_head(loss_rows, out / "loss_head.png"),
        plot_train_step(step_rows, out / "train_step.png"),
        plot_speedup(step_rows, out / "speedup.png"),
        plot_headline(loss_rows, step_rows, out / "headline.png"),
    ]
    return [p for p in made if p is not None]
