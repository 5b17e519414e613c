"""The cluster box's scenarios of nodes cut off (their link down): a sweep trial's node after
its first checkpoint (`partition`, its losses compared with an undisturbed run's computed on
the machine), a serving replica's node under a stream of requests (`serve`), and both on one
node, as a real node goes (`serve_and_partition`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from box import CHECKOUT, HEAD_CLIENT_IP, PORTS, WORKERS, Box, last_json
from client import (
    S3_SWEEPS,
    SWEEP_EXPERIMENT,
    TAG,
    node_of,
    submit,
    view,
    wait_job,
    wait_log,
    worker_ips,
)

HERE = Path(__file__).resolve().parent
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
    try:
        cut_at, declared_dead_s = cut_until_dead(box, rank0, watch)
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


def cut_until_dead(box: Box, ip: str, watch) -> tuple[float, float]:
    """The node at `ip` cut off (its link down) while `watch` (`box.watch_nodes(gone=ip)`,
    connected) times it: the cut's time.time(), and the seconds until the head declared the
    node dead."""
    box.cut(node_of(box, ip))
    cut_at = time.time()
    seen = watch.result()
    assert ip not in seen["addresses"], f"{ip} still alive {watch.timeout_s:.0f} s after its cut"
    return cut_at, seen["at"] - cut_at


def start_reference() -> subprocess.Popen:
    """`undisturbed_losses()` in a process of its own, on the checkout under test (not on
    whatever checkout the environment's hlm_ray was installed from): the partition's
    reference, computed while the cluster works; `reference_losses` reads it."""
    code = "import json, cuts; print(json.dumps(cuts.undisturbed_losses()))"
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


def serve_and_partition(box: Box, reference: subprocess.Popen | None = None) -> dict:
    """One worker node lost while it holds a serving replica and a sweep trial, as a real
    node goes: `partition` with the requests of `serve` going out across its cut."""
    serving = serve_up(box)
    return partition(box, reference, serving)


LOAD_S = 60.0
"""How long the requests go out: from before the cut (in `partition`, from when the trial's
worker started, a few seconds before its first checkpoint) past Ray declaring the node dead
(about 15 s after the cut) and the other replica taking them all."""
