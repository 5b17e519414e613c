"""Ray Train's overhead per training step: the same loop bare and under a 1-worker TorchTrainer.

    rows = run_ray_overhead(RayOverheadSpec(steps=100))    # part of `hlm bench`
    python -m hlm_ray.bench.ray_overhead --steps 200       # on its own: both step times, ratio

Step time is the loop's own `train/step_time_s` (optimizer steps only: evaluation, checkpoints
and start-up excluded), median over log windows after the first (warm-up). The Ray worker gets
all the CPUs the cluster offers (at most this machine's), so both arms run torch with the same
thread count. Runs alternate bare, Ray, bare, Ray, bare (`ray_runs` Ray runs) and each arm's
figure is the mean of its runs' medians, so drift of the machine spreads over both arms. Uses the cluster of RAY_ADDRESS (a Ray job) or starts a local one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from hlm_ray.bench.common import spread
from hlm_ray.bench.presets import RayOverheadSpec
from hlm_ray.presets import load_config
from hlm_ray.tracking import read_metrics

TARGET = 1.05
EXPERIMENT = "hlm_bench"


def _step_times(run_dir: Path) -> list[float]:
    rows = [r["train/step_time_s"] for r in read_metrics(run_dir) if "train/step_time_s" in r]
    return rows[1:] or rows  # the first window holds warm-up


def run_ray_overhead(spec: RayOverheadSpec, *, log=print) -> list[dict]:
    """One row per run (bare, ray, bare, ...): median step time over its log windows."""
    import ray

    from hlm_ray.train.launch import connect, launch
    from hlm_ray.train.loop import train_worker

    connect()
    cpus = max(1, min(os.cpu_count() or 1, int(ray.cluster_resources().get("CPU", 1))))
    root = Path(tempfile.mkdtemp(prefix="hlm-ray-overhead-"))
    overrides = [
        f"optim.max_steps={spec.steps}",
        f"run.log_every={spec.log_every}",
        f"run.eval_every={spec.steps}",
        f"run.checkpoint_every={spec.steps}",
        *spec.overrides,
    ]
    rows = []
    arms = ["bare", *(["ray", "bare"] * spec.ray_runs)]  # bare, ray, bare, ray, bare ...
    for run, arm in enumerate(arms):
        out = root / f"{run}-{arm}"
        cfg = load_config(spec.preset, overrides=[*overrides, f"run.output_dir={out}"])
        log(f"ray overhead: run {run + 1}/{len(arms)} ({arm}, {spec.steps} steps of {spec.preset})")
        if arm == "bare":
            train_worker(cfg.to_dict(), progress=False)
        else:
            launch(cfg, num_workers=1, cpus_per_worker=cpus, experiment=EXPERIMENT)
        times = _step_times(out)
        s = spread(times)
        rows.append(
            {
                "arm": arm,
                "run": run,
                "preset": spec.preset,
                "steps": spec.steps,
                "windows": len(times),
                "cpus": cpus,
                "step_ms": s["median"] * 1e3,
                "step_ms_p25": s["p25"] * 1e3,
                "step_ms_p75": s["p75"] * 1e3,
                "step_ms_min": s["min"] * 1e3,
                "step_ms_max": s["max"] * 1e3,
            }
        )
    return rows


def overhead_ratio(rows: list[dict]) -> float | None:
    """Mean of the Ray runs' step times over the mean of the bare runs'."""
    bare = [r["step_ms"] for r in rows if r["arm"] == "bare"]
    ray = [r["step_ms"] for r in rows if r["arm"] == "ray"]
    if not bare or not ray:
        return None
    return statistics.mean(ray) / statistics.mean(bare)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-decoder")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(argv)
    spec = RayOverheadSpec(preset=args.preset, steps=args.steps, overrides=tuple(args.set))
    rows = run_ray_overhead(spec)
    bare = statistics.mean(r["step_ms"] for r in rows if r["arm"] == "bare")
    ray_ms = statistics.mean(r["step_ms"] for r in rows if r["arm"] == "ray")
    ratio = overhead_ratio(rows)
    runs = [f"{r['step_ms']:.2f}" for r in rows if r["arm"] == "bare"]
    print(f"bare step time  {bare:8.2f} ms  (runs: {runs})")
    print(f"Ray step time   {ray_ms:8.2f} ms")
    verdict = "meets" if ratio <= TARGET else f"misses by {(ratio / TARGET - 1) * 100:.1f}%"
    print(f"ratio Ray/bare  {ratio:8.3f}  (target <= {TARGET}: {verdict})")
    return {"bare_s": bare / 1e3, "ray_s": ray_ms / 1e3, "ratio": ratio}


if __name__ == "__main__":
    main()
