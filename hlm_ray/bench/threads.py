"""In-process training on shared cores: a training step of a preset's model under OpenMP's
waiting policies, with and without busy processes beside it.

    python -m hlm_ray.bench.threads                        # tiny-decoder, 0 and 2 busy loops
    python -m hlm_ray.bench.threads --preset tiny-encoder --busy 0,2 --rounds 3 --seconds 4

Each arm is a process of its own (OpenMP reads its settings once, as torch loads it):
    spin     OpenMP's default: threads spin at each barrier before they sleep (GOMP_SPINCOUNT
             at libgomp's default), one thread per core: what `hlm` ran in process before
    passive  OMP_WAIT_POLICY=PASSIVE, one thread per core: what `hlm` sets for its in-process
             commands (`hlm_ray/threads.py`)
    1 thread OMP_NUM_THREADS=1: what a Ray Train worker with one CPU runs
Each arm times the preset's model (its objective, micro-batch and optimizer, random token ids,
V = 1,024) for `--seconds` after a warm-up; the arms alternate, `--rounds` times, beside each
number of busy loops (`python -c "while True: pass"`, started before and stopped after that
set of rounds). Printed: the median ms per step of each arm and spin ÷ passive, with the load
average; the machine's other work counts too, so the load is said with each figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

ARMS = {
    "spin": {"GOMP_SPINCOUNT": "300000"},  # libgomp's own default, said explicitly
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}

_CHILD = r"""
import sys, time
import torch
from hlm_ray.bench.presets import StepModel
from hlm_ray.bench.train_step import Arm, BuiltArm, make_batches
from hlm_ray.presets import get_preset

cfg = get_preset(sys.argv[1])
vocab, micro = 1024, cfg.optim.micro_batch_size
shape = StepModel(cfg.preset, cfg.model, cfg.data.seq_len, ((vocab, micro),))
device = torch.device("cpu")
built = BuiltArm(Arm("a", cfg.objective.name), shape, vocab, device)
batches = make_batches(shape, vocab, micro, 4, device)
for i in range(3):
    built.step(batches[i % 4], None, device)
start, steps = time.perf_counter(), 0
while time.perf_counter() - start < float(sys.argv[2]):
    built.step(batches[steps % 4], None, device)
    steps += 1
print((time.perf_counter() - start) / steps * 1e3)
"""


def time_arm(arm: str, preset: str, seconds: float) -> float:
    """ms per step of `preset`'s model in a process of its own, under `ARMS[arm]`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                                            "OMP_NUM_THREADS")}  # fmt: skip
    env.update(ARMS[arm])
    done = subprocess.run([sys.executable, "-c", _CHILD, preset, str(seconds)], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return float(done.stdout.split()[-1])


def run(preset: str, busy: list[int], rounds: int, seconds: float, log=print) -> list[dict]:
    rows = []
    for loops in busy:
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(loops)]
        try:
            times: dict[str, list[float]] = {arm: [] for arm in ARMS}
            loads = [os.getloadavg()[0]]
            for _ in range(rounds):
                for arm in ARMS:  # alternated: drift of the machine spreads over every arm
                    times[arm].append(time_arm(arm, preset, seconds))
                loads.append(os.getloadavg()[0])
        finally:
            for p in procs:
                p.kill()
                p.wait()
        row = {"busy": loops, "load": (min(loads), max(loads))}
        row.update({arm: statistics.median(t) for arm, t in times.items()})
        rows.append(row)
        log(line(row))
    return rows


def line(row: dict) -> str:
    arms = ", ".join(f"{arm} {row[arm]:.1f} ms" for arm in ARMS)
    low, high = row["load"]
    return (
        f"{row['busy']} busy loop(s): {arms} per step; spin ÷ passive "
        f"{row['spin'] / row['passive']:.2f}, 1 thread ÷ passive "
        f"{row['1 thread'] / row['passive']:.2f} (load average {low:.1f}-{high:.1f})"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hlm_ray.bench.threads", description=__doc__)
    p.add_argument("--preset", default="tiny-decoder", help="the model (default tiny-decoder)")
    p.add_argument("--busy", default="0,2", help="busy loops beside the arms (default 0,2)")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the arms (3)")
    p.add_argument("--seconds", type=float, default=4.0, help="timed seconds per arm (4)")
    args = p.parse_args(argv)
    run(args.preset, [int(b) for b in args.busy.split(",")], args.rounds, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
