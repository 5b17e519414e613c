"""Ctrl-C on a real sweep, from outside (issue 14): `python sweeps/vocab.py` as a subprocess in
its own process group, on its own local Ray cluster (RAY_ADDRESS=local: never the test
session's cluster or another one on this machine), interrupted once its trial has written a
checkpoint, then continued with the command it printed."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sweep_common import ROOT, descendants, still_running

NAME = "ctrl-c-e2e"
# One trial (1 vocabulary × 1 objective); 100 steps so that it is still training when the
# signal arrives after its first checkpoint (step 20).
SWEEP_ARGS = [
    "--set",
    "sweep.values=[512]",
    "--set",
    "sweep.objectives=[headless]",
    "--set",
    "optim.max_steps=100",
]


def sweep_env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "RAY_ADDRESS": "local",  # its own cluster, stopped when the driver exits
        "HLM_CACHE_DIR": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
    }


@pytest.mark.slow  # a real sweep, interrupted then continued: 95-170 s on 2 busy cores
def test_ctrl_c_on_a_real_sweep_kills_its_runs_leaves_no_process_and_continues(
    tmp_path, mlflow_store
):
    from mlflow import MlflowClient

    env = sweep_env(tmp_path)
    log = tmp_path / "sweep.log"
    with log.open("w") as out:
        driver = subprocess.Popen(
            [sys.executable, str(ROOT / "sweeps" / "vocab.py"), *SWEEP_ARGS, "--name", NAME],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal would start it
        )
    trials = tmp_path / "runs" / "sweeps" / NAME / "trials"
    seen: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + 300
    try:
        while not list(trials.glob("*/checkpoint_00000020/hlm_checkpoint.json")):
            assert driver.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            seen.update(descendants(driver.pid))
            time.sleep(0.5)
        seen.update(descendants(driver.pid))
        os.killpg(driver.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole group
        code = driver.wait(timeout=120)
        text = log.read_text()
        assert code == 130, text[-3000:]
        assert "1 unfinished trial(s) stopped and marked KILLED" in text
        command = text.split("continue with: ")[-1].splitlines()[0]
        assert command == shlex.join(["python", "sweeps/vocab.py", *SWEEP_ARGS, "--name", NAME])

        # No process of the driver survives it: its tracking server (under its watchdog, in a
        # group of its own), its Ray cluster (GCS, raylet, dashboard, workers).
        commands = [cmd for _, cmd in seen.values()]
        assert any(" mlflow server " in c for c in commands), commands
        assert any("raylet" in c for c in commands), commands
        deadline = time.monotonic() + 30
        while (left := still_running(seen)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, left
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        for pid in still_running(seen):  # a failed test leaves nothing behind
            os.kill(pid, signal.SIGKILL)

    client = MlflowClient(mlflow_store)
    (parent,) = client.search_runs(
        [client.get_experiment_by_name("hlm_ray-sweeps").experiment_id],
        filter_string=f"tags.sweep = '{NAME}' and tags.sweep_role = 'parent'",
    )
    (child,) = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
    )
    assert (parent.info.status, child.info.status) == ("KILLED", "KILLED")

    # The printed command continues the sweep: the trial resumes from its checkpoint, in the
    # same MLflow run, and finishes.
    cont = subprocess.run(
        [sys.executable, str(ROOT / "sweeps" / "vocab.py"), *shlex.split(command)[2:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cont.returncode == 0, (cont.stdout + cont.stderr)[-3000:]
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
    assert client.get_run(child.info.run_id).info.status == "FINISHED"
    (run_dir,) = trials.iterdir()
    steps = [json.loads(line).get("step") for line in (run_dir / "metrics.jsonl").open()]
    assert 100 in steps
    losses = client.get_metric_history(child.info.run_id, "train/loss")
    assert len({m.step for m in losses}) == len(losses)  # no step logged twice
