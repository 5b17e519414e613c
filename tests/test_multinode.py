"""A sweep trial that loses a Ray node: 2 workers spread over a 2-node cluster (started in its
own process by tests/multinode_scenario.py), the second node removed after the first
checkpoint. The trial finishes from that checkpoint as one child run of the sweep, in the
sweep's summary, with losses equal to an uninterrupted run's.

A trial trains through `hlm_ray.train.launch.launch`, the function `hlm train --num-workers N
--max-failures M` calls: the worker-group restart, the resume from the run folder and the one
MLflow run continued are the same code for a run outside a sweep."""

import csv
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


def scenario(out: Path) -> dict:
    """Run tests/multinode_scenario.py in its own process; its report."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "multinode_scenario.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_sweep_trial_survives_losing_a_node(tmp_path, mlflow_store, _hlm_cache_dir):
    from mlflow import MlflowClient
    from multinode_scenario import (
        CHECKPOINT_STEP,
        MAX_STEPS,
        SWEEP_NAME,
        SWEEP_OBJECTIVE,
        SWEEP_VALUE,
        sweep_run_dir,
        sweep_spec,
    )

    from hlm_ray.config import apply_overrides

    report = scenario(tmp_path)
    log = (tmp_path / "sweep.log").read_text() if (tmp_path / "sweep.log").exists() else ""
    assert report["nodes_at_start"] == 2
    assert report["worker_nodes"] == 2, report  # one worker per node: they had to spread
    # The lost node held a Train worker of the trial; the trial itself runs on the head.
    assert report["removed_node_held"] == ["RayTrainWorker"], report
    kept = report["removed_at_checkpoints"]
    assert kept[0] == CHECKPOINT_STEP and kept[-1] < MAX_STEPS, report  # the node went mid-run
    assert report["finished"] and report["sweep_exit"] == 0, (report, log[-3000:])
    # Train restarted the trial's worker group (its trainer, one controller, went on).
    assert report["train_workers_started"] >= 4, report
    assert report["train_controllers_started"] == 1, report

    # The sweep's summary has the trial, finished, with its downstream score.
    folder = tmp_path / "runs" / "sweeps" / SWEEP_NAME
    with open(folder / "summary.csv") as f:
        (row,) = list(csv.DictReader(f))
    run_dir = sweep_run_dir(tmp_path)
    assert row["status"] == "FINISHED" and row["run"] == run_dir.name, row
    assert row["downstream/score"] != "" and float(row["tokens_per_s"]) > 0, row

    # The losses after the restart equal an uninterrupted (single-process) run's, step by step.
    cell = sweep_spec().cell_config(SWEEP_VALUE, SWEEP_OBJECTIVE, 0)
    reference = apply_overrides(cell, {"run.output_dir": str(tmp_path / "bare")})
    train_worker(reference.to_dict(), progress=False)
    expected = {
        r["step"]: r["train/loss"] for r in read_metrics(tmp_path / "bare") if "train/loss" in r
    }
    got = {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}
    steps = list(range(1, MAX_STEPS + 1))
    assert sorted(got) == steps == sorted(expected)
    for step in steps:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step

    # One child run under the sweep's parent; every loss it logged (steps redone after the
    # restart are logged again) is the uninterrupted run's.
    client = MlflowClient(mlflow_store)
    experiment = client.get_experiment_by_name(sweep_spec().experiment)
    runs = client.search_runs([experiment.experiment_id], f"tags.sweep = '{SWEEP_NAME}'")
    (parent,) = [r for r in runs if r.data.tags.get("sweep_role") == "parent"]
    (child,) = [r for r in runs if r.data.tags.get("sweep_role") != "parent"]
    assert parent.info.status == "FINISHED" and child.info.status == "FINISHED"
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.data.tags["world_size"] == "2" and "downstream/score" in child.data.metrics
    history = client.get_metric_history(child.info.run_id, "train/loss")
    assert sorted({m.step for m in history}) == steps
    for m in history:
        assert m.value == pytest.approx(expected[m.step], rel=1e-4), m.step
    assert "summary.csv" in {a.path for a in client.list_artifacts(parent.info.run_id)}
