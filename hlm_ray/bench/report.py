"""Benchmark outputs: the targets with their verdicts, CSV and Markdown tables (the PNGs are
hlm_ray/bench/figures.py).

    targets = evaluate_targets(preset, loss_rows, step_rows, ray_rows)
    write_csv(step_rows, out / "train_step.csv", STEP_COLUMNS)
    print(markdown_report(preset, env, loss_rows, step_rows, ray_rows, targets))

Each target is a ratio from one run, compared with its threshold: PASS, MISS (with by how
much), or PENDING when this run cannot measure it (GPU targets on a CPU machine).
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hlm_ray.bench.presets import BenchPreset

LOSS_COLUMNS = [
    "sweep", "sweep_index", "method", "K", "V", "D", "U", "dtype", "device", "status", "time_ms",
    "time_ms_p25", "time_ms_p75", "time_ms_min", "time_ms_max", "peak_mb", "gflop",
    "gflops_per_s", "note",
]  # fmt: skip
STEP_COLUMNS = [
    "experiment", "model", "family", "arch", "arm", "objective", "embedding_update", "ce_impl",
    "mlm_full_logits", "attn_impl", "precision", "device", "V", "micro_batch", "seq_len",
    "tokens", "K", "U", "status", "step_ms", "step_ms_p25", "step_ms_p75", "step_ms_min",
    "step_ms_max", "repeats", "tokens_per_s", "peak_mb", "gflop_per_step", "head_share", "mfu",
    "flops_vs_headless", "time_vs_headless", "strongest_vanilla", "note",
]  # fmt: skip
RAY_COLUMNS = [
    "arm", "run", "preset", "steps", "windows", "cpus", "step_ms", "step_ms_p25", "step_ms_p75",
    "step_ms_min", "step_ms_max",
]  # fmt: skip
TARGET_COLUMNS = ["target", "scope", "measured", "threshold", "verdict", "margin", "detail"]

FLAT_MIN, SPEEDUP_MIN, RAY_MAX, MFU_MIN, MEMORY_MAX = 0.95, 0.9, 1.05, 0.40, 1.0
MEMORY_V = 131072  # the vocabulary where headless peak memory must be below every vanilla arm's


@dataclass(frozen=True)
class Target:
    target: str
    scope: str
    measured: float | None
    threshold: float
    higher_is_better: bool
    detail: str = ""

    @property
    def verdict(self) -> str:
        if self.measured is None or math.isnan(self.measured):
            return "PENDING"
        ok = (
            self.measured >= self.threshold
            if self.higher_is_better
            else (self.measured <= self.threshold)
        )
        return "PASS" if ok else "MISS"

    @property
    def margin(self) -> str:
        """How far from the threshold, in % of it: "+4.1%" clear of it, "-7.3%" short of it."""
        if self.verdict == "PENDING":
            return ""
        gap = self.measured / self.threshold - 1
        return f"{(gap if self.higher_is_better else -gap) * 100:+.1f}%"

    def row(self) -> dict[str, Any]:
        op = "≥" if self.higher_is_better else "≤"
        return {
            "target": self.target,
            "scope": self.scope,
            "measured": None if self.measured is None else round(self.measured, 4),
            "threshold": f"{op} {self.threshold:g}",
            "verdict": self.verdict,
            "margin": self.margin,
            "detail": self.detail,
        }


def ok_rows(rows: Iterable[dict]) -> list[dict]:
    """The rows measured (not skipped, not failed): the ones figures and targets read."""
    return [r for r in rows if r.get("status", "ok") == "ok"]


def _main_batch(preset: BenchPreset, model: str) -> int | None:
    for sm in preset.train_step.models:
        if sm.name == model:
            return sm.points[0][1]
    return None


def evaluate_targets(
    preset: BenchPreset,
    loss_rows: list[dict],
    step_rows: list[dict],
    ray_rows: list[dict],
    *,
    ran: Iterable[str] = ("loss_head", "train_step", "ray_overhead"),
) -> list[Target]:
    ran = set(ran)
    targets: list[Target] = []
    steps = [r for r in ok_rows(step_rows) if r.get("experiment", "points") == "points"]
    flat = [r for r in ok_rows(step_rows) if r.get("experiment") == "flat-in-V"]
    if "train_step" in ran:
        targets += _flat_targets(preset, flat or steps)
        targets += _speedup_targets(steps)
        targets += _memory_targets(steps)
    if "ray_overhead" in ran:
        from hlm_ray.bench.ray_overhead import overhead_ratio

        ratio = overhead_ratio(ray_rows)
        bare = [r["step_ms"] for r in ray_rows if r["arm"] == "bare"]
        ray_ms = [r["step_ms"] for r in ray_rows if r["arm"] == "ray"]
        detail = (
            f"Ray {statistics.mean(ray_ms):.1f} ms vs bare {statistics.mean(bare):.1f} ms "
            f"(Ray runs {', '.join(f'{b:.1f}' for b in ray_ms)}; "
            f"bare runs {', '.join(f'{b:.1f}' for b in bare)})"
            if ratio is not None
            else "no runs"
        )
        scope = f"{ray_rows[0]['preset']}, 1 worker" if ray_rows else "not run"
        targets.append(Target("Ray Train step / bare step", scope, ratio, RAY_MAX, False, detail))
    targets.append(_mfu_target(preset, steps))
    return targets


def _flat_targets(preset: BenchPreset, steps: list[dict]) -> list[Target]:
    out = []
    for model, (small, large) in preset.flat_points.items():
        batch = _main_batch(preset, model)

        def tps(arm: str, vocab: int, model=model, batch=batch) -> float | None:
            for r in steps:
                if (r["model"], r["arm"], r["V"], r["micro_batch"]) == (model, arm, vocab, batch):
                    return r["tokens_per_s"]
            return None

        lazy = [tps("headless/lazy", v) for v in (small, large)]
        dense = [tps("headless/dense", v) for v in (small, large)]
        ratio = lazy[1] / lazy[0] if None not in lazy else None
        detail = ""
        if ratio is not None:
            detail = f"headless/lazy {lazy[0]:.0f} → {lazy[1]:.0f} tok/s"
            if None not in dense:
                detail += (
                    f"; headless/dense {dense[1] / dense[0]:.3f} ({dense[0]:.0f} → {dense[1]:.0f})"
                )
        scope = f"{model} B={batch}: V={large} / V={small}"
        if steps and steps[0].get("experiment") == "flat-in-V":
            detail += "; the four arms timed in alternation"
        out.append(Target("headless tokens/s flat in V", scope, ratio, FLAT_MIN, True, detail))
    return out


def _speedup_targets(steps: list[dict]) -> list[Target]:
    out = []
    points = sorted({(r["model"], r["micro_batch"], r["V"]) for r in steps})
    for model, batch, vocab in points:
        here = [r for r in steps if (r["model"], r["micro_batch"], r["V"]) == (model, batch, vocab)]
        strongest = next((r for r in here if r["strongest_vanilla"]), None)
        headless = [r for r in here if r["objective"] == "headless" and "+" not in r["arm"]]
        if strongest is None or not headless:
            continue
        best = min(headless, key=lambda r: r["step_ms"])
        measured = strongest["step_ms"] / best["step_ms"]
        predicted = strongest["flops_vs_headless"]
        detail = (
            f"{strongest['arm']} {strongest['step_ms']:.0f} ms / {best['arm']} "
            f"{best['step_ms']:.0f} ms = {measured:.2f}×; FLOP model {predicted:.2f}×"
        )
        scope = f"{model} V={vocab} B={batch}"
        out.append(
            Target(
                "speed-up / FLOP-model speed-up",
                scope,
                measured / predicted,
                SPEEDUP_MIN,
                True,
                detail,
            )
        )
    return out


def _memory_targets(steps: list[dict]) -> list[Target]:
    """At V = MEMORY_V: the lower headless peak / the lowest peak of any measured vanilla arm
    (fused kernels included), which must stay below 1."""
    out = []
    points = sorted({(r["model"], r["micro_batch"]) for r in steps if r["V"] == MEMORY_V})
    for model, batch in points:
        here = [
            r for r in steps if (r["model"], r["micro_batch"], r["V"]) == (model, batch, MEMORY_V)
        ]
        peaks = {r["arm"]: r["peak_mb"] for r in here if r.get("peak_mb") is not None}
        headless = {a: p for a, p in peaks.items() if a.startswith("headless/") and "+" not in a}
        vanilla = {a: p for a, p in peaks.items() if a.startswith("vanilla/")}
        if not headless or not vanilla:
            continue
        h_arm, v_arm = min(headless, key=headless.get), min(vanilla, key=vanilla.get)
        unmeasured = [
            r["arm"] for r in here if r["objective"] == "vanilla" and r["arm"] not in peaks
        ]
        detail = (
            f"{h_arm} {headless[h_arm]:.0f} MB / {v_arm} {vanilla[v_arm]:.0f} MB (lowest vanilla)"
        )
        if unmeasured:
            detail += f"; not measured: {', '.join(unmeasured)}"
        scope = f"{model} V={MEMORY_V} B={batch}"
        ratio = headless[h_arm] / vanilla[v_arm]
        out.append(
            Target("headless peak memory / lowest vanilla", scope, ratio, MEMORY_MAX, False, detail)
        )
    return out


def _mfu_target(preset: BenchPreset, steps: list[dict]) -> Target:
    name = "GPU MFU, headless GPT-2-small-size decoder, bf16"
    if preset.mfu_model is None:
        return Target(
            name,
            "needs a CUDA GPU",
            None,
            MFU_MIN,
            True,
            "pending: run `hlm bench --preset gpu` on an H100/H200",
        )
    rows = [
        r
        for r in steps
        if r["model"] == preset.mfu_model and r["objective"] == "headless" and r.get("mfu")
    ]
    if not rows:
        return Target(name, preset.mfu_model, None, MFU_MIN, True, "no measured headless arm")
    best = max(rows, key=lambda r: r["mfu"])
    detail = f"{best['arm']} ({best['attn_impl']}), {best['tokens_per_s']:.0f} tok/s"
    return Target(name, f"{preset.mfu_model} V={best['V']}", best["mfu"], MFU_MIN, True, detail)


# ------------------------------------------------------------------------------------ tables


def write_csv(rows: list[dict], path: Path, columns: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore", restval="")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k)) for k in columns})
    return path


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def _md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _num(value: float | None, fmt: str = ".1f") -> str:
    return (
        "—"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else format(value, fmt)
    )


def loss_head_table(rows: list[dict], key: str = "time_ms", fmt: str = ".1f") -> str:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cells: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        cells.setdefault((r["sweep_index"], r["sweep"], r["K"], r["V"]), {})[r["method"]] = r
    body = []
    for (_, sweep, K, V), by_method in cells.items():
        U = next((m["U"] for m in by_method.values() if m.get("U") is not None), "")
        line = [sweep, K, V, U]
        for method in methods:
            r = by_method.get(method)
            line.append("skip" if r is None or r["status"] != "ok" else _num(r[key], fmt))
        body.append(line)
    return _md_table(["sweep", "K", "V", "U", *methods], body)


def step_table(rows: list[dict], flat: bool = False) -> str:
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append(
                [
                    r["model"],
                    r["V"],
                    r["micro_batch"],
                    r["arm"],
                    f"skipped: {r['note']}",
                    "",
                    "",
                    "",
                    "",
                    "",
                ]
            )
            continue
        body.append([
            r["model"], r["V"], r["micro_batch"],
            r["arm"] + (" ★" if r["strongest_vanilla"] else ""),
            f"{r['step_ms']:.1f} [{r['step_ms_p25']:.1f}–{r['step_ms_p75']:.1f}]",
            f"{r['tokens_per_s']:.0f}", _num(r.get("peak_mb"), ".0f"),
            f"{r['flops_vs_headless']:.2f}", _num(r.get("time_vs_headless"), ".2f"),
            _num(None if r.get("mfu") is None else r["mfu"] * 100, ".1f"),
        ])  # fmt: skip
    header = ["model", "V", "B", "arm", "step ms (median [IQR])", "tokens/s", "peak MB",
              "FLOPs × headless", "time × headless", "MFU %"]  # fmt: skip
    return _md_table(header, body)


def no_head_rows(steps: list[dict]) -> list[dict]:
    """Per point that timed a `no-head/lazy` arm: the `headless/lazy` step (the same model,
    table and optimizer) ÷ that step, how much the loss head adds to a step with none (the
    limit of its cost), beside the FLOP model's ratio, 1 / (1 - head share)."""
    rows = ok_rows(steps)
    out = []
    for none in [r for r in rows if r["arm"] == "no-head/lazy"]:
        point = (none["model"], none["V"], none["micro_batch"])
        here = [r for r in rows if (r["model"], r["V"], r["micro_batch"]) == point]
        headless = next((r for r in here if r["arm"] == "headless/lazy"), None)
        if headless is None:
            continue
        share = headless["head_share"]
        out.append({
            "model": none["model"], "V": none["V"], "micro_batch": none["micro_batch"],
            "step_ms": headless["step_ms"], "no_head_ms": none["step_ms"],
            "ratio": headless["step_ms"] / none["step_ms"],
            "flop_ratio": 1 / (1 - share) if share < 1 else None,
        })  # fmt: skip
    return out


