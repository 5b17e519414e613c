"""MlflowTracker against a real (temporary) sqlite store, and its failure modes.

A fresh sqlite store migrates its schema on first use (seconds), so the module shares one store
and each test uses its own experiment.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from hlm_ray import paths
from hlm_ray.paths import PROJECT_ROOT, git_commit
from hlm_ray.tracking import (
    JsonlTracker,
    MlflowTracker,
    MultiTracker,
    default_tracking_uri,
    read_metrics,
    read_run_ref,
    write_run_ref,
)
from hlm_ray.tracking import store as tracking_store
from hlm_ray.tracking.server import FIXED_PORTS, _ephemeral_range, free_port
from hlm_ray.train.summary import plot_loss_curve

mlflow = pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module, found through HLM_MLFLOW_DIR as in real use."""
    root = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HLM_MLFLOW_DIR", str(root))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        uri = default_tracking_uri()
        start = time.perf_counter()
        mlflow.MlflowClient(uri).search_experiments()  # pay for the schema migration once
        print(f"fresh sqlite store ready in {time.perf_counter() - start:.1f} s")
        yield root, uri


@pytest.fixture
def client(store):
    return mlflow.MlflowClient(store[1])


@pytest.fixture
def experiment(request, store):
    return f"test-{request.node.name}"


def tracking_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("hlm_ray.tracking") and r.levelno == logging.WARNING
    ]


def test_default_tracking_uri(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("HLM_MLFLOW_DIR", raising=False)
    monkeypatch.delenv("HLM_WORK_DIR", raising=False)
    # The current directory, as for `mlflow ui`'s own default (not the package's folder).
    monkeypatch.chdir(tmp_path)
    assert default_tracking_uri() == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    monkeypatch.chdir(PROJECT_ROOT)
    assert default_tracking_uri() == f"sqlite:///{PROJECT_ROOT / 'mlflow.db'}"
    monkeypatch.setenv("HLM_MLFLOW_DIR", str(tmp_path))
    assert default_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert default_tracking_uri() == "http://127.0.0.1:5000"
    # Relative sqlite paths are pinned to the current directory (workers run elsewhere).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///sub/m.db")
    assert default_tracking_uri() == f"sqlite:///{tmp_path.resolve() / 'sub' / 'm.db'}"


def test_import_does_not_load_mlflow_or_matplotlib():
    code = (
        "import sys, hlm_ray.tracking; "
        "assert 'mlflow' not in sys.modules and 'matplotlib' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PROJECT_ROOT)


def test_mlflow_telemetry_is_off_in_hlm_processes_unless_the_user_set_it():
    """MLflow's telemetry thread edits os.environ (`_MLFLOW_TELEMETRY_SESSION_ID`) while the
    process copies its environment: a KeyError there turned a sweep trial's tracking off. Run
    outside pytest and CI (MLflow turns telemetry off there by itself)."""
    quiet = ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "MLFLOW_DISABLE_TELEMETRY")
    env = {k: v for k, v in os.environ.items() if k not in quiet}

    def run(code: str, **extra) -> list[str]:
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, cwd=PROJECT_ROOT,
                             capture_output=True, text=True, check=True)  # fmt: skip
        return out.stdout.split()

    with_mlflow = (
        "import os, hlm_ray.tracking, mlflow; "
        "from mlflow.telemetry.client import get_telemetry_client as get; "
        "print(os.environ['MLFLOW_DISABLE_TELEMETRY'], get() is None)"
    )
    assert run(with_mlflow) == ["true", "True"]
    setting = "import os, hlm_ray.tracking; print(os.environ['MLFLOW_DISABLE_TELEMETRY'])"
    assert run(setting, MLFLOW_DISABLE_TELEMETRY="false") == ["false"]  # the user's choice stands


def test_git_commit(tmp_path):
    commit = git_commit()
    assert commit is None or (len(commit) == 40 and int(commit, 16) >= 0)
    assert git_commit(tmp_path) is None  # not a repository


