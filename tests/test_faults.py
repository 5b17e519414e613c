"""Runs that survive their faults (issue 14), as plain functions: damaged and half-copied
checkpoints, Ctrl-C, a tracking outage, orphan processes, bad input. The Ray end-to-end ones are
in test_ray_train.py."""

import http.server
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from hlm_ray.cli import main
from hlm_ray.config import apply_overrides
from hlm_ray.errors import HLMError
from hlm_ray.paths import data_dir
from hlm_ray.presets import load_config
from hlm_ray.train import checkpoint as ckpt
from hlm_ray.train.ray_worker import choose_resume
from hlm_ray.train.resume import check_compatible, resumed_config

SHAKESPEARE = str(data_dir() / "corpus" / "en" / "tinyshakespeare.txt")


def fake_checkpoint(root, step, preset="tiny-decoder", weights=b"w" * 1000):
    """A checkpoint folder with the layout and manifest of a real one (no real weights)."""
    folder = root / f"checkpoint_{step:08d}"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "model.safetensors").write_bytes(weights)
    (folder / "train_state.pt").write_bytes(b"s" * 100)
    (folder / "config.yaml").write_text(load_config(preset).to_yaml())
    ckpt.write_manifest(folder, {"step": step})
    return folder


def test_the_manifest_catches_truncated_missing_and_changed_files(tmp_path):
    folder = fake_checkpoint(tmp_path, 10)
    assert ckpt.verify(folder) is None
    files = json.loads((folder / ckpt.MARKER).read_text())["files"]
    assert files["model/model.safetensors"]["size"] == 1000 and "sha256" in files["train_state.pt"]

    weights = folder / "model" / "model.safetensors"
    weights.write_bytes(b"w" * 10)
    assert "model/model.safetensors has 10 bytes" in ckpt.verify(folder)
    weights.write_bytes(b"x" * 1000)
    assert "checksum" in ckpt.verify(folder)
    weights.unlink()
    assert "missing" in ckpt.verify(folder)
    (folder / ckpt.MARKER).unlink()
    assert "no hlm_checkpoint.json" in ckpt.verify(folder)


def test_resume_falls_back_past_damaged_checkpoints_with_one_warning(tmp_path, caplog):
    fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 20)
    bad = fake_checkpoint(tmp_path, 30)
    (bad / "train_state.pt").write_bytes(b"s")  # truncated
    half = tmp_path / "checkpoint_00000040"  # a copy cut short by a SIGKILLed driver
    half.mkdir()
    (half / "config.yaml").write_text("x")

    assert ckpt.resolve_resume(tmp_path).name == "checkpoint_00000020"
    with caplog.at_level(logging.WARNING):  # a restarted worker group says it in one line
        chosen = ckpt.latest_valid(tmp_path)
    assert chosen.name == "checkpoint_00000020"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "checkpoint_00000030 (train_state.pt has 1 bytes" in warnings[0]
    assert "checkpoint_00000040 (no hlm_checkpoint.json" in warnings[0]

    # An explicit damaged checkpoint is refused in one line.
    with pytest.raises(HLMError, match="damaged checkpoint") as err:
        ckpt.resolve_resume(bad)
    assert "\n" not in str(err.value)

    # Before the run continues, the damaged folders are set aside (kept, never resumed from).
    notes = ckpt.prepare_resume(tmp_path, chosen)
    assert len(notes) == 1 and "checkpoint_00000030 (train_state.pt has 1 bytes" in notes[0]
    assert "resuming from checkpoint_00000020" in notes[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint_00000010",
        "checkpoint_00000020",
        "damaged-checkpoint_00000030",
        "damaged-checkpoint_00000040",
    ]


