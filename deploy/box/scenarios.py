"""The cluster box's scenarios: what a user does on a cluster, submitted from the client namespace
as `ray job submit`, and checked from there through MLflow and the Job API alone.

    python deploy/box/scenarios.py                  # up, every scenario, down: a table of findings
    python deploy/box/scenarios.py --full           # the S3 sweep with all three tiny sizes
    python deploy/box/scenarios.py --only train-s3 partition --keep     # some; keep the box up
    python deploy/box/scenarios.py --reuse --only serve      # on the box `box.py up` started
    python deploy/box/scenarios.py --serial         # one scenario at a time: each one's own time

| scenario | what it runs | what must hold |
|---|---|---|
| train-shared, train-s3 | `hlm train --num-workers 2 --cpus-per-worker 2`, run storage on the shared volume / in S3 | one worker on each worker node (the run's `worker_nodes` tag), every step in MLflow, the model logged; no worker node prepared the corpus itself |
| sweep-shared, sweep-s3 | `python sweeps/vocab.py --preset tiny --set sweep.values=[1024] --set sweep.cpus_per_worker=2` (all three sizes on S3 with `--full`) from a folder on the shared volume / with `--storage-path s3://...` | the parent and its 2 children (6 with `--full`) FINISHED in MLflow with scores and figures, on worker nodes |
| sweep-resume | sweep-s3's command again, after it | it resumes from its state in S3: no trial runs again |
| registry | `hlm finetune --task clm --register` on the cluster, then `hlm generate --model models:/...` on the client | the fine-tune's workers started from the driver's copy of the model in S3 (its `init.model_dir`); the registered model loads on the client, through the tracking server |
| tracking-outage | `hlm train` whose rank 0's node cannot reach the tracking server for 60 s | the run goes on; MLflow has every logged step at the end |
| serve | `hlm serve` with 2 replicas of half a CPU (one per worker node, checked) and an API key, asked from the client through the head; one replica's node cut off | every request answered; how long the requests in flight at the cut waited |
| partition | a one-trial sweep (S3, pretraining only); its rank 0's node cut off (link down) after its first checkpoint | the node declared dead; the trial finishes on the other node, one child run whose loss at every step equals an undisturbed run's; the node rejoins |
| serve+partition | both at once: the trial's node also holds a replica, and one cut takes both (what a full run does) | both scenarios' checks |
| tracking-stop | a 2-trial sweep (S3); the MLflow server stopped (SIGSTOP) as the first downstream step starts, until the sweep ended, then killed and started again | the sweep succeeds and names the command that sends its records, `hlm sync runs/sweeps/<name>`; submitted from the client, it leaves parent and children FINISHED, every child's downstream scores in MLflow |
| downstream-cut | a one-trial sweep (S3, headless); the node its downstream step runs on cut off during the step | the node declared dead; the step runs again on the node left and the sweep finishes without a resubmit; the child FINISHED with its scores; the node rejoins |
| head-restart | `hlm train --num-workers 2` with its run in S3; after its first checkpoint the head's Ray (GCS, the job's driver) killed, Ray started again on every node | `hlm train --resume s3://hlm-runs/runs/<name>` continues it from its newest checkpoint to the end: one MLflow run, FINISHED, each step logged once, the model |

Each scenario is a function of the box that raises `AssertionError` naming what did not hold
and returns its figures; `tests/test_cluster_box.py` runs two of them in `make test`. The
scenarios run in `GROUPS`, side by side within a group, and the table gives each one's wall time
with the machine's load average while it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from box import ROOT, Box, missing  # noqa: E402
from cuts import partition, serve, serve_and_partition, start_reference  # noqa: E402
from jobs import registry, sweep, sweep_resume, tracking_outage, train  # noqa: E402
from outages import downstream_cut, head_restart, tracking_stop  # noqa: E402

FULL = False  # --full: the S3 sweep runs the whole tiny preset (six trials, not two)


SCENARIOS: dict[str, Callable[[Box], dict]] = {
    "train-shared": lambda box: train(box, "shared"),
    "train-s3": lambda box: train(box, "s3"),
    "sweep-shared": lambda box: sweep(box, "shared"),
    "sweep-s3": lambda box: sweep(box, "s3", full=FULL),
    "sweep-resume": sweep_resume,
    "registry": registry,
    "tracking-outage": tracking_outage,
    "serve": serve,
    "partition": lambda box: partition(box, REFERENCE),
    "serve+partition": lambda box: serve_and_partition(box, REFERENCE),
    "tracking-stop": tracking_stop,
    "downstream-cut": downstream_cut,
    "head-restart": head_restart,
}
GROUPS = [
    ("train-shared", "train-s3"),
    ("sweep-shared", "sweep-s3"),
    ("registry", "tracking-outage", "sweep-resume"),
    ("serve+partition",),
    ("tracking-stop",),
    ("downstream-cut",),
    ("head-restart",),
]
"""Scenarios that run side by side, as two users' jobs share a cluster: Ray queues what the two
worker nodes cannot hold at once, and each group ends before the next starts. What one needs of
another comes from an earlier group (train-s3's model for registry, registry's for serve). The
tracking outage cuts only its own node's tracking traffic, and its worker fills that node:
registry's runs on the other one (the resubmitted sweep runs no trial). Serve and partition
cut a node off, so nothing else runs meanwhile; together (`serve+partition`,
`serve_and_partition`) one cut takes a replica and the trial, as a real node goes; alone, or
`--serial`, each makes its own cut. The last three each stop something every job shares (the
tracking server, a node, the head): each runs alone."""
NEEDS = {"registry": "train-s3", "sweep-resume": "sweep-s3", "serve": "registry"}
"""What a scenario takes from another of the same run: train-s3's run (by this run's tag) for
registry, sweep-s3's command for sweep-resume, registry's model for serve. `--only` runs them
too; with `--reuse`, serve serves what the box's registry already holds."""
REFERENCE: subprocess.Popen | None = None
"""The partition's undisturbed reference run, started while the group before it runs (the
tracking outage's minute leaves a CPU to spare)."""