def no_head_table(rows: list[dict]) -> str:
    body = [
        [r["model"], r["V"], r["micro_batch"], f"{r['step_ms']:.1f}", f"{r['no_head_ms']:.1f}",
         f"{r['ratio']:.3f}", _num(r["flop_ratio"], ".3f")]
        for r in rows
    ]  # fmt: skip
    header = ["model", "V", "B", "headless/lazy step ms", "no-head/lazy step ms",
              "headless ÷ no head", "FLOP model"]  # fmt: skip
    return _md_table(header, body)


def ray_table(rows: list[dict]) -> str:
    body = [
        [r["run"] + 1, r["arm"], r["steps"], r["windows"],
         f"{r['step_ms']:.2f} [{r['step_ms_p25']:.2f}–{r['step_ms_p75']:.2f}]"]
        for r in rows
    ]  # fmt: skip
    return _md_table(["run", "arm", "steps", "windows", "step ms (median [IQR])"], body)


def targets_table(targets: list[Target]) -> str:
    body = [
        [t.target, t.scope, _num(t.measured, ".3f"), t.row()["threshold"], t.verdict, t.margin,
         t.detail]
        for t in targets
    ]  # fmt: skip
    return _md_table(["target", "scope", "measured", "threshold", "verdict", "margin", "detail"],
                     body)  # fmt: skip


