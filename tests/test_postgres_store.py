"""The cluster's tracking store for real: `mlflow server` over PostgreSQL, started as
deploy/README.md tells a cluster to start it (`--backend-store-uri postgresql+psycopg2://...`,
`--artifacts-destination`, the URI's scheme read from there), then a training run, a two-trial sweep and the registry's
register-then-load through it.

PostgreSQL runs from its own binaries in a temporary folder (Debian keeps them in
/usr/lib/postgresql/<version>/bin), as an unprivileged user when the tests run as root (initdb
refuses root), listening on 127.0.0.1. Skipped, with the reason, without the binaries or the
driver (`psycopg2-binary`, in the dev extra).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from sweep_common import EXPERIMENT, FAST, ROOT

from hlm_ray.paths import data_dir
from hlm_ray.tracking.server import free_port
from hlm_ray.watchdog import spawn_guarded, stop_group

SHAKESPEARE = data_dir() / "corpus" / "en" / "tinyshakespeare.txt"
START_TIMEOUT_S = 120.0

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def _postgres_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    if not found and shutil.which("postgres"):
        found = [Path(shutil.which("postgres"))]
    if not found:
        pytest.skip("PostgreSQL's server binaries (initdb, postgres) are not installed")
    return found[-1].parent  # the newest version


def _db_user() -> dict:
    """Popen's user/group for PostgreSQL: initdb and postgres refuse to run as root."""
    if os.geteuid() != 0:
        return {}
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    pytest.skip("running as root and no unprivileged user (postgres, nobody) to run PostgreSQL")