def test_round_trip(store, client, experiment, tmp_path, caplog):
    root, _ = store
    file = tmp_path / "notes.txt"
    file.write_text("hello")
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "sub" / "w.bin").write_bytes(b"\0" * 8)

    t = MlflowTracker(experiment, run_name="rt", tags={"kind": "test"})
    assert t.active and t.run_id
    t.log_params(
        {"optim": {"lr": 3e-4, "betas": [0.9, 0.95]}, "model": {"arch": "gpt2"}, "n": None}
    )
    t.set_tags({"objective": "headless", "world_size": 2})
    t.log_metrics({"train/loss": 2.5, "train/lr": 1e-3}, step=10)
    t.log_metrics({"train/loss": 2.0, "val/loss": 2.2, "bad": "x"}, step=20)
    t.log_artifact(file)
    t.log_artifact(folder, artifact_path="final")
    t.log_artifact(folder)
    t.finish("FINISHED")

    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "rt"
    assert run.data.params == {
        "optim.lr": "0.0003",
        "optim.betas": "[0.9, 0.95]",
        "model.arch": "gpt2",
        "n": "None",
    }
    tags = run.data.tags
    assert tags["kind"] == "test" and tags["objective"] == "headless" and tags["world_size"] == "2"
    assert "mlflow.parentRunId" not in tags
    history = client.get_metric_history(t.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(10, 2.5), (20, 2.0)]
    assert all(m.timestamp > 1e12 for m in history)  # milliseconds
    assert [m.value for m in client.get_metric_history(t.run_id, "val/loss")] == [2.2]
    assert "bad" not in run.data.metrics

    assert {a.path for a in client.list_artifacts(t.run_id)} == {"notes.txt", "final", "model"}
    # A folder's contents go under artifact_path when given, else under the folder's name.
    assert {a.path for a in client.list_artifacts(t.run_id, "final")} == {
        "final/config.json",
        "final/sub",
    }
    assert [a.path for a in client.list_artifacts(t.run_id, "model/sub")] == ["model/sub/w.bin"]
    # Artifacts land under <HLM_MLFLOW_DIR>/mlartifacts, not ./mlruns of the current directory.
    exp = client.get_experiment_by_name(experiment)
    assert exp.artifact_location == (root / "mlartifacts").as_uri()
    assert (root / "mlartifacts" / t.run_id / "artifacts" / "notes.txt").read_text() == "hello"
    assert not tracking_warnings(caplog)


def test_a_run_carries_the_commit_of_its_git_checkout(client, experiment, tmp_path, monkeypatch):
    """Run from a git checkout, the run is tagged with its HEAD (`mlflow.source.git.commit`);
    from a folder that is not one, it has no such tag. The checkout is made here, so the check
    holds wherever the tests run."""
    if shutil.which("git") is None:
        pytest.skip("no git binary")
    repo, plain = tmp_path / "checkout", tmp_path / "plain"
    repo.mkdir(), plain.mkdir()
    (repo / "f.txt").write_text("x")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for args in (["init", "-q"], ["add", "f.txt"], ["commit", "-qm", "x"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip
    tags = {}
    for root in (repo, plain):
        monkeypatch.setattr(paths, "project_root", lambda root=root: root)
        run = MlflowTracker(experiment, run_name=root.name)
        run.finish()
        tags[root.name] = client.get_run(run.run_id).data.tags
    assert len(head) == 40 and tags["checkout"]["mlflow.source.git.commit"] == head
    assert "mlflow.source.git.commit" not in tags["plain"]


def test_a_registered_generator_predicts_the_librarys_text(store, tiny_decoder_dir, monkeypatch):
    """The registered version as MLflow's pyfunc (`mlflow models serve`, `pyfunc.load_model`)
    answers a prompt with the text `hlm_ray.generate` gives the folder (greedy), prompt first."""
    from hlm_ray.generate import Generator
    from hlm_ray.tracking import register_model

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store[1])
    name, version = register_model(tiny_decoder_dir, "test-pyfunc-generator")
    model = mlflow.pyfunc.load_model(f"models:/{name}/{version}")
    library = Generator.load(tiny_decoder_dir)
    prompts = ["The king said", "Paris is a word that"]
    got = [model.predict([p], params={"max_new_tokens": 12})[0] for p in prompts]
    want = [p + c.text for p, c in zip(prompts, library.generate(prompts, max_new_tokens=12,
                                                                 temperature=0), strict=True)]  # fmt: skip
    assert got == want
    assert len(set(want)) == 2 and all(len(w) > len(p) for w, p in zip(want, prompts, strict=True))


def test_two_stores_with_one_model_name_and_version_each_load_their_own(store, tmp_path):
    """`models:/NAME/1` of one store is not `models:/NAME/1` of another (a second project folder,
    or mlflow.db deleted and made again): each loads its own weights through the one cache."""
    from hlm_ray.tracking import download_model

    root, uri_a = store
    mlflow.MlflowClient(uri_a).search_experiments()  # the module's store exists (migrated)
    (tmp_path / "b").mkdir()
    shutil.copy(root / "mlflow.db", tmp_path / "b" / "mlflow.db")  # a second, migrated store
    uri_b = f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}"
    name = "test-one-name-two-stores"

    def register(uri: str, weights: str) -> str:
        folder = tmp_path / weights / "model"
        folder.mkdir(parents=True)
        (folder / "weights.txt").write_text(weights)
        client = mlflow.MlflowClient(uri)
        client.create_registered_model(name)
        return str(client.create_model_version(name, str(folder)).version)

    def load(uri: str) -> str:
        return (download_model(f"models:/{name}/1", tracking_uri=uri) / "weights.txt").read_text()

    assert register(uri_a, "first") == register(uri_b, "second") == "1"
    assert (load(uri_a), load(uri_b), load(uri_a)) == ("first", "second", "first")
    # The same store made again: its name deleted and registered anew, version 1 once more.
    mlflow.MlflowClient(uri_a).delete_registered_model(name)
    assert register(uri_a, "third") == "1"
    assert load(uri_a) == "third"


