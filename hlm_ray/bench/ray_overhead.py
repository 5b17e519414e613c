"""Ray Train's overhead per training step: the same loop bare and under a 1-worker TorchTrainer.

    python -m hlm_ray.bench.ray_overhead --steps 200     # prints both step times and the ratio

Step time is the loop's own `train/step_time_s` (optimizer steps only: evaluation, checkpoints
and start-up excluded), median over log windows after the first (warm-up). The Ray worker gets
all the machine's CPUs, so both arms run torch with the same thread count. Arms run bare, Ray,
bare, and the bare figure is the mean of its two runs, so drift of the machine shows as spread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from hlm_ray.config import load_config
from hlm_ray.tracking import read_metrics

TARGET = 1.05


def _step_times(run_dir: Path) -> list[float]:
    rows = [r["train/step_time_s"] for r in read_metrics(run_dir) if "train/step_time_s" in r]
    return rows[1:]  # the first window holds warm-up


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-decoder")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(argv)

    from hlm_ray.train.launch import launch
    from hlm_ray.train.loop import train_worker

    root = Path(tempfile.mkdtemp(prefix="hlm-ray-overhead-"))
    overrides = [
        f"optim.max_steps={args.steps}",
        "run.log_every=10",
        f"run.eval_every={args.steps}",
        f"run.checkpoint_every={args.steps}",
        *args.set,
    ]
    medians: dict[str, list[float]] = {"bare": [], "ray": []}
    for arm in ("bare", "ray", "bare"):
        out = root / f"{arm}-{len(medians[arm])}"
        cfg = load_config(args.preset, overrides=[*overrides, f"run.output_dir={out}"])
        if arm == "bare":
            train_worker(cfg.to_dict(), progress=False)
        else:
            launch(cfg, num_workers=1, cpus_per_worker=os.cpu_count() or 1, experiment="bench")
        medians[arm].append(statistics.median(_step_times(out)))
    bare = statistics.mean(medians["bare"])
    ray_time = medians["ray"][0]
    ratio = ray_time / bare
    print(
        f"bare step time  {bare * 1e3:8.2f} ms  (runs: {[f'{m * 1e3:.2f}' for m in medians['bare']]})"
    )
    print(f"Ray step time   {ray_time * 1e3:8.2f} ms")
    verdict = "meets" if ratio <= TARGET else f"misses by {(ratio / TARGET - 1) * 100:.1f}%"
    print(f"ratio Ray/bare  {ratio:8.3f}  (target <= {TARGET}: {verdict})")
    return {"bare_s": bare, "ray_s": ray_time, "ratio": ratio}


if __name__ == "__main__":
    main()
