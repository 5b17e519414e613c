"""One writer per run folder: a lock its driver holds, and orphaned workers that stop writing.

    release = acquire(out_dir)        # `hlm train`: from launch.json on (HLMError if taken)
    @holding(check_output)            # `launch`, `train_local`: for the whole run
    def launch(cfg, ...): ... loop_config["writer"] = token(out_dir)
    watch(out_dir, writer)            # rank 0 of the Ray Train workers, at its start
    check_writer()                    # before each write: WriterGone once the driver is gone

The lock is `flock` on `<run>/.hlm-writer.lock`, taken by the driver (`hlm train`, or the
trial that launches a sweep's run) before it writes anything and held until the run is over.
The kernel releases it when the process ends, however it ends (SIGKILL and a crash included),
so a dead writer never leaves it behind; while it is held, a second `hlm train` on the folder is
refused in one line naming the holder (pid, host, start). The file also holds the holder's
token, which its Ray Train workers are given.

A Ray Train worker runs in a process group of its own and outlives a SIGKILLed driver for up to
a minute (until it sees its raylet gone): long enough to write the last checkpoint, the model
and `summary.json` while the user is already resuming. So rank 0, before each write (a metrics
line, a checkpoint, the final model, the summary), checks that its driver still holds the lock:
a non-blocking shared lock on the file fails while the driver holds it, and succeeds once it is
gone; a token in the file that is not its own means another driver has taken the folder. Then
the worker stops (`WriterGone`) without writing.

What the lock covers: a run folder on a local disk, and on NFS (Linux's NFS client turns flock
into the server's byte-range locks, so it holds across machines; a machine that dies holding
it releases it when its lease expires, 90 s for NFSv4). It cannot cover an object store: with
run storage in S3 (or any storage other than the run folder's parent), rank 0 writes its own
node's copy of the run folder and mirrors it; on another node than the driver that copy has no
lock file, so that worker cannot tell, and does not check (its driver's node has the lock, and
Ray stops the workers of a driver whose cluster is gone once their raylet notices).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import socket
import time
import uuid
from pathlib import Path

from hlm_ray.errors import HLMError

LOCK_FILE = ".hlm-writer.lock"
TAKE_S = 2.0
"""How long a driver retries a taken lock: a worker's check holds it shared for microseconds."""

_held: dict[str, list] = {}  # realpath -> [file, token, holds]: this process's locks
_watched: tuple[Path, str] | None = None  # (lock file, its driver's token): in a worker


class WriterGone(RuntimeError):
    """This worker's driver is gone or another driver took the run folder: it stops writing."""


def acquire(
    out_dir: str | Path, fix: str = "wait for it to end or stop it, or choose another --output"
):
    """Take the run folder's lock (again, if this process holds it); returns the function that
    releases this hold. `HLMError` when another process holds it, ending in `fix`."""
    out_dir = Path(out_dir)
    key = os.path.realpath(out_dir)
    if key in _held:
        _held[key][2] += 1
        return functools.partial(_release, key)
    created = [p for p in [out_dir, *out_dir.parents] if not p.exists()]
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = open(out_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held past this function
    deadline = time.monotonic() + TAKE_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                holder = _describe(lock)
                lock.close()
                raise HLMError(
                    f"{out_dir} is being written by another process ({holder}); {fix}"
                ) from None
            time.sleep(0.05)
    token = uuid.uuid4().hex
    lock.seek(0)
    lock.truncate()
    lock.write(json.dumps({"token": token, "pid": os.getpid(), "host": socket.gethostname(),
                           "since": time.strftime("%Y-%m-%d %H:%M:%S")}))  # fmt: skip
    lock.flush()
    os.fsync(lock.fileno())  # another machine (NFS) reads it from the server
    _held[key] = [lock, token, 1, created]
    return functools.partial(_release, key)


def _release(key: str) -> None:
    entry = _held.get(key)
    if entry is None:
        return
    entry[2] -= 1
    if entry[2] > 0:
        return
    del _held[key]
    lock, _, _, created = entry
    folder = Path(key)
    with contextlib.suppress(OSError):  # refused before it wrote: leave no trace
        if [p.name for p in folder.iterdir()] == [LOCK_FILE]:
            (folder / LOCK_FILE).unlink()
            for path in created:
                path.rmdir()
    lock.close()  # closing the file releases the lock


def token(out_dir: str | Path) -> str | None:
    """The token of this process's hold on `out_dir`'s lock (None when it holds none)."""
    entry = _held.get(os.path.realpath(out_dir))
    return entry[1] if entry else None


def holding(check):
    """Decorate `fn(cfg, ...)` to run holding the lock of `cfg.run.output_dir`, taken once
    `check(out_dir)` (that the folder can be written: its own one-line errors) has passed."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(cfg, *args, **kwargs):
            check(Path(cfg.run.output_dir))
            release = acquire(cfg.run.output_dir)
            try:
                return fn(cfg, *args, **kwargs)
            finally:
                release()

        return wrapper

    return decorate


def _describe(lock) -> str:
    lock.seek(0)
    try:
        info = json.loads(lock.read())
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (ValueError, KeyError, TypeError):
        return "a process that holds its lock"


def watch(out_dir: str | Path, writer: str | None) -> None:
    """In a worker: check its driver (`writer`: the token of the driver's hold) before writes."""
    global _watched
    _watched = (Path(out_dir) / LOCK_FILE, writer) if writer else None


def check_writer() -> None:
    """Raise `WriterGone` when the watched driver is gone or replaced (no-op unwatched, and
    where the run folder has no lock file: another node's copy, see the module doc)."""
    if _watched is None:
        return
    path, mine = _watched
    try:
        lock = open(path)  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return
    with lock:
        try:
            holder = json.loads(lock.read() or "{}").get("token")
        except ValueError:
            holder = None  # being rewritten by a new driver this instant
        if holder != mine:
            raise WriterGone(
                f"another process has taken {path.parent} ({_describe(lock)}): this worker of "
                "the earlier run stops without writing"
            )
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # the driver holds it: alive
        with contextlib.suppress(OSError):
            fcntl.flock(lock, fcntl.LOCK_UN)
    raise WriterGone(
        f"the driver of {path.parent} is gone (its lock is free): this orphaned worker stops "
        "without writing; continue the run with hlm train --resume"
    )
