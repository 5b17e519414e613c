"""The cluster box's scenarios of what fails under a sweep's downstream step or a whole run:
the tracking server stopped while the trials score their models (`tracking_stop`), the node a
downstream step runs on cut off (`downstream_cut`), and the head's Ray killed under an
`hlm train` whose run is in S3, then started again on every node (`head_restart`). Each
checks, from the client, that nothing is lost and says how long the recovery took.
"""

from __future__ import annotations

import re
import signal
import sys
import time

from box import RUN_BUCKET, WORKERS, Box
from client import (
    S3_RUNS,
    S3_SWEEPS,
    SWEEP_EXPERIMENT,
    TAG,
    TRAIN,
    VOCAB_SWEEP,
    node_of,
    one_run,
    submit,
    view,
    wait_job,
    wait_log,
    worker_ips,
)
from cuts import cut_until_dead

WAIT_STORED = """
import sys, time, boto3
bucket, key, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
s3, deadline = boto3.client("s3"), time.monotonic() + timeout_s
while not s3.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount"):
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(1)
"""


def wait_stored(box: Box, key: str, timeout_s: float = 600) -> None:
    """Until `s3://hlm-runs/<key>` exists, asked from the head node (one process polling)."""
    argv = [sys.executable, "-c", WAIT_STORED, RUN_BUCKET, key, str(timeout_s)]
    done = box.run("head", argv, timeout=timeout_s + 120)
    assert done.returncode == 0, f"no {key} in s3://{RUN_BUCKET} after {timeout_s:.0f} s"


DOWNSTREAM = r"(\S+): downstream step on node (\S+)"
"""What a trial's downstream step says as it starts: the trial's run, the node's address."""


def small_sweep(name: str, *settings: str) -> list[str]:
    """The tiny vocabulary sweep at its 1k size, each trial's worker and downstream step a
    whole worker node, its state and trials in S3."""
    argv = [*VOCAB_SWEEP, "--name", name, "--storage-path", S3_SWEEPS,
            "--set", "sweep.cpus_per_worker=2", "--set", "sweep.values=[1024]"]  # fmt: skip
    return [*argv, *(a for s in settings for a in ("--set", s))]


def scored_children(box: Box, name: str, trials: int) -> list[dict]:
    """The sweep's parent and children closed (FINISHED), each child with its downstream
    scores in MLflow; the children."""
    runs = view(box, "sweep", SWEEP_EXPERIMENT, name)
    parents = [r for r in runs if r["tags"].get("sweep_role") == "parent"]
    children = [r for r in runs if r["tags"].get("sweep_role") != "parent"]
    assert len(parents) == 1 and len(children) == trials, (len(parents), len(children))
    assert parents[0]["status"] == "FINISHED", f"the parent run is {parents[0]['status']}"
    for child in children:
        assert child["status"] == "FINISHED", (child["name"], child["status"])
        scores = sorted(k for k in child["metrics"] if k.startswith(("downstream/", "lambada/")))
        assert "downstream/score" in scores, f"{child['name']} has no downstream scores: {child}"
    return children


def tracking_stop(box: Box) -> dict:
    """The tracking server stopped (SIGSTOP: it takes connections and never answers) as the
    first trial starts its downstream step, until the sweep has ended, then killed and started
    again on its store: the sweep's end says in one line what finishes its records, and that
    command, `hlm sync runs/sweeps/<name>` submitted from the client, leaves every run closed
    and every child with its downstream scores in MLflow (before: the steps' scores were lost,
    and the parent stayed RUNNING with only its plan)."""
    name = f"vocab-box-stop-{TAG}"
    submit(box, small_sweep(name), job=name, wait=False)
    first = wait_log(box, name, DOWNSTREAM, timeout=900)
    box.signal_mlflow(signal.SIGSTOP)
    stopped_at = time.time()
    try:
        ended = wait_job(box, name)
    finally:
        box.restart_mlflow()
    stopped_s = time.time() - stopped_at
    assert ended["status"] == "SUCCEEDED", ended["logs"][-3000:]
    named = re.search(r"or `(hlm sync \S+)`", ended["logs"])
    assert named, "the sweep's end did not say what sends its records"
    assert named.group(1) == f"hlm sync runs/sweeps/{name}", named.group(1)
    started = time.perf_counter()
    said = submit(box, named.group(1).split(), job=f"{name}-sync")
    synced = re.search(r"synced sweep \S+ to MLflow: (\d+) metric point\(s\) of (\d+) trial", said)
    assert synced, said[-2000:]
    children = scored_children(box, name, trials=2)
    return {"stopped_s": round(stopped_s), "stopped_at_downstream_of": first.group(1),
            "sync_job_s": round(time.perf_counter() - started),
            "points_sent": int(synced.group(1)), "children_scored": len(children)}  # fmt: skip