def test_an_explicit_checkpoint_wins_and_ray_snapshot_is_dropped_when_it_disagrees(tmp_path):
    ten, twenty = fake_checkpoint(tmp_path, 10), fake_checkpoint(tmp_path, 20)
    snapshot = tmp_path / ckpt.RAY_SNAPSHOT
    snapshot.write_text(json.dumps({"checkpoints": [str(ten), str(twenty)]}))
    assert ckpt.prepare_resume(tmp_path, twenty) == []  # it agrees: Ray keeps its state
    assert snapshot.exists()

    notes = ckpt.prepare_resume(tmp_path, ckpt.resolve_resume(ten), explicit=True)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint_00000010"]
    assert any("removed checkpoint(s) after step 10" in n for n in notes)
    assert not snapshot.exists()  # it named checkpoint_20: Ray would have resumed from there

    # Ray's snapshot one checkpoint behind the disk (a report still in flight): dropped too.
    thirty = fake_checkpoint(tmp_path, 30)
    snapshot.write_text(json.dumps({"checkpoints": [str(ten)]}))
    ckpt.prepare_resume(tmp_path, thirty)
    assert not snapshot.exists()


def test_a_restarted_worker_takes_the_newest_valid_checkpoint_not_rays(tmp_path):
    run = tmp_path / "run"
    ray_pick = fake_checkpoint(run, 10)
    newest = fake_checkpoint(run, 20)
    assert choose_resume(run, ray_pick) == newest  # Ray lagged the disk
    (newest / "train_state.pt").write_bytes(b"")
    assert choose_resume(run, ray_pick) == ray_pick  # the newest is damaged
    remote = fake_checkpoint(tmp_path / "remote", 30)  # a remote storage path, downloaded
    assert choose_resume(run, remote) == remote
    (remote / "train_state.pt").write_bytes(b"")
    assert choose_resume(run, remote) == ray_pick


