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

Each scenario is a function of the box that raises `AssertionError` naming what did not hold
and returns its figures; `tests/test_cluster_box.py` runs two of them in `make test`. The
scenarios run in `GROUPS`, side by side within a group, and the table gives each one's wall time
with the machine's load average while it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from box import (  # noqa: E402
    CHECKOUT,
    HEAD_CLIENT_IP,
    PORTS,
    RUN_BUCKET,
    SHARED,
    WORKERS,
    Box,
    last_json,
    missing,
)

ENDED = ("SUCCEEDED", "FAILED", "STOPPED")  # a job's final states
EXPERIMENT = "hlm_ray"  # `hlm train`'s
SWEEP_EXPERIMENT = "hlm_ray-sweeps"  # every sweep's (SweepSpec.experiment)
TRAIN = ["hlm", "train", "--preset", "tiny-decoder", "--set", "run.log_every=1"]
VOCAB_SWEEP = ["python", "sweeps/vocab.py", "--preset", "tiny"]
# The partition's sweep: the batch-size preset cut to one trial of one worker, a checkpoint
# every 8 of 48 steps (tests/multinode_scenario.py's, on one worker: it restarts on the node left),
# pretraining only: what the cut can change is the pretraining's loss history, and the sweeps
# above show the downstream step on the cluster.
CUT_VALUE, CUT_OBJECTIVE, CUT_STEPS, CUT_EVERY = 8, "vanilla", 48, 8
CUT_SETTINGS = [
    f"sweep.values=[{CUT_VALUE}]",
    f"sweep.objectives=[{CUT_OBJECTIVE}]",
    "sweep.workers_per_trial=1",
    "sweep.max_failures=2",
    f"optim.max_steps={CUT_STEPS}",
    f"run.checkpoint_every={CUT_EVERY}",
    f"run.eval_every={CUT_STEPS}",
    "run.log_every=1",
    "tokenizer.train_sample_bytes=300000",
    "sweep.recipe=none",
]
S3_RUNS = f"s3://{RUN_BUCKET}/runs"
TAG = time.strftime("%H%M%S")
"""In every run, sweep and job name: scenarios run again on a box that is up (`--reuse`) make
new ones (Ray refuses a job id twice; `hlm train` an output folder that exists)."""
S3_SWEEPS = f"s3://{RUN_BUCKET}/sweeps"
FULL = False  # --full: the S3 sweep runs the whole tiny preset (six trials, not two)


# ------------------------------------------------------------------------ the client's tools


def submit(box: Box, argv: list[str], *, job: str, env: dict | None = None,
           wait: bool = True, timeout: float = 900) -> str:  # fmt: skip
    """`RAY_AUTH_MODE=token ray job submit --working-dir . -- argv` from the client; the job's
    output (waited for), or "" (`wait` False: follow it with `wait_log` and `wait_job`)."""
    cmd = ["ray", "job", "submit", "--submission-id", job, "--working-dir", "."]
    if env:
        cmd += ["--runtime-env-json", json.dumps({"env_vars": env})]
    if not wait:
        cmd.append("--no-wait")
    done = box.client([*cmd, "--", *argv], timeout=timeout)
    if wait:  # the CLI asks the Job API for the job's state once its logs end, and prints it
        said = done.stdout + done.stderr
        assert done.returncode == 0 and f"Job '{job}' succeeded" in said, (
            f"job {job} ({' '.join(argv)}) did not succeed: {said[-3000:]}"
        )
    return done.stdout


def wait_job(box: Box, job: str, timeout: float = 900) -> dict:
    """The job's end: {"status": ..., "logs": ...}."""
    state = view(box, "wait", job, "", str(timeout), timeout=timeout + 120)
    assert state["status"] in ENDED, f"job {job} still {state['status']} after {timeout:.0f} s"
    return state


def wait_log(box: Box, job: str, pattern: str, timeout: float = 600) -> re.Match:
    state = view(box, "wait", job, pattern, str(timeout), timeout=timeout + 120)
    found = re.search(pattern, state["logs"])
    if found:
        return found
    assert state["status"] not in ENDED, state["logs"][-3000:]
    raise AssertionError(f"job {job}: no {pattern!r} after {timeout:.0f} s")


