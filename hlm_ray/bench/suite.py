"""Run the benchmarks of a preset and write everything they produce into one folder.

    result = run_bench(get_bench_preset("cpu"), output_dir=Path("runs/bench/cpu"))
    result.targets          # [Target(...)], each PASS / MISS / PENDING
    result.files            # CSVs, results.md, environment.json, PNG figures

Order: loss head, training step, Ray overhead (last: a local Ray cluster, once started, keeps
processes that compete for the same cores). A Ray cluster this function started is shut down.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hlm_ray.bench import report
from hlm_ray.bench.common import environment
from hlm_ray.bench.figures import write_figures
from hlm_ray.bench.presets import BENCHMARKS, BenchPreset
from hlm_ray.device import resolve_device
from hlm_ray.errors import HLMError


@dataclass
class BenchResult:
    preset: BenchPreset
    output_dir: Path
    env: dict[str, Any]
    loss_rows: list[dict] = field(default_factory=list)
    step_rows: list[dict] = field(default_factory=list)
    ray_rows: list[dict] = field(default_factory=list)
    targets: list[report.Target] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    markdown: str = ""
    failures: dict[str, str] = field(default_factory=dict)
    """Benchmarks that raised, with the error (their rows are missing)."""


def parse_only(text: str | None) -> tuple[str, ...]:
    if not text:
        return BENCHMARKS
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown or not names:
        raise HLMError(
            f"--only {text!r}: unknown benchmark {unknown[0] if unknown else ''!r}; "
            f"choose from {','.join(BENCHMARKS)}"
        )
    return names


def run_bench(
    preset: BenchPreset,
    *,
    output_dir: Path,
    only: tuple[str, ...] = BENCHMARKS,
    device: torch.device | None = None,
    progress: bool = True,
    headline: Path | None = None,
    log=print,
) -> BenchResult:
    device = device or resolve_device("auto")
    if preset.needs_cuda and device.type != "cuda":
        raise HLMError(
            f"bench preset {preset.name} needs a CUDA GPU and none is visible; "
            "use --preset cpu here"
        )
    if device.type == "cuda":
        # TF32 for float32 matmuls (the logits): what a GPU user would enable; bf16 elsewhere.
        torch.set_float32_matmul_precision("high")
    output_dir.mkdir(parents=True, exist_ok=True)
    result = BenchResult(preset, output_dir, environment(device))
    with contextlib.suppress(OSError, AttributeError):
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
        if load > cores:
            log(
                f"warning: this machine is busy (load {load:.1f} on {cores} cores): timings "
                "will be noisy; ratios of alternated arms suffer least"
            )
    durations: dict[str, float] = {}
    start = time.perf_counter()
    stages = {
        "loss_head": (
            f"loss head ({device.type}, D={preset.loss_head.dim}, {preset.loss_head.dtype})",
            lambda: _loss_head(preset, device, progress, log),
            "loss_rows",
            report.LOSS_COLUMNS,
        ),
        "train_step": (
            f"training step ({device.type}, {preset.train_step.precision})",
            lambda: _train_step(preset, device, progress, log),
            "step_rows",
            report.STEP_COLUMNS,
        ),
        "ray_overhead": (
            "Ray Train overhead (1 worker vs the bare loop)",
            lambda: _ray_overhead(preset, log),
            "ray_rows",
            report.RAY_COLUMNS,
        ),
    }
    for name in BENCHMARKS:
        if name not in only:
            continue
        title, fn, attr, columns = stages[name]
        log(f"== {title}")
        t = time.perf_counter()
        try:
            setattr(result, attr, fn())
        except Exception as err:  # one broken benchmark must not lose the others' results
            result.failures[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            log(f"!! {name} failed: {result.failures[name]}")
        durations[name] = time.perf_counter() - t
        if getattr(result, attr):  # written as soon as it exists
            report.write_csv(getattr(result, attr), output_dir / f"{name}.csv", columns)
    durations["total"] = time.perf_counter() - start
    result.env["durations_s"] = {k: round(v, 1) for k, v in durations.items()}
    with contextlib.suppress(OSError, AttributeError):
        result.env["load_average_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if result.failures:
        result.env["failures"] = result.failures
    result.targets = report.evaluate_targets(
        preset, result.loss_rows, result.step_rows, result.ray_rows, ran=only
    )
    _write(result, headline)
    return result


def _loss_head(preset: BenchPreset, device: torch.device, progress: bool, log) -> list[dict]:
    from hlm_ray.bench.loss_head import run_loss_head

    return run_loss_head(preset.loss_head, device, progress=progress, log=log)


def _train_step(preset: BenchPreset, device: torch.device, progress: bool, log) -> list[dict]:
    from hlm_ray.bench.train_step import run_train_step

    return run_train_step(
        preset.train_step, device, flat_points=preset.flat_points, progress=progress, log=log
    )


def _ray_overhead(preset: BenchPreset, log) -> list[dict]:
    import ray

    from hlm_ray.bench.ray_overhead import run_ray_overhead

    started_here = not ray.is_initialized()
    try:
        return run_ray_overhead(preset.ray_overhead, log=log)
    finally:
        if started_here and ray.is_initialized():
            ray.shutdown()


def _write(result: BenchResult, headline: Path | None) -> None:
    out = result.output_dir
    files = []
    if result.loss_rows:
        files.append(report.write_csv(result.loss_rows, out / "loss_head.csv", report.LOSS_COLUMNS))
    if result.step_rows:
        files.append(
            report.write_csv(result.step_rows, out / "train_step.csv", report.STEP_COLUMNS)
        )
    if result.ray_rows:
        files.append(
            report.write_csv(result.ray_rows, out / "ray_overhead.csv", report.RAY_COLUMNS)
        )
    targets = [t.row() for t in result.targets]
    files.append(report.write_csv(targets, out / "targets.csv", report.TARGET_COLUMNS))
    env = {**result.env, "preset": asdict(result.preset)}
    (out / "environment.json").write_text(json.dumps(env, indent=1, default=str))
    files.append(out / "environment.json")
    result.markdown = report.markdown_report(
        result.preset, result.env, result.loss_rows, result.step_rows, result.ray_rows,
        result.targets,
    )  # fmt: skip
    (out / "results.md").write_text(result.markdown)
    files.append(out / "results.md")
    figures = write_figures(out, result.loss_rows, result.step_rows)
    files += figures
    if headline is not None and (out / "headline.png") in figures:
        headline.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "headline.png", headline)
    result.files = files


def log_to_mlflow(result: BenchResult, experiment: str = "hlm_bench") -> str | None:
    """One MLflow run: the preset and environment as params, each target's ratio and each
    training-step arm's tokens/s (step = V, so MLflow plots them against the vocabulary) as
    metrics, every output file as an artifact. Returns the run id (None if tracking failed)."""
    from hlm_ray.config import flatten
    from hlm_ray.tracking import MlflowTracker

    tracker = MlflowTracker(
        experiment,
        run_name=f"bench-{result.preset.name}",
        tags={"kind": "benchmark", "preset": result.preset.name, "device": result.env["device"]},
    )
    env = {k: v for k, v in result.env.items() if k != "durations_s"}
    tracker.log_params({"env": env, "preset": dict(flatten(asdict(result.preset)))})
    metrics = {f"duration_s/{k}": v for k, v in result.env.get("durations_s", {}).items()}
    for t in result.targets:
        if t.measured is not None:
            metrics[f"target/{_slug(t.target)}/{_slug(t.scope)}"] = t.measured
    tracker.log_metrics(metrics, step=0)
    for r in report.ok_rows(result.step_rows):
        prefix = "tokens_per_s" if r.get("experiment") == "points" else "flat_tokens_per_s"
        key = f"{prefix}/{r['model']}/B{r['micro_batch']}/{r['arm']}"
        tracker.log_metrics({_slug(key, keep="/"): r["tokens_per_s"]}, step=int(r["V"]))
    for path in result.files:
        tracker.log_artifact(path)
    tracker.set_tags({t_slug: t.verdict for t_slug, t in _verdict_tags(result.targets)})
    tracker.finish("FINISHED")
    return tracker.run_id


def _verdict_tags(targets: list[report.Target]):
    for t in targets:
        yield f"verdict/{_slug(t.target)}/{_slug(t.scope)}", t


def _slug(text: str, keep: str = "") -> str:
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.") | set(keep)
    out = "".join(c if c in allowed else "_" for c in text)
    return "_".join(part for part in out.split("_") if part)[:200]