def test_resume_uses_the_runs_own_config_and_refuses_another_model(tmp_path, capsys):
    folder = fake_checkpoint(tmp_path / "enc", 10, preset="tiny-encoder")
    cfg = resumed_config(folder, overrides=["optim.max_steps=400"])
    assert cfg.model.family == "encoder" and cfg.optim.max_steps == 400

    code = main(["train", "--local", "--resume", str(tmp_path / "enc"), "--preset", "tiny-decoder"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "was trained with --preset tiny-encoder; drop --preset" in err

    with pytest.raises(HLMError, match="model.num_layers=7: a resume continues the run"):
        resumed_config(folder, overrides=["model.num_layers=7"])
    # The launch API's own check (a config built elsewhere, `launch(cfg, resume=True)`).
    other = apply_overrides(cfg, ["model.num_layers=7"])
    with pytest.raises(HLMError, match="model.num_layers=.*asks for 7"):
        check_compatible(other, folder)


def test_resume_keeps_the_runs_launch_settings_unless_given_again(tmp_path):
    """`hlm train --resume RUN` with no flags: the workers, CPUs and experiment it started
    with (launch.json), not today's defaults; a flag given again wins."""
    from hlm_ray.train.resume import LAUNCH_DEFAULTS, launch_settings, save_launch

    started = {**LAUNCH_DEFAULTS, "num_workers": 2, "cpus_per_worker": 0.5, "experiment": "e"}
    save_launch(tmp_path, {**started, "preset": "ignored"})
    none_given = dict.fromkeys(LAUNCH_DEFAULTS)
    assert launch_settings(tmp_path, none_given) == started
    assert launch_settings(tmp_path, {**none_given, "num_workers": 4})["num_workers"] == 4
    assert launch_settings(tmp_path / "no-launch-file", none_given) == LAUNCH_DEFAULTS


HOLDER = """
import sys, time
from hlm_ray.train import run_lock
run_lock.acquire(sys.argv[1])
print(run_lock.token(sys.argv[1]), flush=True)
time.sleep(600)
"""


def a_driver(folder):
    """A process holding `folder`'s writer lock, as `hlm train` does (the lock, not the run):
    (its Popen, the token its workers are given)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    driver = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)],
                              stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    return driver, driver.stdout.readline().strip()


def test_one_writer_per_run_folder_and_a_dead_drivers_lock_is_free(tmp_path, capsys):
    """Two writers could hold one run folder: a second `hlm train` on it while the first ran,
    and the workers of a SIGKILLed driver, which outlive it, finishing the run meanwhile."""
    from hlm_ray.train import run_lock

    run = tmp_path / "run"
    driver, token = a_driver(run)
    try:
        argv = ["train", "--local", "--output", str(run), "--set", f"data.sources=[{SHAKESPEARE}]"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {run} is being written by another process (pid "
                              f"{driver.pid} on ") and "\n" not in err  # fmt: skip
        assert not (run / "launch.json").exists()
        run_lock.watch(run, token)  # a worker of that driver: it writes while the driver lives
        run_lock.check_writer()
    finally:
        driver.kill()  # SIGKILL: the kernel releases the lock, nothing is left to clean
        driver.wait()
    try:
        with pytest.raises(run_lock.WriterGone, match="is gone .* stops without writing"):
            run_lock.check_writer()
        release = run_lock.acquire(run)  # the resume takes the folder at once
        with pytest.raises(run_lock.WriterGone, match="another process has taken"):
            run_lock.check_writer()
        release()
    finally:
        run_lock.watch(run, None)


def test_an_orphaned_worker_stops_writing_the_run_folder(tmp_path):
    """Rank 0's writes in the real loop (metrics lines, checkpoints, the model, summary.json)
    stop once its driver is SIGKILLed mid-run (the driver here holds only the lock)."""
    from tiny_runs import tiny_run_cfg

    from hlm_ray.tracking import read_metrics
    from hlm_ray.train import run_lock
    from hlm_ray.train.loop import train_worker

    run = tmp_path / "run"
    driver, token = a_driver(run)

    def kill_after_step_3():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if any(r["step"] >= 3 for r in read_metrics(run)):
                driver.kill()
                return
            time.sleep(0.02)

    run_lock.watch(run, token)
    killer = threading.Thread(target=kill_after_step_3, daemon=True)
    killer.start()
    try:
        cfg = tiny_run_cfg(run, steps=200, every=(1, 200, 20))
        with pytest.raises(run_lock.WriterGone, match="is gone"):
            train_worker(cfg.to_dict(), progress=False)
    finally:
        run_lock.watch(run, None)
        driver.kill()
        driver.wait()
    steps = [r["step"] for r in read_metrics(run) if "train/loss" in r]
    assert 3 <= max(steps) < 20, steps  # stopped at the kill, long before the first checkpoint
    assert not ckpt.folders(run) and not (run / "summary.json").exists()
    assert not (run / "model").exists()


TORN = '{"step": 45, "train/lo'  # what a write cut by a full disk or a power loss leaves


def test_a_torn_last_metrics_line_is_dropped_on_resume_and_sync_sends_the_rest(
    tmp_path, caplog, mlflow_store
):
    """A torn tail of metrics.jsonl made the run impossible to resume (a traceback through
    truncate_metrics) or to sync (`hlm sync` said to retry, which could never succeed)."""
    from mlflow import MlflowClient

    from hlm_ray.tracking import MlflowTracker, read_metrics, write_run_ref
    from hlm_ray.tracking.sync import sync_run
    from hlm_ray.train.run_checkpoints import truncate_metrics

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "train/loss": 5.0 - s / 10} for s in (10, 20, 30, 40)]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    (run / "metrics.jsonl").write_text(lines + TORN)
    with caplog.at_level(logging.WARNING):
        assert read_metrics(run) == rows
    assert 'line 5 ({"step": 45, "train/lo) is not a whole metrics row' in caplog.text

    tracker = MlflowTracker("torn-tail", "run", tracking_uri=mlflow_store)
    write_run_ref(run, tracker.run_id, mlflow_store)
    report = sync_run(run)  # what can be read is sent
    assert report["metrics_logged"] == 4
    history = MlflowClient(mlflow_store).get_metric_history(tracker.run_id, "train/loss")
    assert sorted(m.step for m in history) == [10, 20, 30, 40]

    truncate_metrics(run, 30)  # a resume from checkpoint 30: the torn tail is gone for good
    assert (run / "metrics.jsonl").read_text() == "".join(json.dumps(r) + "\n" for r in rows[:3])


@pytest.mark.parametrize(
    ("name", "damage", "message"),
    [
        ("launch.json", '{"local": tr', "launch.json is damaged (not JSON at line 1, column 11"),
        ("launch.json", "", "launch.json is damaged (it is empty); it holds how the run was"),
        ("mlflow_run.json", "\x00\x00garbage", "mlflow_run.json is damaged (not JSON at line 1"),
        ("mlflow_run.json", "[1, 2]", "mlflow_run.json is damaged (it holds list, not an object)"),
    ],
    ids=["launch-truncated", "launch-empty", "ref-garbage", "ref-list"],
)
def test_damaged_small_files_of_a_run_folder_are_one_line_on_resume(
    name, damage, message, tmp_path, capsys
):
    """A truncated launch.json or a garbage mlflow_run.json was a raw JSONDecodeError
    traceback on `--resume`; now one line that names the file and what to do."""
    fake_checkpoint(tmp_path / "run", 10)
    (tmp_path / "run" / name).write_text(damage)
    assert main(["train", "--resume", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and message in err, err
    assert ("delete it" in err) and ("restore it" in err or "give the launch flags" in err)


def test_a_worker_group_waiting_for_room_says_so_instead_of_rays_failure_record(
    monkeypatch, capsys
):
    """Each try Ray Train gives a worker group it cannot place ends in its failure policy's
    record "Training failed due to controller error" with a traceback, while the run only
    waits: the controller's callback says so in one line, and Ray's record of that retry is
    dropped (not its other records). Ray's own state and error classes."""
    import logging

    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.controller.state import ReschedulingState, RunningState
    from ray.train.v2.api.exceptions import ControllerError

    from hlm_ray.train import placement_wait as placement

    monkeypatch.delenv(placement.START_TIMEOUT_ENV, raising=False)  # Ray's 60 s a try
    assert placement.retries(180) == 2 and placement.retries(30) == 0
    timeout = ControllerError(WorkerGroupStartupTimeoutError(2))
    waiting = placement.placement_wait(2, {"CPU": 2.0}, 180)
    for _ in range(2):
        state = ReschedulingState(training_failed_error=timeout)
        waiting.after_controller_state_update(RunningState(), state)
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 2 and all("waiting for the cluster to place 2 worker(s)" in s for s in said)
    assert "not placed after 120 s of the 180 s this run waits" in said[1]

    def record(message: str, error: BaseException) -> logging.LogRecord:
        return logging.LogRecord(placement.POLICY_LOGGER, logging.INFO, __file__, 1, message,
                                 (), (type(error), error, None))  # fmt: skip

    other = ControllerError(RuntimeError("the controller broke"))
    assert not placement.quiet_placement_retries(record("[FailurePolicy] RETRY\n...", timeout))
    assert placement.quiet_placement_retries(record("[FailurePolicy] RETRY\n...", other))
    assert placement.quiet_placement_retries(record("[FailurePolicy] RAISE\n...", timeout))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-workers", "0"], "--num-workers 0: use 1 or more"),
        (["--num-workers", "-1"], "--num-workers -1: use 1 or more"),
        (["--local", "--output", "FILE"], "is a file, not a folder"),
        (["--local", "--output", "FILE/run"], "is a file, not a folder"),
        (["--local", "--output", "UNWRITABLE"], "is not writable"),
        (["--local", "--set", "data.sources=[LATIN]"], "latin.txt is not valid UTF-8 (byte"),
        (
            ["--local", "--set", "data.sources=[BINARY]"],
            "binary.txt looks binary (it holds NUL bytes)",
        ),
        # Opening a named pipe waited for a writer: 240 s without a line.
        (["--local", "--set", "data.sources=[FIFO]"], "fifo.txt is not a regular file"),
    ],
)
def test_bad_input_gives_one_line_and_no_running_run(args, message, tmp_path, capsys, mlflow_store):
    from mlflow import MlflowClient

    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "latin.txt").write_bytes("Ce café était fermé.\n".encode("latin-1") * 200)
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 40)
    os.mkfifo(tmp_path / "fifo.txt")
    unwritable = tmp_path / "ro"
    unwritable.mkdir()
    unwritable.chmod(0o500)
    if os.geteuid() == 0:  # root writes anywhere: use a folder no one can write
        unwritable = "/proc/hlm-cannot-write-here"
    swap = {
        "FILE": str(tmp_path / "file"),
        "UNWRITABLE": str(unwritable),
        "LATIN": str(tmp_path / "latin.txt"),
        "BINARY": str(tmp_path / "binary.txt"),
        "FIFO": str(tmp_path / "fifo.txt"),
    }
    args = [a.replace("FILE", swap["FILE"]).replace("UNWRITABLE", swap["UNWRITABLE"]) for a in args]
    args = [a.replace("LATIN", swap["LATIN"]).replace("BINARY", swap["BINARY"]) for a in args]
    args = [a.replace("FIFO", swap["FIFO"]) for a in args]
    own_output = "--output" not in args
    if own_output:
        args += ["--output", str(tmp_path / "out")]
    experiment = f"bad-input-{abs(hash(message)) % 10**8}"
    code = main(["train", "--experiment", experiment, *args])
    # (datasets may draw its progress bar first: the error is the last line, and only one)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: ") and sum("error" in line for line in err) == 1, err
    assert message in err[-1], err
    exp = MlflowClient(mlflow_store).get_experiment_by_name(experiment)
    runs = MlflowClient(mlflow_store).search_runs([exp.experiment_id]) if exp else []
    assert not [r for r in runs if r.info.status == "RUNNING"]
    if own_output:  # nothing left behind: no lone launch.json
        assert not (tmp_path / "out").exists()
    unwritable_dir = tmp_path / "ro"
    unwritable_dir.chmod(0o700)