def markdown_report(
    preset: BenchPreset,
    env: dict[str, Any],
    loss_rows: list[dict],
    step_rows: list[dict],
    ray_rows: list[dict],
    targets: list[Target],
) -> str:
    parts = [f"# hlm bench --preset {preset.name}", ""]
    skip = ("durations_s", "failures")
    parts.append("Environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if k not in skip))
    for name, error in env.get("failures", {}).items():
        parts.append(f"\n**Benchmark {name} failed**: {error}")
    if "durations_s" in env:
        parts.append(
            "Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in env["durations_s"].items())
        )
    parts += ["", "## Targets", "", targets_table(targets)]
    points = [r for r in step_rows if r.get("experiment", "points") == "points"]
    flat = [r for r in step_rows if r.get("experiment") == "flat-in-V"]
    if step_rows:
        parts += [
            "", "## Training step", "",
            "Median step time with its interquartile range over the alternated repeats; "
            "★ = strongest vanilla at that point; `FLOPs × headless` is the FLOP model's "
            "predicted speed-up of headless over the arm, `time × headless` the measured one.",
            "", step_table(points),
        ]  # fmt: skip
    if flat:
        parts += [
            "", "## Flat in V: headless at the smallest and largest V, alternated", "",
            step_table(flat, flat=True),
        ]  # fmt: skip
    no_head = no_head_rows(points)
    if no_head:
        parts += [
            "", "## Headless against no loss head at all", "",
            "The headless step (`headless/lazy`) ÷ the same model's step with no loss head "
            "(`no-head/lazy`: the body's output, a loss that costs nothing beside it, the same "
            "table and lazy update), timed in alternation with the other arms: what the loss "
            "head adds, against the FLOP model's 1 / (1 − head share).",
            "", no_head_table(no_head),
        ]  # fmt: skip
    if loss_rows:
        parts += [
            "", "## Loss head: forward + backward, median ms", "", loss_head_table(loss_rows),
            "", "## Loss head: peak memory, MB", "", loss_head_table(loss_rows, "peak_mb", ".1f"),
        ]  # fmt: skip
        notes = sorted({f"{r['method']}: {r['note']}" for r in loss_rows if r["status"] != "ok"})
        if notes:
            parts += ["", "Skipped cells:", "", *[f"- {n}" for n in notes[:20]]]
    if ray_rows:
        parts += ["", "## Ray Train overhead", "", ray_table(ray_rows)]
    return "\n".join(parts) + "\n"
