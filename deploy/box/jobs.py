"""The cluster box's scenarios of jobs as users run them: `hlm train` across the worker nodes,
the sweeps (their state on the shared volume or in S3, a resubmitted one), a fine-tune
registered on the cluster and loaded on the client, and a run whose node loses the tracking
server for a minute. Each submits from the client and checks what MLflow and the Job API say,
raising `AssertionError` with what did not hold; it returns its figures.
"""

from __future__ import annotations

import re
import time

from box import PORTS, SHARED, WORKERS, Box
from client import (
    S3_RUNS,
    S3_SWEEPS,
    SWEEP_EXPERIMENT,
    TAG,
    TRAIN,
    VOCAB_SWEEP,
    complete_steps,
    node_of,
    one_run,
    prepared_on_node,
    submit,
    view,
    wait_job,
    wait_log,
    worker_ips,
)


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