@pytest.mark.parametrize("checkpointed", [True, False], ids=["after-a-checkpoint", "before-any"])
def test_ctrl_c_on_a_local_run_marks_it_killed_and_prints_the_command(
    checkpointed, tmp_path, capsys, monkeypatch, mlflow_store
):
    """After a checkpoint the command resumes the run; before the first one `--resume` would
    refuse the folder, so the command is the same one again (it starts over)."""
    from mlflow import MlflowClient

    import hlm_ray.train.loop as loop

    out = tmp_path / "run"

    def interrupted(*args, **kwargs):
        if checkpointed:
            fake_checkpoint(out, 10)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train_worker", interrupted)
    experiment = f"ctrl-c-{checkpointed}"
    argv = ["train", "--local", "--output", str(out), "--experiment", experiment]
    argv += ["--set", f"data.sources=[{SHAKESPEARE}]", "--set", "tokenizer.vocab_size=512"]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 130
    if checkpointed:
        assert (
            f"continue with: hlm train --resume {out} --set 'data.sources=[{SHAKESPEARE}]' "
            "--set tokenizer.vocab_size=512" in err
        )
    else:
        assert "before its first checkpoint; continue with: " + shlex.join(["hlm", *argv]) in err
        monkeypatch.undo()  # the printed command is accepted: it trains (2 steps here)
        again = shlex.split(err.split("continue with: ")[1].splitlines()[0])[1:]
        assert main([*again, "--set", "optim.max_steps=2"]) == 0
    client = MlflowClient(mlflow_store)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    statuses = sorted(r.info.status for r in runs)
    assert statuses == (["KILLED"] if checkpointed else ["FINISHED", "KILLED"])
    assert json.loads((out / "launch.json").read_text())["local"] is True