def test_a_failed_registration_leaves_no_run_running(store, tmp_path):
    """A wrong folder is refused before any run is opened; a failure after the run holding the
    model was opened ends that run FAILED, never RUNNING forever."""
    from hlm_ray.errors import HLMError
    from hlm_ray.tracking import register_model

    uri, experiment = store[1], "test-failed-registration"
    with pytest.raises(HLMError, match=r"model folder .*nowhere/model does not exist"):
        register_model(tmp_path / "nowhere" / "model", "test-bad", tracking_uri=uri,
                       experiment=experiment)  # fmt: skip
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # no model_type: transformers cannot load it
    with pytest.raises(HLMError, match="registering test-bad .* failed"):
        register_model(broken, "test-bad", tracking_uri=uri, experiment=experiment)
    runs = mlflow.MlflowClient(uri).search_runs(
        [mlflow.MlflowClient(uri).get_experiment_by_name(experiment).experiment_id]
    )
    assert [(r.info.run_name, r.info.status) for r in runs] == [("register-test-bad", "FAILED")]


def test_resume_continues_the_same_run(client, experiment, caplog):
    params = {"optim": {"lr": 1e-3}, "seed": 0}
    first = MlflowTracker(experiment, run_name="attempt")
    first.log_params(params)
    first.log_metrics({"train/loss": 3.0}, step=1)
    first.log_metrics({"train/loss": 2.9}, step=2)
    first.finish("FAILED")  # the worker group died; Ray restarts it with the saved run id
    assert client.get_run(first.run_id).info.status == "FAILED"

    second = MlflowTracker(experiment, run_id=first.run_id, tags={"attempt": 2})
    assert second.active and second.run_id == first.run_id
    assert client.get_run(first.run_id).info.status == "RUNNING"
    second.log_params(params)  # identical values: skipped, no error
    second.log_params({"optim": {"lr": 5e-4}, "seed": 0})  # changed on resume: kept as a tag
    second.log_metrics({"train/loss": 2.8}, step=3)
    assert client.get_run(first.run_id).info.status == "RUNNING"
    second.finish()

    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert [r.info.run_id for r in runs] == [first.run_id]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params == {"optim.lr": "0.001", "seed": "0"}
    assert run.data.tags["param_changed.optim.lr"] == "0.0005" and run.data.tags["attempt"] == "2"
    history = client.get_metric_history(first.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 3.0), (2, 2.9), (3, 2.8)]
    assert second.active
    warnings = tracking_warnings(caplog)
    assert len(warnings) == 1 and "optim.lr" in warnings[0]


def test_failed_does_not_replace_the_kill_of_a_sweep(client, experiment, tmp_path):
    """A sweep marks the trial it stopped KILLED (its run and its folder) while the trial's
    process is still going down; that process then catches the error of its own shutdown and
    says FAILED, which must not win. Reopened, the run can fail for real again."""
    from hlm_ray.tracking.sync import record_status

    trial = MlflowTracker(experiment, run_name="stopped-trial")
    write_run_ref(tmp_path, trial.run_id, trial.tracking_uri)
    record_status(tmp_path, "KILLED")  # the sweep's driver
    MlflowTracker(experiment, run_id=trial.run_id).finish("KILLED")
    record_status(tmp_path, "FAILED")  # the trial, on its way out
    trial.finish("FAILED")
    assert client.get_run(trial.run_id).info.status == "KILLED"
    assert read_run_ref(tmp_path)["status"] == "KILLED"

    again = MlflowTracker(experiment, run_id=trial.run_id)  # the sweep continued: RUNNING
    write_run_ref(tmp_path, again.run_id, again.tracking_uri)
    record_status(tmp_path, "FAILED")
    again.finish("FAILED")
    assert client.get_run(trial.run_id).info.status == "FAILED"
    assert read_run_ref(tmp_path)["status"] == "FAILED"