def downstream_cut(box: Box) -> dict:
    """The node a sweep trial's downstream step runs on cut off (link down) in the middle of
    it: the head declares the node dead, the step runs again on the node left, and the sweep
    finishes without a resubmit (before: the step was never retried, the trial RUNNING with
    no CPU used, for good). One headless trial: its step fine-tunes a generator first."""
    name = f"vocab-box-dcut-{TAG}"
    submit(box, small_sweep(name, "sweep.objectives=[headless]"), job=name, wait=False)
    first = wait_log(box, name, DOWNSTREAM, timeout=900)
    ip = first.group(2)
    lost = node_of(box, ip)
    watch = box.watch_nodes(gone=ip, timeout_s=180).ready()
    try:
        cut_at, declared_dead_s = cut_until_dead(box, ip, watch)
        ended = wait_job(box, name, timeout=900)
        finished_s = time.time() - cut_at
    finally:  # the node back, whatever happened: the next scenario needs it
        box.mend(lost)
        box.rejoin(lost, 1 + len(WORKERS), wait=False)
    try:
        assert ended["status"] == "SUCCEEDED", ended["logs"][-3000:]
        again = [m.group(2) for m in re.finditer(DOWNSTREAM, ended["logs"])]
        assert len(again) >= 2 and again[-1] != ip, f"the step ran on {again}, cut {ip}"
        assert again[-1] in worker_ips(box), again
        scored_children(box, name, trials=1)
    finally:
        rejoined_s = box.wait_nodes(1 + len(WORKERS)) - cut_at
    return {"cut_node": ip, "declared_dead_s": round(declared_dead_s, 1),
            "step_again_on": again[-1], "job_ended_after_cut_s": round(finished_s),
            "rejoined_after_cut_s": round(rejoined_s)}  # fmt: skip


def head_restart(box: Box, steps: int = 30, every: int = 10) -> dict:
    """`hlm train` with its run in S3; after its first checkpoint the head's Ray is killed (its
    GCS, the job's driver with it: the head node lost), then Ray is started again on every
    node. The documented command, `hlm train --resume s3://hlm-runs/runs/<name>`, continues
    the run from its newest checkpoint in S3 to the end: one MLflow run, FINISHED, every step
    logged once, the model."""
    name = f"box-head-{TAG}"
    submit(box, [*TRAIN, "--num-workers", "2", "--cpus-per-worker", "2", "--output",
                 f"runs/{name}", "--storage-path", S3_RUNS, "--set", f"optim.max_steps={steps}",
                 "--set", f"run.checkpoint_every={every}"], job=name, wait=False)  # fmt: skip
    wait_stored(box, f"runs/{name}/checkpoint_{every:08d}/hlm_checkpoint.json")
    box.kill_ray("head")
    killed_at = time.time()
    box.start_ray("head")
    box.wait_head()
    for worker in WORKERS:  # their Ray lost its head: started again, as a node's would be
        box.rejoin(worker, 1 + len(WORKERS), wait=False)
    back_s = box.wait_nodes(1 + len(WORKERS)) - killed_at
    started = time.perf_counter()
    said = submit(box, ["hlm", "train", "--resume", f"{S3_RUNS}/{name}"], job=f"{name}-resumed")
    resumed_s = time.perf_counter() - started
    newest = re.search(
        rf"continuing {name} from its storage: \S+ \(newest checkpoint (\S+)\)", said
    )
    assert newest, said[-3000:]
    run = one_run(box, name)
    assert run["status"] == "FINISHED", run["status"]
    assert run["points"]["train/loss"] == steps, (
        f"{run['points']['train/loss']} points, {steps} steps"
    )
    assert run["steps"]["train/loss"] == list(range(1, steps + 1)), run["steps"]["train/loss"]
    assert "model" in run["artifacts"], run["artifacts"]
    return {"killed_after": f"checkpoint {every}", "cluster_back_s": round(back_s),
            "continued_from": newest.group(1), "resumed_job_s": round(resumed_s)}  # fmt: skip