def test_ctrl_c_before_the_mlflow_run_says_nothing_was_started(
    tmp_path, capsys, monkeypatch, mlflow_store
):
    """A Ctrl-C while the corpus is prepared (before any MLflow run) said the run was "marked
    KILLED": now it says no run was opened, and opens none."""
    from mlflow import MlflowClient

    import hlm_ray.train.launch as launch_mod

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch_mod, "build_corpus", ctrl_c)
    experiment = "ctrl-c-preparing"
    argv = ["train", "--local", "--output", str(tmp_path / "run"), "--experiment", experiment]
    assert main([*argv, "--set", f"data.sources=[{SHAKESPEARE}]"]) == 130
    err = capsys.readouterr().err
    assert "interrupted: the run had not started (no MLflow run was opened" in err, err
    assert "KILLED" not in err
    exp = MlflowClient(mlflow_store).get_experiment_by_name(experiment)
    assert exp is None or not MlflowClient(mlflow_store).search_runs([exp.experiment_id])


@pytest.mark.parametrize("where", ["writing the run reference", "building the trainer"])
def test_ctrl_c_between_the_mlflow_run_and_fit_marks_it_killed(
    where, tmp_path, capsys, monkeypatch, mlflow_store
):
    """The window of `launch` where the MLflow run is open and Ray's fit() has not yet taken
    SIGINT over: a Ctrl-C there (raised by the step it interrupts) ends the run KILLED.
    The cluster is not needed before that point: `connect` and the resource check are
    skipped."""
    from mlflow import MlflowClient

    import hlm_ray.tracking as tracking
    import hlm_ray.train.interrupt as interrupt
    import hlm_ray.train.launch as launch_mod

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch_mod, "connect", lambda: None)
    monkeypatch.setattr(launch_mod, "check_resources", lambda *a, **k: None)
    monkeypatch.setattr(launch_mod, "alive_nodes", lambda: [{"Alive": True}])  # one node
    monkeypatch.setattr("ray.cluster_resources", lambda: {"CPU": 2.0})
    if where == "building the trainer":
        monkeypatch.setattr(interrupt, "trainer_class", ctrl_c)
    else:
        monkeypatch.setattr(tracking, "write_run_ref", ctrl_c)
    out = tmp_path / "run"
    experiment = f"ctrl-c-window-{where.split()[-1]}"
    args = ["--output", str(out), "--experiment", experiment, "--num-workers", "1"]
    code = main(["train", *args, "--set", f"data.sources=[{SHAKESPEARE}]"])
    err = capsys.readouterr().err
    assert code == 130  # no checkpoint yet: the same command again
    assert "continue with: hlm train --output" in err
    client = MlflowClient(mlflow_store)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "KILLED"