def _wait(ready, process: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{what} did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    """A PostgreSQL server with an empty database `mlflow` (owner `mlflow`, trust auth on
    loopback): yields its SQLAlchemy URI for MLflow. Stopped by its handle at the end."""
    pgbin = _postgres_bin()
    pytest.importorskip("psycopg2", reason="the PostgreSQL driver: pip install psycopg2-binary")
    as_user = _db_user()
    # Not under pytest's tmp folder: root's is closed (0700) to the unprivileged user.
    folder = Path(tempfile.mkdtemp(prefix="hlm-pg-"))
    if as_user:
        os.chown(folder, as_user["user"], as_user["group"])
    log = tmp_path_factory.mktemp("postgres") / "postgres.log"
    run = {"cwd": folder, "check": True, "capture_output": True, **as_user}
    port = free_port()
    server = None
    try:
        subprocess.run([pgbin / "initdb", "-D", folder / "data", "-U", "mlflow", "--auth=trust",
                        "-E", "UTF8", "--no-sync"], **run)  # fmt: skip
        with open(log, "wb") as out:
            server = subprocess.Popen(
                [pgbin / "postgres", "-D", folder / "data", "-h", "127.0.0.1", "-p", str(port),
                 "-k", folder, "-c", "fsync=off"],  # fmt: skip
                stdout=out, stderr=subprocess.STDOUT, cwd=folder, **as_user,
            )  # fmt: skip
        address = ["-h", "127.0.0.1", "-p", str(port), "-U", "mlflow"]

        def ready() -> bool:
            return subprocess.run([pgbin / "pg_isready", *address, "-d", "postgres"],
                                  capture_output=True).returncode == 0  # fmt: skip

        _wait(ready, server, "PostgreSQL", log)
        subprocess.run([pgbin / "createdb", *address, "mlflow"], **run)

        def sql(query: str) -> str:
            return subprocess.run([pgbin / "psql", *address, "-d", "mlflow", "-tAc", query],
                                  **run).stdout.decode().strip()  # fmt: skip

        yield f"{readme_scheme()}://mlflow@127.0.0.1:{port}/mlflow", sql
    finally:
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGINT)  # PostgreSQL's fast shutdown
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def _load_script(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"sweep_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_scheme() -> str:
    """The backend store's URI scheme in deploy/README.md's `mlflow server` command (the
    driver SQLAlchemy loads): the server here is started with the same."""
    text = (ROOT / "deploy" / "README.md").read_text()
    [uri] = re.findall(r"mlflow server\s*\\?\s*--backend-store-uri (\S+)", text)
    return uri.split("://", 1)[0]


def server_command(backend: str, artifacts: Path, port: int) -> list[str]:
    """deploy/README.md's `mlflow server` command, on loopback."""
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend,
            "--artifacts-destination", str(artifacts), "--host", "127.0.0.1",
            "--port", str(port), "--workers", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def pg_server(postgres, tmp_path_factory, mlflow_store):
    """`mlflow server` over the PostgreSQL store; MLFLOW_TRACKING_URI points at it for the
    module (the trials get it from the sweep). Stopped by its handle at the end."""
    import urllib.request

    backend, sql = postgres
    folder = tmp_path_factory.mktemp("pg_mlflow")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = folder / "server.log"
    with open(log, "wb") as out:
        process = spawn_guarded(server_command(backend, folder / "artifacts", port),
                                stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    try:
        _wait(ready, process, "mlflow server on PostgreSQL", log)
        os.environ["MLFLOW_TRACKING_URI"] = uri
        yield uri, sql
    finally:
        os.environ["MLFLOW_TRACKING_URI"] = mlflow_store
        stop_group(process)
    # A normal stop ends the server's log without a traceback (SIGINT left a KeyboardInterrupt).
    assert "Traceback" not in log.read_text().split("Shutting down")[-1]


@pytest.mark.ray
def test_train_sweep_and_registry_through_a_postgres_store(
    pg_server, ray_cluster, tmp_path, monkeypatch
):
    from mlflow import MlflowClient

    from hlm_ray.cli import main
    from hlm_ray.generate import Generator
    from hlm_ray.tracking import read_run_ref, register_model

    uri, sql = pg_server
    monkeypatch.chdir(tmp_path)
    client = MlflowClient(uri)

    # A training run (a tiny decoder, in process).
    out = tmp_path / "train"
    argv = ["train", "--local", "--preset", "tiny-decoder", "--objective", "vanilla", "--output",
            str(out), "--set", f"data.sources=[{SHAKESPEARE}]", "--set", "tokenizer.vocab_size=512"]  # fmt: skip
    for item in FAST:
        argv += ["--set", item]
    assert main(argv) == 0
    ref = read_run_ref(out)
    assert ref["tracking_uri"] == uri
    run = client.get_run(ref["run_id"])
    assert run.info.status == "FINISHED"
    assert 8 in {m.step for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert "config.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}

    # A one-trial sweep (one vocabulary size, headless) on the session's Ray cluster, run in
    # this process as `python sweeps/vocab.py` runs it, with its downstream step (logged into
    # the trial's run after training).
    sweep = ["--preset", "tiny", "--name", "vocab-pg"]
    for item in [*FAST, "sweep.values=[512]", "sweep.objectives=[headless]"]:
        sweep += ["--set", item]
    assert _load_script(ROOT / "sweeps" / "vocab.py").main(sweep) == 0
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], "tags.sweep = 'vocab-pg'")
    [parent] = [r for r in runs if r.data.tags.get("sweep_role") == "parent"]
    children = [r for r in runs if r.data.tags.get("sweep_role") != "parent"]
    assert parent.info.status == "FINISHED"
    assert [c.data.tags["objective"] for c in children] == ["headless"]
    for child in children:
        assert child.info.status == "FINISHED"
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert "downstream/score" in child.data.metrics
    assert "summary.csv" in {a.path for a in client.list_artifacts(parent.info.run_id)}

    # The registry: register the trained decoder, load it back by its URI.
    name, version = register_model(out / "model", "hlm-pg-generator", run_id=run.info.run_id)
    assert version == 1
    registered = Generator.load(f"models:/{name}/{version}")
    local = Generator.load(str(out / "model"))
    prompt = "The king said"
    assert [c.text for c in registered.generate(prompt, max_new_tokens=8, temperature=0)] == [
        c.text for c in local.generate(prompt, max_new_tokens=8, temperature=0)
    ]

    # All of it is in PostgreSQL: the server kept no other store.
    assert int(sql("select count(*) from runs where status = 'FINISHED'")) >= 3
    assert sql(f"select name from registered_models where name = '{name}'") == name
    assert int(sql(f"select count(*) from model_versions where name = '{name}'")) == 1