class LoadAverage:
    """The machine's 1-minute load average, sampled every 5 s: the box shares its cores with
    whatever else runs, and every figure is read beside it."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.perf_counter(), os.getloadavg()[0]))
            self.stop.wait(5)

    def between(self, t0: float, t1: float) -> str:
        seen = [load for t, load in self.samples if t0 <= t <= t1] or [os.getloadavg()[0]]
        return f"{min(seen):.1f}-{max(seen):.1f}"


def with_needs(names: list[str], reuse: bool = False) -> list[str]:
    """`names` and what they need (`NEEDS`, transitively), each added one said in one line."""
    names = list(names)
    for name in names:  # grows while it is read: serve brings registry, which brings train-s3
        for part in name.split("+"):
            need = NEEDS.get(part)
            if need and need not in names and not (reuse and part == "serve"):
                print(f"{part} needs {need} of the same run: running it too", flush=True)
                names.append(need)
    return names


def batches(names: list[str], serial: bool) -> list[list[str]]:
    """The scenarios to run, in order: `GROUPS` side by side (one at a time if `serial`, and
    serve and partition then each with its own cut)."""
    names = set(names)
    if {"serve", "partition"} <= names and not serial:
        names = (names - {"serve", "partition"}) | {"serve+partition"}
    groups = [[p for n in g for p in (n.split("+") if n not in names else [n])] for g in GROUPS]
    chosen = [[n for n in group if n in names] for group in groups]
    chosen = [group for group in chosen if group]
    return [[n] for group in chosen for n in group] if serial else chosen


def run_one(box: Box, name: str, load: LoadAverage) -> tuple:
    t0 = time.perf_counter()
    try:
        figures, verdict = SCENARIOS[name](box), "PASS"
    except Exception as err:  # an assertion, or the scenario's own failure
        traceback.print_exc()  # where it failed, above the table's one-line reason
        figures, verdict = {"why": f"{type(err).__name__}: {str(err)[:500]}"}, "FAIL"
    t1 = time.perf_counter()
    print(f"{name}: {verdict} in {t1 - t0:.0f} s {json.dumps(figures)}", flush=True)
    return name, verdict, t1 - t0, load.between(t0, t1), figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the cluster box's scenarios")
    parser.add_argument(
        "--only", nargs="+", choices=list(SCENARIOS), help="run these and what they need"
    )
    parser.add_argument("--keep", action="store_true", help="leave the box up afterwards")
    parser.add_argument(
        "--full", action="store_true", help="the S3 sweep runs all three sizes of the tiny preset"
    )
    parser.add_argument(
        "--reuse", action="store_true", help="run on the box that is up (box.py up) and keep it"
    )
    parser.add_argument(
        "--serial", action="store_true", help="one scenario at a time (each one's own time)"
    )
    parser.add_argument("--root", default=ROOT, help=f"the box's folder ({ROOT})")
    args = parser.parse_args(argv)
    global FULL, REFERENCE
    FULL = args.full
    reason = missing()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    every = [n for n in SCENARIOS if "+" not in n]
    order = batches(with_needs(args.only, args.reuse) if args.only else every, args.serial)
    load = LoadAverage()
    started = time.perf_counter()
    box = Box.load(Path(args.root)) if args.reuse else Box(Path(args.root)).up()
    up_row = ("box up", "", time.perf_counter() - started,
              load.between(started, time.perf_counter()), {})  # fmt: skip
    results = [] if args.reuse else [up_row]
    args.keep = args.keep or args.reuse
    try:
        for i, batch in enumerate(order):
            if i + 1 < len(order) and any("partition" in n for n in order[i + 1]):
                REFERENCE = start_reference()
            with ThreadPoolExecutor(len(batch)) as pool:
                results += pool.map(lambda name: run_one(box, name, load), batch)
    finally:
        if not args.keep:
            box.down()
        if REFERENCE is not None and REFERENCE.poll() is None:  # partition failed before it
            REFERENCE.kill()
    total = time.perf_counter() - started
    print("\n| scenario | result | seconds | load average | figures |\n|---|---|---|---|---|")
    for name, verdict, seconds, during, figures in results:
        shown = ", ".join(f"{k} {v}" for k, v in figures.items())
        print(f"| {name} | {verdict} | {seconds:.0f} | {during} | {shown} |")
    scenarios = len(results) - (not args.reuse)
    print(f"\nbox up, {scenarios} scenario(s){'' if args.keep else ', down'}: {total:.0f} s "
          f"(load average {load.between(started, time.perf_counter())})")  # fmt: skip
    (Path(args.root) / "report.json").write_text(json.dumps(results, indent=1))
    return 1 if any(r[1] == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