def test_ctrl_c_on_a_sweep_stops_tune_and_says_so():
    from hlm_ray.train.interrupt import tune_interrupt

    asked = []
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest runs as a background job
    with tune_interrupt() as stop:
        assert os.environ["TUNE_DISABLE_SIGINT_HANDLER"] == "1"
        old = signal.signal(signal.SIGUSR1, lambda *a: asked.append("stop"))  # as Tune does
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            assert stop.interrupted and asked == ["stop"]
            with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C stops at once
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
        finally:
            signal.signal(signal.SIGUSR1, old)
    assert "TUNE_DISABLE_SIGINT_HANDLER" not in os.environ
    assert signal.getsignal(signal.SIGINT) is before  # put back as it was


def _vocab_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "sweeps" / "vocab.py"
    spec = importlib.util.spec_from_file_location("sweep_vocab_faults", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_interrupted_sweep_exits_130_with_the_command_to_continue(monkeypatch, capsys, tmp_path):
    import hlm_ray.tune.sweep as sweep

    monkeypatch.chdir(tmp_path)  # the sweep's log goes to runs/sweeps/<name>/sweep.log

    def interrupted(spec, *, name, search, assumptions=None, storage_path=None, verbose=0):
        rows = [{"status": "FINISHED"}, {"status": "KILLED"}, {"status": "KILLED"}]
        return sweep.SweepOutcome(name, None, rows, "", [], None, False, 1.0, interrupted=True)

    monkeypatch.setattr(sweep, "run_sweep", interrupted)
    code = _vocab_script().main(["--set", "optim.max_steps=20"])
    err = capsys.readouterr().err
    assert code == 130
    assert "2 unfinished trial(s) stopped and marked KILLED" in err
    assert "continue with: python sweeps/vocab.py --set optim.max_steps=20 --name vocab-tiny" in err


class _Unavailable(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503)
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args):
        pass


