"""The 2-node scenario of tests/test_multinode.py, run in its own process (its own Ray
cluster: the test session's `ray_cluster` cannot share a process with a second one).

    python tests/multinode_scenario.py OUT_FOLDER   # prints one JSON line: what happened

A head and a second node, each declaring one CPU, are started with `ray.cluster_utils.Cluster`
(their own processes and ports; nothing else on the machine is touched). The workload runs 2 Ray
Train workers of one CPU each, so they must spread over both nodes, with its storage on a folder
both nodes see (one machine: one file system): `python sweeps/batch_size.py` cut to one trial
(2 workers, `sweep.max_failures` 1), with its own local MLflow server over the store named by
MLFLOW_TRACKING_URI.
Once the run's first checkpoint exists the second node is removed, which kills the worker on
it; a fresh node joins so the worker group can be placed again, and the run continues from its
last checkpoint. The node removal runs in this process's main thread (a `Cluster` node installs
signal handlers), the sweep in its own driver process (Tune installs signal handlers too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hlm_ray.tracking.server import free_port

CHECKPOINT_STEP = 8
MAX_STEPS = 48  # long enough after the first checkpoint to remove the node mid-run
WAIT_S = 300  # for the run after the node is gone; then the cluster is shut down, not orphaned
SWEEP_NAME = "bs-multinode"
SWEEP_VALUE, SWEEP_OBJECTIVE = 8, "vanilla"  # micro-batch 8 per worker, global batch 16
# The sweep's trial: the batch-size preset cut to one cell, logged at every step.
SWEEP_SETTINGS = [
    f"sweep.values=[{SWEEP_VALUE}]",
    f"sweep.objectives=[{SWEEP_OBJECTIVE}]",
    "sweep.workers_per_trial=2",
    "sweep.max_failures=1",
    f"optim.max_steps={MAX_STEPS}",
    f"run.checkpoint_every={CHECKPOINT_STEP}",
    f"run.eval_every={MAX_STEPS}",
    "run.log_every=1",
    "tokenizer.train_sample_bytes=300000",
]
# The worker nodes declare less memory than a trial's function asks for
# (`tune.trial.TRIAL_RESOURCES`), so the trial and its Train controller (Ray puts it on the
# trial's node) run on the head and the lost node holds only a Train worker. (A trial whose own
# node is lost is retried by Tune instead: not this scenario.)
WORKER_NODE = {"num_cpus": 1, "memory": 16 * 2**20}
HERE = Path(__file__).resolve().parent


def sweep_spec():
    """The scenario's one-trial sweep (the test builds its reference from it)."""
    import importlib.util

    from hlm_ray.tune.spec import get_sweep

    path = HERE.parent / "sweeps" / "batch_size.py"
    module_spec = importlib.util.spec_from_file_location("sweep_batch_size", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return get_sweep(module.PRESETS, "tiny", SWEEP_SETTINGS)


def _alive_actors() -> list:
    from ray.util.state import list_actors

    return list_actors(filters=[("state", "=", "ALIVE")], limit=1000)


def _count(class_part: str) -> int:
    """Actors of this class the cluster ever ran (dead ones included)."""
    from ray.util.state import list_actors

    return sum(class_part in a.class_name for a in list_actors(limit=1000))


def remove_second_node(cluster, second, node_args, run_dir, report: dict, running) -> None:
    """Wait until the 2 Train workers run (on which nodes) and the run folder (`run_dir()`, None
    until it exists) holds its first checkpoint; then remove the second node and add a fresh
    one. What it saw goes into `report`. Main thread only: a `Cluster` node sets signal
    handlers. `running()` is False once the workload has ended."""
    from hlm_ray.train import checkpoint as ckpt

    deadline = time.monotonic() + 240
    nodes_seen: set[str] = set()
    while time.monotonic() < deadline and running() and len(nodes_seen) < 2:
        try:
            for actor in _alive_actors():
                if "RayTrainWorker" in actor.class_name:
                    nodes_seen.add(actor.node_id)
        except Exception:  # the state API can be briefly unavailable on a loaded machine
            pass
        time.sleep(0.2)
    # Then the first checkpoint, watched closely: the node goes right after it.
    folder = None
    while time.monotonic() < deadline and running():
        folder = run_dir()
        steps = [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(folder)] if folder else []
        if CHECKPOINT_STEP in steps:
            time.sleep(0.5)  # Ray registers the checkpoint once it is copied
            break
        time.sleep(0.05)
    report["worker_nodes"] = len(nodes_seen)
    report["removed_at_checkpoints"] = (
        [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(folder)] if folder else []
    )
    # What ran on the node when it went (a sweep's trial actor, ImplicitFunc, may be there too).
    held = [a.class_name for a in _alive_actors() if a.node_id == second.node_id]
    report["removed_node_held"] = sorted(held)
    cluster.remove_node(second, allow_graceful=False)  # the node dies: its worker with it
    report["removed_after_s"] = time.perf_counter() - report["_started"]
    cluster.add_node(**node_args)  # capacity comes back: the group is placed again


def sweep_run_dir(out: Path) -> Path | None:
    """The trial's run folder (named from its trial id), once the trial has made it."""
    found = sorted((out / "runs" / "sweeps" / SWEEP_NAME / "trials").glob("*"))
    return found[0] if found else None


def start_sweep(out: Path) -> subprocess.Popen:
    """`python sweeps/batch_size.py` (its own driver process, as a user runs it) joined to this
    cluster through RAY_ADDRESS; its folder is OUT/runs/sweeps/<name>, its output OUT/sweep.log.
    """
    argv = ["--preset", "tiny", "--name", SWEEP_NAME]
    argv += [arg for item in SWEEP_SETTINGS for arg in ("--set", item)]
    log = open(out / "sweep.log", "w")  # noqa: SIM115 (the child writes it; closed with it)
    return subprocess.Popen(
        [sys.executable, str(HERE.parent / "sweeps" / "batch_size.py"), *argv],
        cwd=out,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def main(out: Path) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "gcs_server_port": free_port(),
            "include_dashboard": True,  # Train V2 cleans placement groups through it
            "dashboard_port": free_port(),
            "dashboard_agent_listen_port": free_port(),
        },
    )
    forget_address(cluster.address)
    try:
        return run(cluster, out, started)
    finally:  # this cluster only, whatever happened: no Ray process outlives the scenario
        ray.shutdown()
        cluster.shutdown()


