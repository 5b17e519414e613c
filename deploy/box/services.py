"""The cluster box's services, on the head's network as a cluster's are in its own: PostgreSQL,
an S3 server (moto's) with the runs' and MLflow's buckets, and `mlflow server` over both.

`Services` is a part of `box.Box`: it starts each in the head's namespace and waits until it
answers.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from nodes import HEAD_CLIENT_IP, HEAD_IP, PORTS, START_TIMEOUT_S

RUN_BUCKET = "hlm-runs"  # the runs' object storage (s3://hlm-runs/...)
ARTIFACT_BUCKET = "hlm-mlflow"  # MLflow's artifact store
# moto accepts any credentials; a cluster's pods get theirs from a Secret.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "hlm-box",
    "AWS_SECRET_ACCESS_KEY": "hlm-box-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def pg_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    if not found and shutil.which("postgres"):
        found = [Path(shutil.which("postgres"))]
    return found[-1].parent if found else None


class Services:
    """The services of a `box.Box`, each in the head's network namespace."""

    def _postgres(self) -> None:
        pgbin = pg_bin()
        name, user = _unprivileged()
        folder = self.root / "pg"
        folder.mkdir()
        os.chown(folder, user["user"], user["group"])
        # The database's user must get through the box's folder (mkdtemp makes it 0700).
        self.root.chmod(self.root.stat().st_mode | 0o711)
        done = subprocess.run([pgbin / "initdb", "-D", folder / "data", "-U", "mlflow",
                               "--auth=trust", "-E", "UTF8", "--no-sync"], cwd=folder,
                              capture_output=True, text=True, **user)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr.strip()[-500:]}")
        # runuser after `ip netns exec`: entering the namespace needs root.
        self.spawn("head", ["runuser", "-u", name, "--", str(pgbin / "postgres"),
                            "-D", str(folder / "data"), "-h", "127.0.0.1",
                            "-p", str(PORTS["pg"]), "-k", str(folder), "-c", "fsync=off"],
                   "postgres.log", private=False)  # fmt: skip
        address = ["-h", "127.0.0.1", "-p", str(PORTS["pg"]), "-U", "mlflow"]
        ns = ["ip", "netns", "exec", self.nodes["head"].netns]
        ready = [*ns, pgbin / "pg_isready", *address, "-d", "postgres"]
        wait_until(lambda: subprocess.run(ready, capture_output=True).returncode == 0,
                   "PostgreSQL", self.log("postgres.log"))  # fmt: skip
        subprocess.run([*ns, pgbin / "createdb", *address, "mlflow"], check=True,
                       capture_output=True)  # fmt: skip

    def _object_store(self) -> None:
        moto = Path(sys.executable).with_name("moto_server")
        self.spawn("head", [str(moto), "-H", "0.0.0.0", "-p", str(PORTS["s3"])], "s3.log",
                   private=False)  # fmt: skip

    def _buckets(self) -> None:
        """Once the S3 server answers: the runs' and MLflow's buckets."""
        wait_until(lambda: self._http_ok("head", f"http://{HEAD_IP}:{PORTS['s3']}/"),
                   "the S3 server", self.log("s3.log"))  # fmt: skip
        script = (
            f"import boto3; s3 = boto3.client('s3', endpoint_url={self.s3!r})\n"
            f"for b in ({RUN_BUCKET!r}, {ARTIFACT_BUCKET!r}): s3.create_bucket(Bucket=b)"
        )
        done = self.run("head", [sys.executable, "-c", script])
        if done.returncode != 0:
            raise RuntimeError(f"could not create the buckets: {done.stderr[-500:]}")

    def _mlflow(self) -> None:
        argv = [sys.executable, "-m", "mlflow", "server",
                "--backend-store-uri",
                f"postgresql+psycopg2://mlflow@127.0.0.1:{PORTS['pg']}/mlflow",
                "--artifacts-destination", f"s3://{ARTIFACT_BUCKET}/artifacts",
                "--host", "0.0.0.0", "--port", str(PORTS["mlflow"]), "--workers", "1",
                # MLflow answers 403 to a Host header outside this list (its guard against DNS
                # rebinding; by default loopback and RFC 1918 addresses): the name the nodes
                # use, and the address the client reaches it at.
                "--allowed-hosts", f"mlflow:{PORTS['mlflow']},{HEAD_CLIENT_IP}:{PORTS['mlflow']},"
                "localhost:*,127.0.0.1:*"]  # fmt: skip
        local_s3 = f"http://127.0.0.1:{PORTS['s3']}"  # the server shares the head's network
        env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_S3_ENDPOINT_URL": local_s3,
               "AWS_ENDPOINT_URL": local_s3}  # fmt: skip
        self.spawn("head", argv, "mlflow.log", env=env, private=False)
        wait_until(lambda: self._http_ok("head", f"http://{HEAD_IP}:{PORTS['mlflow']}/health"),
                   "the MLflow server", self.log("mlflow.log"))  # fmt: skip

    def mlflow_pids(self) -> list[int]:
        """The MLflow server's processes: `mlflow server` and every process under it."""
        roots = [pid for pid in self.pids("head") if b"mlflow\0server" in _cmdline(pid)]
        found, todo = [], list(roots)
        while todo:
            pid = todo.pop()
            found.append(pid)
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                with contextlib.suppress(OSError):
                    todo += [int(c) for c in task.read_text().split()]
        return found

    def signal_mlflow(self, sig: int) -> list[int]:
        """`sig` to every process of the MLflow server (SIGSTOP: it hangs, its connections
        open; SIGCONT: it answers again). The pids."""
        pids = self.mlflow_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def restart_mlflow(self) -> None:
        """The MLflow server killed (stopped or not) and started again, on the same store."""
        for pid in self.signal_mlflow(signal.SIGKILL):
            deadline = time.monotonic() + 30
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        self._mlflow()

    def _http_ok(self, node: str, url: str) -> bool:
        probe = f"import urllib.request as u; u.urlopen({url!r}, timeout=2)"
        ns = ["ip", "netns", "exec", self.nodes[node].netns, sys.executable, "-c", probe]
        return subprocess.run(ns, capture_output=True).returncode == 0


def _unprivileged() -> tuple[str, dict]:
    """The user PostgreSQL runs as (it refuses root): its name, and Popen's arguments."""
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return name, {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    raise SystemExit("error: no unprivileged user (postgres, nobody) to run PostgreSQL as")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def wait_until(ready, what: str, log: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no log)"
            raise RuntimeError(f"{what} did not start within {timeout_s:.0f} s: {tail}")
        time.sleep(0.5)