def test_resume_of_unknown_run_degrades(experiment, caplog):
    t = MlflowTracker(experiment, run_id="0" * 32)
    assert t.run_id is None and not t.active
    t.log_metrics({"x": 1.0}, step=1)
    t.finish()
    warnings = tracking_warnings(caplog)
    assert len(warnings) == 1 and "resuming run" in warnings[0] and "not found" in warnings[0]


RACER = """
import sys, time
from pathlib import Path
from hlm_ray.tracking import MlflowTracker
import mlflow  # imported before the start: the race is in the store's first use
folder = Path(sys.argv[1])
(folder / f"ready-{sys.argv[2]}").touch()
while not (folder / "go").exists():
    time.sleep(0.005)
tracker = MlflowTracker("race", sys.argv[2], tracking_uri=f"sqlite:///{folder}/mlflow.db")
print(tracker.run_id, tracker.disabled_reason)
"""


def test_two_runs_started_at_once_on_a_new_store_are_both_tracked(tmp_path):
    """Two `hlm train` at once on a new sqlite store both ran MLflow's migrations and one ran
    with tracking off ("duplicate column name: step": seen in 3 of 3 tries before the fix): the
    first to take the store's lock creates it, the other waits for it."""
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp_path), name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{n}").exists() for n in "ab"):
        assert time.monotonic() < deadline and all(r.poll() is None for r in racers)
        time.sleep(0.05)
    (tmp_path / "go").touch()
    outs = [r.communicate(timeout=180) for r in racers]
    for out, err in outs:
        run_id, _, reason = out.strip().partition(" ")
        assert reason == "None" and len(run_id) == 32, (out, err[-300:])


def test_parent_run_id(client, experiment):
    parent = MlflowTracker(experiment, run_name="sweep")
    child = MlflowTracker(experiment, run_name="trial-0", parent_run_id=parent.run_id)
    assert client.get_run(child.run_id).data.tags["mlflow.parentRunId"] == parent.run_id
    child.finish()
    parent.finish()


def test_two_trackers_in_one_process(client, experiment):
    a = MlflowTracker(experiment, run_name="a")
    b = MlflowTracker(experiment, run_name="b")
    a.log_metrics({"m": 1.0}, step=1)
    b.log_metrics({"m": 2.0}, step=1)
    a.finish("KILLED")
    b.log_metrics({"m": 3.0}, step=2)  # b is unaffected by a's end
    b.finish()
    assert client.get_run(a.run_id).info.status == "KILLED"
    assert [m.value for m in client.get_metric_history(b.run_id, "m")] == [2.0, 3.0]
    assert mlflow.active_run() is None  # no fluent global state was touched


def test_pickled_tracker_keeps_logging_to_the_same_run(client, experiment):
    t = MlflowTracker(experiment)
    t.log_metrics({"m": 1.0}, step=1)
    copy = pickle.loads(pickle.dumps(t))  # e.g. built in a driver, shipped to a worker
    copy.log_metrics({"m": 2.0}, step=2)
    copy.finish()
    assert [m.value for m in client.get_metric_history(t.run_id, "m")] == [1.0, 2.0]


def test_finish_rejects_an_unknown_status(experiment):
    t = MlflowTracker(experiment)
    with pytest.raises(ValueError, match="FINISHED"):
        t.finish("DONE")
    t.finish("killed")