def view(box: Box, *args: str, timeout: float = 300):
    """deploy/box/view.py from the client: what MLflow and the Job API hold."""
    done = box.client(["python", "deploy/box/view.py", *args], timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return last_json(done.stdout)


def one_run(box: Box, name: str) -> dict:
    found = view(box, "run", EXPERIMENT, name)
    assert len(found) == 1, f"{len(found)} MLflow runs named {name}"
    return found[0]


def worker_ips(box: Box) -> set[str]:
    return {box.nodes[name].ip for name in WORKERS}


def node_of(box: Box, ip: str) -> str:
    return next(name for name, node in box.nodes.items() if node.ip == ip)


def prepared_on_node(box: Box, name: str) -> list[str]:
    """The prepared corpora a node made in its own cache (not copies fetched from storage)."""
    done = box.run(name, ["sh", "-c", "ls $HOME/.cache/hlm_ray/prepared 2>/dev/null || true"])
    return [n for n in done.stdout.split() if n != "fetched"]


def complete_steps(run: dict, key: str, steps: int) -> None:
    got = run["steps"].get(key, [])
    assert got == list(range(1, steps + 1)), f"{run['name']}: {key} at {len(got)} of {steps} steps"


# ------------------------------------------------------------------------ scenarios


def train(box: Box, storage: str) -> dict:
    """`hlm train --num-workers 2`: a worker on each worker node, the run whole in MLflow."""
    name = f"box-train-{storage}-{TAG}"
    where = (["--output", f"{SHARED}/runs/{name}"] if storage == "shared"
             else ["--output", f"runs/{name}", "--storage-path", S3_RUNS])  # fmt: skip
    started = time.perf_counter()
    submit(box, [*TRAIN, "--num-workers", "2", "--cpus-per-worker", "2", *where, "--set",
                 "optim.max_steps=20", "--set", "run.checkpoint_every=10"], job=name)  # fmt: skip
    seconds = time.perf_counter() - started
    run = one_run(box, name)
    assert run["status"] == "FINISHED", run["status"]
    nodes = run["tags"].get("worker_nodes", "").split(",")
    assert sorted(nodes) == sorted(worker_ips(box)), f"workers on {nodes}, not one per node"
    complete_steps(run, "train/loss", 20)
    assert {"model", "config.yaml"} <= set(run["artifacts"]), run["artifacts"]
    opened = run["tags"]["data.prepared"]  # the driver's corpus, published in the storage
    assert opened.startswith(f"{SHARED}/runs/_prepared/" if storage == "shared"
                             else f"{S3_RUNS}/_prepared/"), opened  # fmt: skip
    rebuilt = {n: opened.rsplit("/", 1)[-1] in prepared_on_node(box, n) for n in WORKERS}
    assert not any(rebuilt.values()), f"worker nodes prepared the corpus again: {rebuilt}"
    return {"job_s": round(seconds), "worker_nodes": ",".join(nodes), "corpus": opened}


def sweep(box: Box, storage: str, full: bool = False) -> dict:
    """The tiny vocabulary sweep, its parent and children whole in MLflow; on S3, a second
    submission resumes it. Its 1k size alone (two trials, headless and vanilla) unless `full`
    (the preset's three sizes, six trials, on S3): what the box checks is where the state,
    trials and corpus go and that they come back, which two trials show as well as six."""
    name = f"vocab-box-{storage}-{TAG}"
    # A trial's worker takes a whole node, as `train`'s do: the two sweeps side by side run
    # two trials at a time on the two worker nodes, not four on two cores.
    argv = [*VOCAB_SWEEP, "--name", name, "--set", "sweep.cpus_per_worker=2"]
    env, trials = None, 6
    if storage == "shared":  # the sweep's folder on the volume every node mounts
        env = {"HLM_WORK_DIR": f"{SHARED}/hlm"}
    else:
        argv += ["--storage-path", S3_SWEEPS]
    if not (full and storage == "s3"):
        argv, trials = [*argv, "--set", "sweep.values=[1024]"], 2
    started = time.perf_counter()
    submit(box, argv, job=name, env=env)
    seconds = time.perf_counter() - started
    runs = view(box, "sweep", SWEEP_EXPERIMENT, name)
    parents = [r for r in runs if r["tags"].get("sweep_role") == "parent"]
    children = [r for r in runs if r["tags"].get("sweep_role") != "parent"]
    assert len(parents) == 1 and len(children) == trials, (len(parents), len(children))
    assert parents[0]["status"] == "FINISHED", parents[0]["status"]
    assert {"summary.csv", "report.md"} <= set(parents[0]["artifacts"]), parents[0]["artifacts"]
    assert any(a.endswith(".png") for a in parents[0]["artifacts"]), parents[0]["artifacts"]
    for child in children:
        assert child["status"] == "FINISHED", (child["name"], child["status"])
        assert "downstream/score" in child["metrics"] and "model" in child["artifacts"], child
        assert set(child["tags"]["worker_nodes"].split(",")) <= worker_ips(box), child["tags"]
    SUBMITTED[storage] = (name, argv, trials)  # for `sweep_resume`
    return {"job_s": round(seconds)}


def sweep_resume(box: Box) -> dict:
    """The S3 sweep (`sweep-s3`, run before) submitted again with the same command: it resumes
    from its state in the object store, and no trial runs again."""
    assert "s3" in SUBMITTED, "sweep-resume resubmits the sweep of sweep-s3: run that first"
    name, argv, trials = SUBMITTED["s3"]
    started = time.perf_counter()
    again = submit(box, argv, job=f"{name}-again")
    assert f"sweep {name}: resuming {trials} trial(s)" in again, again[-2000:]
    assert len(view(box, "sweep", SWEEP_EXPERIMENT, name)) == 1 + trials  # none ran again
    return {"resubmitted_s": round(time.perf_counter() - started), "trials": trials}


SUBMITTED: dict[str, tuple] = {}
"""Each sweep scenario's (name, command, trials), by storage."""


def registry(box: Box) -> dict:
    """A generator fine-tuned and registered on the cluster loads on the client."""
    out = submit(box, ["hlm", "finetune", "--task", "clm", "--model", f"runs/box-train-s3-{TAG}",
                       "--register", "hlm-box-generator", "--eval-limit", "20",
                       "--storage-path", S3_RUNS], job=f"box-registry-{TAG}")  # fmt: skip
    version = re.search(r"registered hlm-box-generator version (\d+)", out).group(1)
    # Its worker started from the driver's copy of the model in the run storage, not from a
    # path on the node that trained it (which the worker's node may not be).
    source = one_run(box, f"box-train-s3-{TAG}-clm")["params"]["init.model_dir"]
    assert source.startswith(f"{S3_RUNS}/_inputs/box-train-s3-{TAG}-model-"), source
    model = f"models:/hlm-box-generator/{version}"
    done = box.client(["hlm", "generate", "--model", model, "--max-tokens", "8",
                       "The history of"], timeout=300)  # fmt: skip
    assert done.returncode == 0 and "The history of" in done.stdout, done.stderr[-2000:]
    box.generator = model  # what `serve` serves
    return {"model": model, "source": source,
            "generated": done.stdout.strip().splitlines()[0][:60]}  # fmt: skip


def partition(box: Box, reference: subprocess.Popen | None = None,
              serving: Serving | None = None) -> dict:  # fmt: skip
    """A sweep trial's node cut off mid-run: Ray declares it dead, the trial continues from its
    last checkpoint on the other node, its losses those of an undisturbed run (`reference`:
    that run, already started by `start_reference`; else it starts with the scenario, beside
    the cluster's work). With `serving` (`serve_up`'s, a replica on each worker node), the
    same cut takes a replica: requests go out from just before the cut, and every one must be
    answered (`serve_result`)."""
    reference = reference or start_reference()
    name = f"box-cut-{TAG}"
    argv = ["python", "sweeps/batch_size.py", "--preset", "tiny", "--name", name,
            "--storage-path", S3_SWEEPS]  # fmt: skip
    argv += [a for item in CUT_SETTINGS for a in ("--set", item)]
    submit(box, argv, job=name, wait=False)
    rank0 = wait_log(box, name, r"workers on nodes: rank 0 (\S+)").group(1)
    watch = box.watch_nodes(gone=rank0, timeout_s=180)
    load = None
    if serving is not None:  # requests going out from before the cut to well after it
        load, load_at = serve_load(box, serving, LOAD_S), time.time()
    wait_log(box, name, rf"checkpoint_{CUT_EVERY:08d}")
    lost = node_of(box, rank0)
    watch.ready()  # connected before the cut: it sees the node go to a fifth of a second
    box.cut(lost)
    cut_at = time.time()
    try:
        seen = watch.result()
        assert rank0 not in seen["addresses"], f"{rank0} still alive 180 s after its cut"
        declared_dead_s = seen["at"] - cut_at
        ended = wait_job(box, name)
        finished_s = time.time() - cut_at
        served = {}
        if serving is not None:
            served = serve_result(serving, load, cut_after_s=cut_at - load_at)
            assert served["answered_after_dead"], "no request went out after the node was dead"
    finally:  # the node back, whatever happened: the next scenario needs it
        if serving is not None:
            box.client(["ray", "job", "stop", serving.job])
        box.mend(lost)
        box.rejoin(lost, 1 + len(WORKERS), wait=False)  # it joins while MLflow is read
    try:
        assert ended["status"] == "SUCCEEDED", ended["logs"][-3000:]
        runs = view(box, "sweep", SWEEP_EXPERIMENT, name, "train/loss")
        (child,) = [r for r in runs if r["tags"].get("sweep_role") != "parent"]
        assert child["status"] == "FINISHED", child["status"]
        now_on = child["tags"]["worker_nodes"]
        assert now_on != rank0 and now_on in worker_ips(box), (rank0, now_on)
        history = {int(k): v for k, v in child["history"].items()}
        expected = reference_losses(reference)
        assert sorted(history) == sorted(expected), (sorted(history), sorted(expected))
        worst = max(abs(history[s] - expected[s]) / abs(expected[s]) for s in expected)
        assert worst < 1e-4, f"losses differ from an undisturbed run's by up to {worst:.2e}"
    finally:
        rejoined_s = box.wait_nodes(1 + len(WORKERS)) - cut_at
    return {"cut_node": rank0, "declared_dead_s": round(declared_dead_s, 1),
            "job_ended_after_cut_s": round(finished_s), "continued_on": now_on,
            "max_rel_loss_diff": f"{worst:.1e}", "rejoined_after_cut_s": round(rejoined_s),
            **served}  # fmt: skip


def start_reference() -> subprocess.Popen:
    """`undisturbed_losses()` in a process of its own, on the checkout under test (not on
    whatever checkout the environment's hlm_ray was installed from): the partition's
    reference, computed while the cluster works; `reference_losses` reads it."""
    code = "import json, scenarios; print(json.dumps(scenarios.undisturbed_losses()))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHECKOUT), str(HERE)])}
    return subprocess.Popen([sys.executable, "-c", code], cwd=CHECKOUT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def reference_losses(reference: subprocess.Popen) -> dict[int, float]:
    out, err = reference.communicate(timeout=900)
    assert reference.returncode == 0, f"the undisturbed reference run failed: {err[-3000:]}"
    return {int(k): v for k, v in last_json(out, dict).items()}


def undisturbed_losses() -> dict[int, float]:
    """The partition trial's losses in one process, here: the reference."""
    import importlib.util
    import tempfile

    from hlm_ray.config import apply_overrides
    from hlm_ray.tracking import read_metrics
    from hlm_ray.train.loop import train_worker
    from hlm_ray.tune.spec import get_sweep

    path = CHECKOUT / "sweeps" / "batch_size.py"
    module_spec = importlib.util.spec_from_file_location("sweep_batch_size", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    cell = get_sweep(module.PRESETS, "tiny", CUT_SETTINGS).cell_config(CUT_VALUE, CUT_OBJECTIVE, 0)
    with tempfile.TemporaryDirectory() as out:
        train_worker(apply_overrides(cell, {"run.output_dir": out}).to_dict(), progress=False)
        return {r["step"]: r["train/loss"] for r in read_metrics(Path(out)) if "train/loss" in r}


def tracking_outage(box: Box, outage_s: float = 60) -> dict:
    """Rank 0's node cannot reach the tracking server for a minute (its packets dropped):
    training goes on, and MLflow ends with every logged step."""
    name, steps = f"box-outage-{TAG}", 400
    # Its worker fills its node (2 CPUs): the registry's, beside it, runs on the other one.
    submit(box, [*TRAIN, "--num-workers", "1", "--cpus-per-worker", "2", "--output",
                 f"runs/{name}", "--storage-path", S3_RUNS, "--set", f"optim.max_steps={steps}",
                 "--set", "run.log_every=5", "--set", "run.checkpoint_every=100"], job=name,
           wait=False)  # fmt: skip
    rank0 = wait_log(box, name, r"workers on nodes: rank 0 (\S+)").group(1)
    rule = box.drop_port_to(node_of(box, rank0), PORTS["mlflow"])
    try:
        time.sleep(outage_s)
    finally:
        box.restore(rule)
    ended = wait_job(box, name)
    said = ended["logs"]
    assert ended["status"] == "SUCCEEDED", said[-3000:]
    assert "MLflow tracking is off for the rest of this run" in said, "the outage was not felt"
    replayed = re.search(r"MLflow: replayed (\d+) metric point", said)
    assert replayed, "the driver replayed nothing at the end of the run"
    run = one_run(box, name)
    got = run["steps"].get("train/loss", [])
    assert got == list(range(5, steps + 1, 5)), f"train/loss at {len(got)} of {steps // 5} steps"
    return {"outage_s": outage_s, "rank0": rank0, "logged_steps": len(got),
            "replayed_points": int(replayed.group(1))}  # fmt: skip


@dataclass
class Serving:
    job: str
    url: str
    replicas: list[str]  # the node address of each replica


def serve_up(box: Box) -> Serving:
    """`hlm serve` with 2 replicas of half a CPU and an API key, asked from the client through
    the head; one replica on each worker node (Serve spreads them; checked, since a cut of a
    node without one would prove nothing)."""
    job = f"box-serve-{TAG}"
    model = getattr(box, "generator", "models:/hlm-box-generator/1")  # the registry scenario's
    submit(box, ["hlm", "serve", "--model", model, "--host", "0.0.0.0", "--replicas", "2",
                 "--num-cpus", "0.5"], job=job, env={"HLM_API_KEY": "box-key"},
           wait=False)  # fmt: skip
    wait_log(box, job, r"serving hlm-box-generator/")
    url = f"http://{HEAD_CLIENT_IP}:{PORTS['serve']}"
    probe = box.client(["python", "deploy/box/load.py", url, "box-key", "0"], timeout=120)
    assert last_json(probe.stdout)["unauthorized"] == 401, probe.stdout
    replicas = view(box, "actors", "ServeReplica")
    assert replicas == sorted(worker_ips(box)), f"replicas on {replicas}, not one per worker node"
    return Serving(job, url, replicas)


def serve_load(box: Box, serving: Serving, seconds: float) -> subprocess.Popen:
    """A keyed request every 0.5 s for `seconds`, from the client (deploy/box/load.py)."""
    return box.client_background(
        ["python", "deploy/box/load.py", serving.url, "box-key", str(seconds)]
    )


def serve_result(serving: Serving, load: subprocess.Popen, cut_after_s: float) -> dict:
    """Every request of `load` answered 200; how long the slowest (one in flight at the cut,
    `cut_after_s` into the load) waited, and how many went out after Ray declared the node
    dead (about 15 s after the cut), when only the other replica could answer them."""
    out, err = load.communicate(timeout=LOAD_S + 150)
    result = last_json(out)
    failed = [r for r in result["requests"] if r[1] != 200]
    assert not failed, f"{len(failed)} of {len(result['requests'])} requests failed: {failed[:5]}"
    return {"requests": len(result["requests"]), "failed": 0,
            "slowest_s": max(r[2] for r in result["requests"]),
            "answered_after_dead": sum(r[0] > cut_after_s + 20 for r in result["requests"]),
            "replicas_on": ",".join(serving.replicas)}  # fmt: skip


def serve(box: Box) -> dict:
    """Alone (`--only serve`, `--serial`): one replica's node (w1) cut off 8 s into the
    requests; `serve_and_partition` makes the same cut take a sweep trial too."""
    serving = serve_up(box)
    load = serve_load(box, serving, LOAD_S)
    time.sleep(8)
    box.cut("w1")
    try:
        return serve_result(serving, load, cut_after_s=8)
    finally:
        box.client(["ray", "job", "stop", serving.job])
        box.mend("w1")
        box.rejoin("w1", 1 + len(WORKERS))


def serve_and_partition(box: Box) -> dict:
    """One worker node lost while it holds a serving replica and a sweep trial, as a real
    node goes: `partition` with the requests of `serve` going out across its cut."""
    serving = serve_up(box)
    return partition(box, REFERENCE, serving)


LOAD_S = 60.0
"""How long the requests go out: from before the cut (in `partition`, from when the trial's
worker started, a few seconds before its first checkpoint) past Ray declaring the node dead
(about 15 s after the cut) and the other replica taking them all."""


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
    "serve+partition": serve_and_partition,
}
GROUPS = [
    ("train-shared", "train-s3"),
    ("sweep-shared", "sweep-s3"),
    ("registry", "tracking-outage", "sweep-resume"),
    ("serve+partition",),
]
"""Scenarios that run side by side, as two users' jobs share a cluster: Ray queues what the two
worker nodes cannot hold at once, and each group ends before the next starts. What one needs of
another comes from an earlier group (train-s3's model for registry, registry's for serve). The
tracking outage cuts only its own node's tracking traffic, and its worker fills that node:
registry's runs on the other one (the resubmitted sweep runs no trial). Serve and partition
cut a node off, so nothing else runs meanwhile; together (`serve+partition`,
`serve_and_partition`) one cut takes a replica and the trial, as a real node goes; alone, or
`--serial`, each makes its own cut."""
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
    parser.add_argument("--root", default="/var/tmp/hlm-box", help="the box's folder")
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
