"""A run that loses a Ray node: 2 workers spread over a 2-node cluster (started in its own
process by tests/multinode_scenario.py), the second node removed after the first checkpoint.
The run finishes from that checkpoint as one MLflow run whose losses equal an uninterrupted
run's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hlm_ray.tracking import read_metrics
from hlm_ray.train.loop import train_worker

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HERE = Path(__file__).resolve().parent


def test_a_run_survives_losing_a_node(tmp_path, mlflow_store, _hlm_cache_dir):
    from mlflow import MlflowClient
    from test_ray_train import cfg_for

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "multinode_scenario.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["nodes_at_start"] == 2
    assert report["worker_nodes"] == 2, report  # one worker per node: they had to spread
    kept = report["removed_at_checkpoints"]
    assert kept[0] == 8 and kept[-1] < 48, report  # the node went mid-run
    assert report["finished"] and report["error"] is None and report["steps"] == 48, report
    assert report["train_workers_started"] >= 4, report  # the group was started again

    # The losses after the restart equal an uninterrupted (single-process) run's, step by step.
    reference = cfg_for(tmp_path / "bare", **{"optim.max_steps": 48, "run.checkpoint_every": 8})
    train_worker(reference.to_dict(), progress=False)
    expected = {
        r["step"]: r["train/loss"] for r in read_metrics(tmp_path / "bare") if "train/loss" in r
    }
    got = {r["step"]: r["train/loss"] for r in read_metrics(tmp_path / "run") if "train/loss" in r}
    assert sorted(got) == list(range(1, 49))
    for step in range(1, 49):
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step

    # One MLflow run, continued by the restarted worker group.
    client = MlflowClient(mlflow_store)
    experiment = client.get_experiment_by_name("test-multinode")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "2"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted({m.step for m in history}) == list(range(1, 49))