def test_unreachable_server_is_a_no_op(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    (tmp_path / "a.txt").write_text("a")
    start = time.perf_counter()
    t = MlflowTracker("unreachable", run_name="r", tracking_uri="http://127.0.0.1:9")
    assert t.run_id is None and not t.active
    t.log_params({"a": {"b": 1}})
    t.set_tags({"x": 1})
    t.log_metrics({"train/loss": 1.0}, step=1)
    t.log_artifact(tmp_path / "a.txt")
    t.finish("FAILED")
    assert time.perf_counter() - start < 10
    warnings = tracking_warnings(caplog)
    assert len(warnings) == 1
    assert "MLflow tracking is off" in warnings[0] and "127.0.0.1:9" in warnings[0]


def test_unreachable_server_through_the_client(monkeypatch, caplog):
    """The same without the TCP probe: MLflow's own error degrades the tracker too."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setattr(tracking_store, "probe", lambda uri: None)
    t = MlflowTracker("unreachable", tracking_uri="http://127.0.0.1:9")
    t.log_metrics({"train/loss": 1.0}, step=1)
    assert t.run_id is None and len(tracking_warnings(caplog)) == 1


def test_store_lost_mid_run(client, experiment, tmp_path, monkeypatch, caplog):
    jsonl = JsonlTracker(tmp_path)
    t = MlflowTracker(experiment)
    both = MultiTracker(jsonl, t)
    both.log_metrics({"train/loss": 2.0}, step=1)
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise mlflow.exceptions.MlflowException("database is locked")

    monkeypatch.setattr(t._client, "log_batch", broken)
    both.log_metrics({"train/loss": 1.9}, step=2)
    both.log_metrics({"train/loss": 1.8}, step=3)
    both.log_params({"a": 1})
    both.set_tags({"b": 2})
    both.finish("FINISHED")
    assert len(calls) == 1 and not t.active and t.run_id is not None
    warnings = tracking_warnings(caplog)
    assert len(warnings) == 1 and "database is locked" in warnings[0]
    # What reached the store before the failure stays; the local log has everything.
    assert [m.step for m in client.get_metric_history(t.run_id, "train/loss")] == [1]
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]


def test_missing_artifact_warns_but_keeps_tracking(experiment, tmp_path, caplog):
    t = MlflowTracker(experiment)
    t.log_artifact(tmp_path / "nope.png")
    assert t.active and "nope.png" in tracking_warnings(caplog)[0]
    t.finish()


def test_plot_loss_curve(tmp_path):
    rows = [{"step": s, "train/loss": 3.0 / s} for s in range(1, 21)]
    rows += [{"step": 10, "val/loss": 0.5}, {"step": 20, "val/loss": 0.3}]
    out = plot_loss_curve(rows, tmp_path / "plots" / "loss.png", title="tiny")
    assert out == tmp_path / "plots" / "loss.png"
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000
    empty = plot_loss_curve([], tmp_path / "empty.png")  # nothing logged yet: still a PNG
    assert empty.read_bytes().startswith(b"\x89PNG")


def test_compare_figure_never_puts_two_objectives_on_one_axis(tmp_path, monkeypatch):
    """`hlm compare`'s compare.png drew the CWT and cross-entropy losses on one axis, which
    are not on one scale: one panel per run now, and the speed bars."""
    import json

    from matplotlib.figure import Figure

    from hlm_ray.train.summary import plot_runs

    runs = []
    for name, loss in (("headless", 0.5), ("vanilla", 6.0)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": s, "train/loss": loss / s} for s in (1, 2, 3)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "summary.json").write_text(json.dumps({"tokens_per_s": 100.0}))
        runs.append(run)
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: saved.append(fig))
    plot_runs(runs, tmp_path / "compare.png")
    [fig] = saved
    curves = [[line.get_ydata()[0] for line in ax.get_lines()] for ax in fig.axes]
    assert curves == [[0.5], [6.0], []]  # one run's loss per axis; the bars last


def test_loss_curve_as_an_artifact(client, experiment, tmp_path):
    jsonl = JsonlTracker(tmp_path)
    for step in (1, 2, 3):
        jsonl.log_metrics({"train/loss": 1.0 / step}, step)
    t = MlflowTracker(experiment)
    t.log_artifact(plot_loss_curve(read_metrics(tmp_path), tmp_path / "loss_curve.png"))
    t.finish()
    assert [a.path for a in client.list_artifacts(t.run_id)] == ["loss_curve.png"]


def test_sqlite_store_in_a_new_folder(monkeypatch, tmp_path):
    """The sqlite folder is created; checked with the URI only (no second migration here)."""
    target = tmp_path / "new" / "deeper"
    assert tracking_store.sqlite_path(f"sqlite:///{target / 'm.db'}") == target / "m.db"
    assert tracking_store.sqlite_path("sqlite:///:memory:") is None
    assert tracking_store.sqlite_path("http://x") is None
    assert tracking_store.artifact_location(f"sqlite:///{target / 'm.db'}") == (
        (target / "mlartifacts").as_uri()
    )
    assert (target / "mlartifacts").is_dir()


def test_redact():
    assert tracking_store.redact("https://u:secret@host:8080/x") == "https://host:8080/x"
    assert tracking_store.redact("sqlite:////a/b.db") == "sqlite:////a/b.db"


def test_tracking_package_is_the_only_mlflow_importer():
    tracking_dir = PROJECT_ROOT / "hlm_ray" / "tracking"
    offenders = [
        str(p.relative_to(PROJECT_ROOT))
        for p in (PROJECT_ROOT / "hlm_ray").rglob("*.py")
        if tracking_dir not in p.parents
        and re.search(r"^\s*(import|from) mlflow", p.read_text(), re.M)
    ]
    assert offenders == []


def test_run_ref_round_trip(tmp_path):
    assert read_run_ref(tmp_path) is None
    write_run_ref(tmp_path / "run", "abc123", "sqlite:///x.db")
    assert read_run_ref(tmp_path / "run") == {
        "run_id": "abc123",
        "tracking_uri": "sqlite:///x.db",
        "folder": str((tmp_path / "run").resolve()),
    }


def test_sync_of_a_folder_that_is_not_a_run_says_so_in_one_line(tmp_path):
    from hlm_ray.errors import HLMError
    from hlm_ray.tracking.sync import sync_run

    with pytest.raises(HLMError, match=r"no mlflow_run\.json and no metrics\.jsonl: not a run"):
        sync_run(tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing written into a folder that is not a run


def _run_folder_behind_a_dead_server(folder, store_uri: str, experiment: str) -> str:
    """A run folder whose MLflow run (in `store_uri`) has steps 10 and 20 of metrics.jsonl's
    10, 20, 30, and whose mlflow_run.json names a sweep's loopback server that is gone."""
    tracker = MlflowTracker(experiment, "trial", tracking_uri=store_uri)
    jsonl = JsonlTracker(folder)
    for step in (10, 20, 30):
        jsonl.log_metrics({"train/loss": 1.0 / step}, step=step)
        if step < 30:
            tracker.log_metrics({"train/loss": 1.0 / step}, step=step)
    write_run_ref(folder, tracker.run_id, f"http://127.0.0.1:{free_port()}")  # nobody there
    return tracker.run_id


def test_sync_reaches_the_store_the_user_names_not_only_the_recorded_server(
    store, tmp_path, monkeypatch, capsys
):
    """A sweep trial's folder records its sweep's own server on an ephemeral loopback port;
    `hlm sync` finds the run through --tracking-uri, $MLFLOW_TRACKING_URI or the folder's own
    store, and otherwise says which option names the store (advice that can succeed)."""
    from hlm_ray.cli import main

    root, uri = store

    def history(run_id: str) -> list[int]:
        points = mlflow.MlflowClient(uri).get_metric_history(run_id, "train/loss")
        return sorted(m.step for m in points)

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("HLM_MLFLOW_DIR", str(tmp_path / "elsewhere"))  # no store there
    lost = _run_folder_behind_a_dead_server(tmp_path / "a", uri, "test-sync-stores")
    assert main(["sync", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tracking-uri URI" in err and "127.0.0.1" in err
    assert main(["sync", str(tmp_path / "a"), "--tracking-uri", uri]) == 0
    assert history(lost) == [10, 20, 30]
    assert read_run_ref(tmp_path / "a")["tracking_uri"] == uri  # found there next time

    by_env = _run_folder_behind_a_dead_server(tmp_path / "b", uri, "test-sync-stores")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert main(["sync", str(tmp_path / "b")]) == 0
    assert history(by_env) == [10, 20, 30]

    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setenv("HLM_MLFLOW_DIR", str(root))  # the project folder's own mlflow.db
    here = _run_folder_behind_a_dead_server(tmp_path / "c", uri, "test-sync-stores")
    assert main(["sync", str(tmp_path / "c")]) == 0
    assert history(here) == [10, 20, 30]
    assert "1 metric point(s)" in capsys.readouterr().out


def test_a_resumed_trial_whose_training_was_complete_replays_what_mlflow_missed(
    store, tmp_path, monkeypatch
):
    """A sweep SIGKILLed after a trial's training ended, while its worker wrote the last steps
    with the tracking server gone: the re-run skips training (summary.json and model/ are
    there) and must still send those steps to the new sweep's store."""
    import json

    from hlm_ray.config import Config, apply_overrides
    from hlm_ray.tune import trial

    uri = store[1]
    folder = tmp_path / "headless-t1-s0-abc"
    run_id = _run_folder_behind_a_dead_server(folder, uri, "test-trial-replay")
    (folder / "model").mkdir()
    summary = {"steps": 30, "tokens_per_s": 1000.0, "model_dir": str(folder / "model")}
    (folder / "summary.json").write_text(json.dumps(summary))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the resumed sweep's store
    cfg = apply_overrides(Config(), {"optim.max_steps": 30})
    assert trial._pretrain(cfg, runtime=None, out_dir=folder, trial_id="abc") == (summary, False)
    steps = mlflow.MlflowClient(uri).get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in steps) == [10, 20, 30]


def test_free_port_is_outside_the_ports_the_kernel_hands_out(monkeypatch):
    """A port the OS hands out can be taken by another process before the server binds it
    (two local Ray clusters starting at once did take a dashboard's port)."""
    from hlm_ray.tracking import server

    low, _ = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(FIXED_PORTS[0] <= p < min(FIXED_PORTS[1], low) for p in ports), ports
    taken_port, other = sorted(ports)[:2]
    with socket.socket() as taken:  # a port something listens on is skipped, not returned
        taken.bind(("127.0.0.1", taken_port))
        taken.listen()
        monkeypatch.setattr(server.random, "sample", lambda *_: [taken_port, other])
        assert free_port() == other


@pytest.mark.parametrize("fresh", [True, False])
def test_ray_starts_while_the_tracking_server_starts_a_new_store_or_an_old_one(
    fresh, monkeypatch, tmp_path
):
    """`tracking_server` runs `while_starting` (a sweep's Ray start-up) after spawning the
    server and before waiting for it, also on a new store, where it holds the lock that keeps
    the sweeps started beside it waiting for the migrations. The server process is a recorder
    here: its real start-up (10-45 s) is what the sweep tests run."""
    import fcntl

    from hlm_ray.tracking import server as srv

    db = tmp_path / "mlflow.db"
    if not fresh:
        db.write_bytes(b"")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    calls = []

    def lock_taken() -> bool:
        with db.with_name(db.name + ".lock").open("a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(other, fcntl.LOCK_UN)
            return False

    monkeypatch.setattr(srv.LocalServer, "spawn", lambda self: calls.append("spawn"))
    monkeypatch.setattr(srv.LocalServer, "wait_ready", lambda self, t: calls.append("ready"))
    monkeypatch.setattr(srv.LocalServer, "stop", lambda self: calls.append("stop"))
    with srv.tracking_server(
        tmp_path / "server.log", while_starting=lambda: calls.append(("ray", lock_taken()))
    ) as uri:
        assert uri.startswith("http://127.0.0.1:")
        assert not lock_taken()  # the sweeps beside it go on once the store exists
    assert calls == ["spawn", ("ray", fresh), "ready", "stop"]


@pytest.mark.parametrize("fresh", [True, False])
def test_a_failed_start_of_ray_lets_a_new_store_finish_migrating(fresh, monkeypatch, tmp_path):
    """Bad input or Ray failing while a new store migrates: the error goes on, but only once the
    server is ready (a server stopped halfway leaves a store MLflow cannot open again: "table
    spans already exists", seen on this machine). An old store is not waited for."""
    from hlm_ray.errors import HLMError
    from hlm_ray.tracking import server as srv

    db = tmp_path / "mlflow.db"
    if not fresh:
        db.write_bytes(b"")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    calls = []

    def ray_fails():
        calls.append("ray")
        raise HLMError("no corpus at data/missing.txt")

    monkeypatch.setattr(srv.LocalServer, "spawn", lambda self: calls.append("spawn"))
    monkeypatch.setattr(srv.LocalServer, "wait_ready", lambda self, t: calls.append("ready"))
    monkeypatch.setattr(srv.LocalServer, "stop", lambda self: calls.append("stop"))
    with (
        pytest.raises(HLMError, match="no corpus"),
        srv.tracking_server(tmp_path / "server.log", while_starting=ray_fails),
    ):
        pass
    assert calls == ["spawn", "ray", *(["ready"] if fresh else []), "stop"]


def test_the_end_of_a_sweep_sends_every_trials_logged_steps_wherever_it_was_killed(
    store, tmp_path, capsys
):
    """A sweep killed at any point and resumed leaves each trial in one of these states; at the
    end of the resumed sweep every step of every trial's metrics.jsonl is in MLflow: steps a
    worker wrote after the tracking server died, mid-training or after its training ended (a
    stage the resumed sweep skips), and in a trial Tune had finished (which it never reruns)."""
    import json

    from hlm_ray.tune.replay import replay_trials

    uri = store[1]
    trials = tmp_path / "trials"
    behind = ["mid-training", "trained", "reported"]  # steps 10, 20 in MLflow; 30 only on disk
    for name in behind:
        _run_folder_behind_a_dead_server(trials / name, uri, "test-replay-trials")
    for name in ("trained", "reported"):
        (trials / name / "summary.json").write_text(json.dumps({"steps": 30}))
    whole = MlflowTracker("test-replay-trials", "whole", tracking_uri=uri)  # nothing missed
    JsonlTracker(trials / "whole").log_metrics({"train/loss": 0.5}, step=10)
    whole.log_metrics({"train/loss": 0.5}, step=10)
    write_run_ref(trials / "whole", whole.run_id, uri)
    (trials / "opened").mkdir()  # killed before its MLflow run was opened: nothing to send
    JsonlTracker(trials / "opened").log_metrics({"train/loss": 1.0}, step=10)
    runs = [*behind, "whole", "opened", "never-ran"]
    assert replay_trials(runs, trials, uri) == len(behind)
    client = mlflow.MlflowClient(uri)
    for name in (*behind, "whole"):
        run_id = read_run_ref(trials / name)["run_id"]
        logged = {(r["step"], r["train/loss"]) for r in read_metrics(trials / name)}
        history = client.get_metric_history(run_id, "train/loss")
        assert {(m.step, m.value) for m in history} == logged, name
    out = capsys.readouterr().out
    assert out.count("MLflow lacked 1 metric point(s)") == len(behind), out
    assert replay_trials(runs, trials, uri) == 0  # nothing twice
    # A row written after the last sync (a worker that outlived the kill) is sent too.
    JsonlTracker(trials / "whole").log_metrics({"train/loss": 0.25}, step=20)
    assert replay_trials(runs, trials, uri) == 1
    history = client.get_metric_history(whole.run_id, "train/loss")
    assert sorted(m.step for m in history) == [10, 20]
    dead = "http://127.0.0.1:9"  # a store out of reach: one line, no exception
    JsonlTracker(trials / runs[0]).log_metrics({"train/loss": 0.5}, step=40)
    assert replay_trials(runs[:1], trials, dead) == 0
    assert capsys.readouterr().out.count("warning: cannot sync") == 1


def test_a_trials_downstream_scores_reach_mlflow_after_its_step_met_an_outage(store, tmp_path):
    """A trial's downstream step that starts while the tracking server does not answer turns
    its tracker off: its scores are only in the folder's downstream.json. The sweep's end (and
    `hlm sync`) sends them at step 0, where the step logs them (finite ones, as it does); a
    trial whose step did log them costs the sweep's end no MLflow round trip."""
    import json
    import math

    from hlm_ray.tracking.sync import logged_downstream, maybe_unsynced, sync_run
    from hlm_ray.tune.replay import replay_trials

    uri, trials = store[1], tmp_path / "trials"
    scores = {"downstream/score": 0.25, "lambada/accuracy": 0.25, "bpb": 1.5, "none": math.nan}
    runs = {}
    for name in ("missed", "logged"):
        tracker = MlflowTracker("test-downstream-replay", name, tracking_uri=uri)
        JsonlTracker(trials / name).log_metrics({"train/loss": 1.0}, step=10)
        tracker.log_metrics({"train/loss": 1.0}, step=10)
        write_run_ref(trials / name, tracker.run_id, uri)
        sync_run(trials / name)  # the end of its training: MLflow has every row
        (trials / name / "downstream.json").write_text(json.dumps(scores))
        if name == "logged":
            tracker.log_metrics({k: v for k, v in scores.items() if math.isfinite(v)}, step=0)
            logged_downstream(trials / name)
        runs[name] = tracker.run_id
    assert maybe_unsynced(trials / "missed") and not maybe_unsynced(trials / "logged")
    assert replay_trials(list(runs), trials, uri) == 3
    client = mlflow.MlflowClient(uri)
    for run_id in runs.values():
        metrics = client.get_run(run_id).data.metrics
        assert {k: metrics.get(k) for k in scores} == {**scores, "none": None}
        assert [m.step for m in client.get_metric_history(run_id, "downstream/score")] == [0]
    assert replay_trials(list(runs), trials, uri) == 0  # nothing twice


def test_compare_figures_log_loss_axes_are_labelled_in_plain_numbers(tmp_path, monkeypatch):
    """A loss curve inside one decade was labelled `6×10⁰`, `6.8×10⁰` (one panel with only two
    labels): plain numbers now, several of them."""
    import json

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from hlm_ray.train.summary import plot_runs

    run = tmp_path / "vanilla"
    run.mkdir()
    rows = [{"step": s, "train/loss": 6.9 - 0.026 * s} for s in range(1, 51)]  # 6.87 -> 5.6
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"tokens_per_s": 100.0}))
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: saved.append(fig))
    plot_runs([run], tmp_path / "compare.png")
    [fig] = saved
    FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    shown = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)
             if t.get_text() and low <= t.get_position()[1] <= high]  # fmt: skip
    assert len(shown) >= 4 and not any("times" in s or "^" in s for s in shown), shown
    assert all(float(s) for s in shown)
