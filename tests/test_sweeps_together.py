"""Two sweeps started at once from one folder, as two processes: each on a local Ray cluster of
its own (RAY_ADDRESS=local: never the test session's cluster nor another one on this machine),
both into one MLflow store. Neither may trip over the other cluster: Ray Train's placement-group
cleaner once looked for "the" local cluster, found several, and logged a traceback every few
seconds. The two are the pretraining-only scripts (negatives, temperature), so this is also
their end-to-end test: each trial carries its value of the axis (test_sweeps.py runs the vocab
and batch-size scripts end to end on the session's cluster).

One of them also meets Ctrl-C from outside, as a terminal sends it to the whole process group,
once its trial has written a checkpoint: it stops its runs, leaves no process behind, and the
command it prints continues it (beside the other sweep, still running) to the end."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from sweep_common import (
    FAST,
    ROOT,
    check_trials_carry_their_values,
    descendants,
    load_script,
    set_args,
    still_running,
    sweep_runs,
)

from hlm_ray.tune.spec import get_sweep

# One trial each (one value, not the base config's, so that a value lost on its way to the
# trial shows; headless: neither axis enters a vanilla loss), no downstream step.
CHEAP = [*FAST, "sweep.objectives=[headless]", "sweep.recipe=none"]
SWEEPS = {
    "negatives": ["sweep.values=[64]", "sweep.workers_per_trial=1"],  # own: every target
    # The base config's τ is 1. 100 steps, a checkpoint every 20: still training when Ctrl-C
    # arrives after its first checkpoint.
    "temperature": [
        "sweep.values=[0.1]",
        "optim.max_steps=100",
        "run.checkpoint_every=20",
        "run.eval_every=100",
    ],
}
INTERRUPTED = "temperature"


# Ray Train's controller logs this warning, with a traceback, when the autoscaling coordinator
# does not answer within 5 s (ray/train/v2/.../autoscaling_coordinator_client.py); the message
# itself says it is safe to ignore when the CPU is overloaded, as two clusters on 2 cores are.
TRANSIENT_RAY_WARNINGS = ("Failed to send resource request for train-",)


def unexpected_tracebacks(log: str) -> list[str]:
    """The lines that open a traceback in `log`, except the one right after a warning of Ray's
    that says it is transient and safe to ignore."""
    lines = log.splitlines()
    return [
        line
        for i, line in enumerate(lines)
        if "Traceback (most recent call last)" in line
        and not (i and any(w in lines[i - 1] for w in TRANSIENT_RAY_WARNINGS))
    ]


def test_the_traceback_check_passes_only_ray_s_transient_warning():
    transient = (
        "(TrainController pid=7) Failed to send resource request for train-9a. If this only"
        " happens transiently ..., it's safe to ignore this error.\n"
        "(TrainController pid=7) Traceback (most recent call last):\n"
        "(TrainController pid=7) ray.exceptions.GetTimeoutError: Get timed out\n"
    )
    assert unexpected_tracebacks(transient) == []
    cleaner = (
        "(pid=8) Found multiple active Ray instances\n(pid=8) Traceback (most recent call last):\n"
    )
    assert unexpected_tracebacks(transient + cleaner) == [
        "(pid=8) Traceback (most recent call last):"
    ]
    assert len(unexpected_tracebacks("Traceback (most recent call last):\n  File x\n")) == 1


def argv_of(kind: str) -> list[str]:
    return ["--preset", "tiny", "--name", f"{kind}-together", *set_args([*CHEAP, *SWEEPS[kind]])]


@pytest.mark.ray
@pytest.mark.slow
def test_two_sweeps_at_once_one_interrupted_and_continued(tmp_path):
    # No store yet, as in a fresh clone: the first tracking server creates it while the other
    # waits (two migrating one new sqlite file at once failed: "table ... already exists").
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "RAY_ADDRESS": "local",
        "MLFLOW_TRACKING_URI": uri,
        "HLM_MLFLOW_DIR": str(tmp_path),
        "HLM_CACHE_DIR": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
    }

    def start(kind: str, argv: list[str], log: str) -> subprocess.Popen:
        with (tmp_path / log).open("w") as out:
            return subprocess.Popen(
                [sys.executable, str(ROOT / "sweeps" / f"{kind}.py"), *argv],
                cwd=tmp_path,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, as a terminal starts it
            )

    drivers = {kind: start(kind, argv_of(kind), f"{kind}.log") for kind in SWEEPS}
    seen: dict[int, tuple[str, str]] = {}  # every process any driver started
    cut: dict[int, tuple[str, str]] = {}  # the interrupted driver's
    trials = tmp_path / "runs" / "sweeps" / f"{INTERRUPTED}-together" / "trials"
    try:
        # Ctrl-C on one sweep once its trial has a checkpoint, the other one running on.
        deadline = time.monotonic() + 300
        while not list(trials.glob("*/checkpoint_00000020/hlm_checkpoint.json")):
            assert drivers[INTERRUPTED].poll() is None, (
                tmp_path / f"{INTERRUPTED}.log"
            ).read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            cut.update(descendants(drivers[INTERRUPTED].pid))
            for kind, driver in drivers.items():
                if kind != INTERRUPTED:
                    seen.update(descendants(driver.pid))
            time.sleep(0.5)
        cut.update(descendants(drivers[INTERRUPTED].pid))
        os.killpg(drivers[INTERRUPTED].pid, signal.SIGINT)  # Ctrl-C: the whole group
        code = drivers[INTERRUPTED].wait(timeout=120)
        text = (tmp_path / f"{INTERRUPTED}.log").read_text()
        assert code == 130, text[-3000:]
        assert "1 unfinished trial(s) stopped and marked KILLED" in text
        command = text.split("continue with: ")[-1].splitlines()[0]
        script = f"sweeps/{INTERRUPTED}.py"
        assert command == shlex.join(["python", script, *argv_of(INTERRUPTED)])
        # No process of that driver survives it: its tracking server (under its watchdog, in a
        # group of its own), its Ray cluster (GCS, raylet, dashboard, workers).
        commands = [cmd for _, cmd in cut.values()]
        assert any(" mlflow server " in c for c in commands), commands
        assert any("raylet" in c for c in commands), commands
        deadline = time.monotonic() + 30
        while (left := still_running(cut)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, left
        _, (parent,), (child,) = sweep_runs(uri, f"{INTERRUPTED}-together")
        assert (parent.info.status, child.info.status) == ("KILLED", "KILLED")
        seen.update(cut)

        # The printed command continues it, beside the other sweep.
        drivers[INTERRUPTED] = start(INTERRUPTED, shlex.split(command)[2:], "continued.log")
        deadline = time.monotonic() + 600
        while any(d.poll() is None for d in drivers.values()):
            assert time.monotonic() < deadline, "the sweeps did not finish in 600 s"
            for driver in drivers.values():
                seen.update(descendants(driver.pid))
            time.sleep(0.5)
        logs = {kind: (tmp_path / f"{kind}.log").read_text() for kind in SWEEPS}
        logs[INTERRUPTED] = (tmp_path / "continued.log").read_text()
        for kind, driver in drivers.items():
            assert driver.returncode == 0, logs[kind][-3000:]
            assert not unexpected_tracebacks(logs[kind]), logs[kind][-3000:]
            assert "Found multiple active Ray instances" not in logs[kind]
        # Three clusters: each driver started its own raylet, the continued one too.
        raylets = [cmd for _, cmd in seen.values() if "raylet" in cmd.split(" ")[0]]
        assert len(raylets) == 3, raylets
        # Nothing any driver started outlives it (Ray's processes, the tracking servers).
        deadline = time.monotonic() + 30
        while (left := still_running(seen)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, left
    finally:
        for driver in drivers.values():
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
                driver.wait()
        for pid in still_running({**seen, **cut}):  # a failed test leaves nothing behind
            os.kill(pid, signal.SIGKILL)

    for kind, items in SWEEPS.items():  # both in the one store, each parent run with its trial
        name = f"{kind}-together"
        client, parents, children = sweep_runs(uri, name)
        assert [p.info.status for p in parents] == ["FINISHED"]
        assert [c.data.tags["mlflow.parentRunId"] for c in children] == [parents[0].info.run_id]
        assert children[0].info.status == "FINISHED"
        folder = tmp_path / "runs" / "sweeps" / name
        presets = load_script(ROOT / "sweeps" / f"{kind}.py").PRESETS
        spec = get_sweep(presets, "tiny", [*CHEAP, *items])
        (row,) = check_trials_carry_their_values(folder, spec, uri, name)
        assert row["status"] == "FINISHED" and float(row["loss"]) > 0
        assert row["downstream/score"] == ""  # sweep.recipe=none: not run
        assert not (folder / "trials" / row["run"] / "downstream").exists()
    # The continued trial resumed from its checkpoint in the runs Ctrl-C had closed, and
    # finished: no step logged twice.
    client, (again,), (trial_run,) = sweep_runs(uri, f"{INTERRUPTED}-together")
    assert (again.info.run_id, trial_run.info.run_id) == (parent.info.run_id, child.info.run_id)
    (run_dir,) = trials.iterdir()
    steps = [json.loads(line).get("step") for line in (run_dir / "metrics.jsonl").open()]
    assert 100 in steps
    losses = client.get_metric_history(child.info.run_id, "train/loss")
    assert len({m.step for m in losses}) == len(losses)