def test_a_tracking_outage_costs_seconds_and_sync_replays_the_metrics(
    tmp_path, mlflow_store, monkeypatch, capsys
):
    from mlflow import MlflowClient

    from hlm_ray.tracking import MlflowTracker
    from hlm_ray.tracking.store import HTTP_WAITS
    from hlm_ray.tracking.sync import record_status, sync_run

    for key in HTTP_WAITS:
        monkeypatch.delenv(key, raising=False)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = time.monotonic()
        down = MlflowTracker("outage", tracking_uri=f"http://127.0.0.1:{server.server_port}")
        down.log_metrics({"train/loss": 1.0}, step=1)
        took = time.monotonic() - started
    finally:
        server.shutdown()
    assert down.run_id is None and "503" in (down.disabled_reason or "")
    assert took < 8, took  # MLflow's own defaults retry for minutes

    # The run's metrics were kept in metrics.jsonl; half of them reached MLflow.
    run = tmp_path / "run"
    run.mkdir()
    live = MlflowTracker("outage", "run", tracking_uri=mlflow_store)
    (run / "mlflow_run.json").write_text(
        json.dumps({"run_id": live.run_id, "tracking_uri": mlflow_store})
    )
    rows = [{"step": s, "train/loss": 5.0 - s / 10, "train/lr": 0.01} for s in range(1, 11)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for row in rows[:5]:
        live.log_metrics({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    record_status(run, "FINISHED")

    assert main(["sync", str(run)]) == 0
    assert "10 metric point(s)" in capsys.readouterr().out  # 5 steps × 2 keys were missing
    client = MlflowClient(mlflow_store)
    history = client.get_metric_history(live.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 11))  # each step once
    assert client.get_run(live.run_id).info.status == "FINISHED"
    assert sync_run(run)["metrics_logged"] == 0  # nothing twice


def test_a_guarded_child_dies_with_its_killed_parent(tmp_path):
    # The "driver" starts a guarded process group (a process with a child of its own, like
    # `mlflow server` and its workers), then is SIGKILLed.
    script = (
        "import sys, time\n"
        "from hlm_ray.watchdog import spawn_guarded\n"
        "cmd = [sys.executable, '-c', 'import subprocess, time; "
        'subprocess.Popen(["sleep", "120"]); time.sleep(120)\']\n'
        "p = spawn_guarded(cmd)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    group = int(driver.stdout.readline())
    time.sleep(1.0)  # the guarded command has started its child
    os.killpg(group, 0)  # alive
    driver.kill()
    driver.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(group, signal.SIGKILL)
    pytest.fail("the guarded process group outlived its parent")


def test_a_guarded_group_is_stopped_with_sigterm_once(tmp_path):
    """`stop_group` stops a guarded command with one SIGTERM (an `mlflow server`'s uvicorn
    shuts down cleanly on it; on SIGINT it logged a KeyboardInterrupt traceback at every normal
    stop), through its watchdog; the command's own child too."""
    from hlm_ray.watchdog import spawn_guarded, stop_group

    seen = tmp_path / "signals"
    code = (
        "import signal, subprocess, sys, time\n"
        "child = subprocess.Popen(['sleep', '120'])\n"
        "def on(signum, frame):\n"
        f"    open({str(seen)!r}, 'a').write(signal.Signals(signum).name + '\\n')\n"
        "    child.terminate(); child.wait(); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on); signal.signal(signal.SIGINT, on)\n"
        "print('ready', flush=True); time.sleep(120)\n"
    )
    process = spawn_guarded([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert process.stdout.readline() == b"ready\n"
    started = time.monotonic()
    stop_group(process)
    assert seen.read_text() == "SIGTERM\n"
    assert time.monotonic() - started < 5  # not the watchdog's SIGKILL after its grace
    with pytest.raises(ProcessLookupError):
        os.killpg(process.pid, 0)


def test_checkpoints_from_before_manifests_still_resume(tmp_path):
    folder = fake_checkpoint(tmp_path, 10)
    meta = json.loads((folder / ckpt.MARKER).read_text())
    del meta["files"]
    (folder / ckpt.MARKER).write_text(json.dumps(meta))
    assert ckpt.verify(folder) is None
    (folder / "train_state.pt").unlink()
    assert ckpt.verify(folder) == "train_state.pt is missing"


def test_trials_cut_short_by_ctrl_c_are_killed_not_stopped_by_asha(tmp_path, mlflow_store):
    from types import SimpleNamespace

    from mlflow import MlflowClient

    from hlm_ray.tracking import MlflowTracker, write_run_ref
    from hlm_ray.tune.spec import get_sweep
    from hlm_ray.tune.sweep import _close_orphans, _rows
    from hlm_ray.tune.trial import TrialRuntime, run_name

    script = _vocab_script()
    spec = get_sweep(script.PRESETS, "tiny", [])
    value, objective = spec.values[0], spec.objectives[0]
    cfg = spec.cell_config(value, objective, 0)
    runtime = TrialRuntime(
        "s",
        spec.axis.name,
        "sweep-ctrl-c",
        None,
        str(tmp_path),
        "tiny",
        1,
        1.0,
        0.0,
        env={"MLFLOW_TRACKING_URI": mlflow_store},
        short=spec.axis.short,
    )
    cut = SimpleNamespace(
        metrics={"val/loss": 5.0},
        config={"config": cfg.to_dict(), "value": value},
        error=None,
        path=str(tmp_path / "t1"),
    )
    child = MlflowTracker("sweep-ctrl-c", "t1", tracking_uri=mlflow_store)
    name = run_name(cfg.objective.name, spec.axis.short, value, cfg.run.seed, "t1")
    write_run_ref(tmp_path / name, child.run_id, mlflow_store)

    assert _rows([cut], spec, runtime, search=True)[0]["status"] == "STOPPED"  # ASHA
    rows = _rows([cut], spec, runtime, search=False, interrupted=True)
    assert rows[0]["status"] == "KILLED"
    _close_orphans(rows, spec, runtime)
    assert MlflowClient(mlflow_store).get_run(child.run_id).info.status == "KILLED"


def test_ray_stop_stops_the_processes_of_one_session_folder_and_no_other(tmp_path):
    """`python -m hlm_ray.ray_stop DIR` (the README's stop for a cluster with its own
    --temp-dir): every process with a file open under DIR or DIR in its command line, and their
    children, stopped; one that ignores SIGTERM killed after the grace period; a process
    outside DIR untouched. Plain processes stand for Ray's here; the README test stops a real
    cluster with it."""
    import psutil

    from hlm_ray.ray_stop import cluster_processes, stop

    session = tmp_path / "ray-mine" / "session_1" / "logs"
    session.mkdir(parents=True)
    (session / "gcs_server.out").write_text("")
    holds_a_log = (
        "import signal, subprocess, sys, time\n"
        f"log = open({str(session / 'gcs_server.out')!r})\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a slow GCS server\n"
        "subprocess.Popen(['sleep', '120'])\n"
        "print('ready', flush=True); time.sleep(120)\n"
    )
    named = "import time; print('ready', flush=True); time.sleep(120)"
    procs = [
        subprocess.Popen([sys.executable, "-c", holds_a_log], stdout=subprocess.PIPE),
        subprocess.Popen(
            [sys.executable, "-c", named, str(tmp_path / "ray-mine")], stdout=subprocess.PIPE
        ),  # fmt: skip
        subprocess.Popen(
            [sys.executable, "-c", named, str(tmp_path / "ray-other")], stdout=subprocess.PIPE
        ),  # fmt: skip
    ]
    try:
        for p in procs:
            assert p.stdout.readline() == b"ready\n"
        found = {p.pid for p in cluster_processes(tmp_path / "ray-mine")}
        child = psutil.Process(procs[0].pid).children()[0].pid
        assert found == {procs[0].pid, child, procs[1].pid}
        started = time.monotonic()
        assert stop(tmp_path / "ray-mine", grace_s=1.0) == 3
        assert time.monotonic() - started >= 1.0  # one ignored SIGTERM: killed after the grace
        for pid in found:  # (psutil reaped this test's own children: no exit status to read)
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        assert procs[2].poll() is None  # another folder's process
    finally:
        for p in procs:
            p.kill()
