"""The 2-node scenario of tests/test_multinode.py, run in its own process (its own Ray cluster:
the test session's `ray_cluster` cannot share a process with a second one).

    python tests/multinode_scenario.py OUT_FOLDER     # prints one JSON line: what happened

A head and a second node, each declaring one CPU, are started with `ray.cluster_utils.Cluster`
(their own processes and ports; nothing else on the machine is touched). `hlm train
--num-workers 2` is launched with one CPU per worker, so its workers must spread over both nodes,
and its storage on a folder both nodes see (one machine: one file system). Once the first
checkpoint exists the second node is removed, which kills the worker on it; a fresh node joins so
the worker group can be placed again, and the run continues from its last checkpoint
(`--max-failures`).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

CHECKPOINT_STEP = 8
MAX_STEPS = 48  # long enough after the first checkpoint to remove the node mid-run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out: Path) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    sys.path.insert(0, str(Path(__file__).parent))
    from test_ray_train import cfg_for

    from hlm_ray.train import checkpoint as ckpt
    from hlm_ray.train.launch import launch

    started = time.perf_counter()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "gcs_server_port": _free_port(),
            "include_dashboard": True,  # Train V2 cleans placement groups through it
            "dashboard_port": _free_port(),
            "dashboard_agent_listen_port": _free_port(),
        },
    )
    second = cluster.add_node(num_cpus=1)
    os.environ["RAY_ADDRESS"] = cluster.address  # `launch` joins this cluster
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "HLM_CACHE_DIR": os.environ["HLM_CACHE_DIR"]}}
    ray.init(address=cluster.address, runtime_env=env, log_to_driver=False)
    report: dict = {"nodes_at_start": len([n for n in ray.nodes() if n["Alive"]])}
    report["cluster_start_s"] = time.perf_counter() - started

    run_dir = out / "run"
    cfg = cfg_for(
        run_dir, **{"optim.max_steps": MAX_STEPS, "run.checkpoint_every": CHECKPOINT_STEP}
    )
    outcome: dict = {}

    def train():
        try:
            outcome["summary"] = launch(
                cfg,
                num_workers=2,
                cpus_per_worker=1,
                max_failures=2,
                storage_path=str(out),  # seen by both nodes: checkpoints in run_dir
                experiment="test-multinode",
            )
        except BaseException as err:  # reported, not raised: the main thread decides
            outcome["error"] = f"{type(err).__name__}: {err}"

    thread = threading.Thread(target=train)
    thread.start()
    # Which nodes the workers run on: read from Ray's state API while the run is alive.
    deadline = time.monotonic() + 240
    nodes_seen: set[str] = set()
    while time.monotonic() < deadline and thread.is_alive() and len(nodes_seen) < 2:
        try:
            from ray.util.state import list_actors

            for actor in list_actors(filters=[("state", "=", "ALIVE")]):
                if "RayTrainWorker" in actor.class_name:
                    nodes_seen.add(actor.node_id)
        except Exception:
            pass
        time.sleep(0.2)
    # Then the first checkpoint, watched closely: the node goes right after it.
    while time.monotonic() < deadline and thread.is_alive():
        if CHECKPOINT_STEP in [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(run_dir)]:
            time.sleep(0.5)  # Ray registers the checkpoint once it is copied
            break
        time.sleep(0.05)
    report["worker_nodes"] = len(nodes_seen)
    report["removed_at_checkpoints"] = [
        ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(run_dir)
    ]
    cluster.remove_node(second, allow_graceful=False)  # the node dies: its worker with it
    report["removed_after_s"] = time.perf_counter() - started
    cluster.add_node(num_cpus=1)  # capacity comes back: the group is placed again
    thread.join(timeout=300)
    report["finished"] = not thread.is_alive()
    report["error"] = outcome.get("error")
    report["steps"] = (outcome.get("summary") or {}).get("steps")
    from ray.util.state import list_actors

    # Every RayTrainWorker this cluster ever ran: 2, plus 2 for each restart of the group.
    report["train_workers_started"] = sum(
        "RayTrainWorker" in a.class_name for a in list_actors(limit=1000)
    )
    report["seconds"] = time.perf_counter() - started
    ray.shutdown()
    cluster.shutdown()
    return report


if __name__ == "__main__":
    result = main(Path(sys.argv[1]))
    print(json.dumps(result))
