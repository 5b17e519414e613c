"""One local MLflow tracking server for a sweep's concurrent trials.

    with tracking_server(log_file=folder / "mlflow_server.log") as uri:
        ...  # every trial logs to `uri` (http://127.0.0.1:PORT)

Many processes writing one sqlite file fail with "database is locked"; a server serialises the
writes. When ``MLFLOW_TRACKING_URI`` already names a server (http/https) or another database,
it is used as is. Otherwise (unset, or a sqlite file) a server is started on loopback over the
same sqlite store and artifact folder the embedded tracker uses
(`hlm_ray.tracking.store.default_tracking_uri`), so ``mlflow ui --backend-store-uri sqlite:///mlflow.db``
shows the sweep afterwards; it is stopped when the block exits (and at interpreter exit), and
runs under `hlm_ray.watchdog`, so it also dies with a driver killed by SIGKILL.

MLflow prints a "View run ... at: http://127.0.0.1:PORT/..." line whenever a run ends on an
HTTP store: links to this server die with it. While it runs, `QUIET_LINKS` is set in this
process (and a sweep passes it to its trials); the sweep prints `store.browse_hint` instead.

The server runs as ``python -m mlflow server`` (a subprocess: this module does not import
mlflow). Start-up takes 10-45 s on a busy 2-core machine (more on a fresh store: it migrates).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hlm_ray.errors import HLMError
from hlm_ray.tracking.store import default_tracking_uri, sqlite_path
from hlm_ray.watchdog import spawn_guarded, stop_group

START_TIMEOUT_S = 180.0
QUIET_LINKS = {"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}


@contextmanager
def tracking_server(
    log_file: Path,
    *,
    timeout_s: float = START_TIMEOUT_S,
    while_starting: Callable[[], None] | None = None,
) -> Iterator[str]:
    """The tracking URI the sweep's trials use; starts and stops a local server if needed.

    `while_starting` runs after the server process is spawned and before it is waited for
    (Ray start-up, data preparation): its 10-45 s of start-up then overlap other work, the
    migrations of a new store included (while the sweeps started beside it wait on the lock)."""
    uri = default_tracking_uri()
    db = sqlite_path(uri)
    if uri.startswith(("http://", "https://")) or db is None:
        if while_starting is not None:
            while_starting()
        yield uri
        return
    # The artifact folder `MlflowTracker` gives experiments it creates on a sqlite store.
    server = LocalServer(db, db.resolve().parent / "mlartifacts", log_file)
    saved = {key: os.environ.get(key) for key in QUIET_LINKS}
    try:
        os.environ.update(QUIET_LINKS)
        with creating_store(db) as fresh:
            server.spawn()
            if fresh:  # the sweeps started beside this one wait (on the lock) for its migrations
                _overlap_then_wait(server, while_starting, timeout_s, migrating=True)
        if not fresh:
            _overlap_then_wait(server, while_starting, timeout_s, migrating=False)
        yield server.uri
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _overlap_then_wait(
    server: LocalServer,
    while_starting: Callable[[], None] | None,
    timeout_s: float,
    *,
    migrating: bool,
) -> None:
    """`while_starting` (Ray's start-up) while the spawned server starts, migrating a new store
    included, then the wait for its health check. When `while_starting` fails (bad input, Ray
    not starting, Ctrl-C) on a new store, the migrations still finish before the error goes on
    and the server is stopped: a server stopped halfway leaves a store MLflow cannot open
    again ("table ... already exists")."""
    if while_starting is not None:
        try:
            while_starting()
        except BaseException:
            if migrating:
                with contextlib.suppress(HLMError):  # the first error is the one to report
                    server.wait_ready(timeout_s)
            raise
    server.wait_ready(timeout_s)


@contextmanager
def creating_store(db: Path) -> Iterator[bool]:
    """Whether `db` is yet to be created, under a lock held for the block when it is.

    Two servers started at once on a sqlite file that does not exist both run MLflow's schema
    migrations, and one fails ("table latest_metrics already exists"). The first process to take
    the lock (``<db>.lock``, beside it) creates the store while the others wait; once it exists,
    servers start side by side as before."""
    db.parent.mkdir(parents=True, exist_ok=True)
    with db.with_name(db.name + ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield not db.exists()


class LocalServer:
    """``mlflow server`` on 127.0.0.1 over `db` (sqlite) with artifacts in `artifacts`."""

    def __init__(self, db: Path, artifacts: Path, log_file: Path):
        self.db = db
        self.artifacts = artifacts
        self.log_file = Path(log_file)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self._spawned = time.monotonic()

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.db}",
            # New experiments keep their artifacts in the folder the embedded store uses,
            # written directly by the (local) clients; --artifacts-destination is where
            # proxied uploads (mlflow-artifacts:/) would go: the same folder.
            "--default-artifact-root",
            self.artifacts.as_uri(),
            "--artifacts-destination",
            str(self.artifacts),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self.spawn()
        self.wait_ready(timeout_s)

    def spawn(self) -> None:
        """Start the server process; `wait_ready` waits for its health check."""
        self.db.parent.mkdir(parents=True, exist_ok=True)
        self.artifacts.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_file.open("ab")
        # Its own process group under a watchdog: stopping it also stops the server's worker
        # processes, and so does the death of this process, even by SIGKILL.
        # MLflow 3.x starts a job runner and 7 huey consumer processes beside every server (for
        # GenAI jobs a sweep never submits): 8 more Python processes importing mlflow, tens of
        # CPU-seconds of start-up on 2 cores and polling after. Off unless the user set it.
        env = {**os.environ}
        env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        self.process = spawn_guarded(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        atexit.register(self.stop)
        print(f"MLflow: starting a local tracking server at {self.uri} (store {self.db})")
        self._spawned = time.monotonic()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        start = self._spawned
        while not self._healthy():
            if self.process.poll() is not None:
                raise HLMError(
                    f"the local MLflow server exited with status {self.process.returncode}: "
                    f"{_tail(self.log_file)}; see {self.log_file}, or set MLFLOW_TRACKING_URI "
                    "to a running server"
                )
            if time.monotonic() - start > timeout_s:
                self.stop()
                raise HLMError(
                    f"the local MLflow server did not answer at {self.uri}/health within "
                    f"{timeout_s:.0f} s; see {self.log_file}, or set MLFLOW_TRACKING_URI "
                    "to a running server"
                )
            time.sleep(0.5)
        print(f"MLflow: server ready {time.monotonic() - start:.0f} s after its start")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            stop_group(process)  # SIGTERM: uvicorn's clean stop (`hlm_ray.watchdog`)


# Ray hands its workers ports 10002-19999; below 20000 a server would race them.
FIXED_PORTS = (20000, 32768)


def free_port() -> int:
    """A loopback port nothing listens on now, for a server that binds it a moment later.

    Picked outside the kernel's ephemeral range: a port the OS hands out (bind to 0, or
    any outgoing connection) can be taken by another process in the seconds before the server
    binds it. Two local Ray clusters starting at once open hundreds of such sockets, and one
    took a dashboard port chosen that way ("Failed to bind ... already occupied"). Outside the
    range only a process that names the same port can collide: 1 in ~12,000 per pair."""
    low, high = FIXED_PORTS
    high = min(high, _ephemeral_range()[0])
    for port in random.sample(range(low, high), min(64, max(high - low, 0))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))  # no fixed port free: let the OS pick
        return sock.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out (Linux's file; the IANA range elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"