def forget_address(address: str) -> None:
    """`Cluster` names itself in /tmp/ray/ray_current_cluster, where `ray.init()` without an
    address (a command run by a test on the suite's other worker) would join it: the scenario
    reaches its cluster by address alone, so the file goes (if it still names this cluster)."""
    from ray._private.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    if path.is_file() and path.read_text().strip() == address:
        path.unlink(missing_ok=True)


def run(cluster, out: Path, started: float) -> dict:
    import ray

    second = cluster.add_node(**WORKER_NODE)
    os.environ["RAY_ADDRESS"] = cluster.address  # the sweep joins this cluster
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "HLM_CACHE_DIR": os.environ["HLM_CACHE_DIR"]}}
    ray.init(address=cluster.address, runtime_env=env, log_to_driver=False)
    report: dict = {"nodes_at_start": len([n for n in ray.nodes() if n["Alive"]])}
    report["cluster_start_s"] = time.perf_counter() - started
    report["_started"] = started

    sweep = start_sweep(out)
    running, run_dir = (lambda: sweep.poll() is None), (lambda: sweep_run_dir(out))
    try:
        remove_second_node(cluster, second, WORKER_NODE, run_dir, report, running)
        limit = time.monotonic() + WAIT_S
        while running() and time.monotonic() < limit:
            time.sleep(0.2)
    finally:
        report["finished"] = not running()
        if sweep.poll() is None:
            sweep.kill()  # its watchdog stops its tracking server
    report["sweep_exit"] = sweep.wait()
    report["error"] = None if report["sweep_exit"] == 0 else "sweep exit status != 0"
    # Every RayTrainWorker this cluster ever ran: 2, plus 2 for each start of the group; every
    # TrainController: one per `trainer.fit()` (a retried sweep trial builds a new trainer).
    report["train_workers_started"] = _count("RayTrainWorker")
    report["train_controllers_started"] = _count("TrainController")
    report["seconds"] = time.perf_counter() - started
    del report["_started"]
    return report


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
