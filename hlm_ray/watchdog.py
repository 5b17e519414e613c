"""Child processes that never outlive the process that started them.

    process = spawn_guarded(["python", "-m", "mlflow", "server", ...], stdout=log)
    ...
    process.terminate_group()     # or: the starting process dies (even by SIGKILL)

`spawn_guarded` runs the command under a small watchdog (``python -m hlm_ray.watchdog PID --
CMD...``) in a new process group. The watchdog asks the kernel for SIGTERM when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, Linux) and also checks its parent once a second (other systems,
or a parent that died before the request was made). Either way it stops the whole group: SIGTERM
first (an `mlflow server` and its uvicorn worker shut down cleanly on it; on SIGINT uvicorn
re-raised the signal as a KeyboardInterrupt, a traceback at the end of the server's log at every
normal stop), SIGKILL for whatever is left after `GRACE_S`. `stop_group` asks the watchdog. The sweep's local tracking server runs this way, so a killed sweep driver does
not leave it (and its ten worker processes) running.

Call `spawn_guarded` from the main thread: the kernel's parent-death signal follows the thread
that forked, not the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

GRACE_S = 5.0
PR_SET_PDEATHSIG = 1


def spawn_guarded(command: list[str], **popen_kwargs) -> subprocess.Popen:
    """Start `command` in its own process group, stopped with it when this process dies."""
    argv = [sys.executable, "-m", "hlm_ray.watchdog", str(os.getpid()), "--", *command]
    return subprocess.Popen(argv, start_new_session=True, **popen_kwargs)


def stop_group(process: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """Stop `process`'s group (as started by `spawn_guarded`): its watchdog stops the group
    (SIGTERM, then SIGKILL after `GRACE_S`); SIGKILL to all of it after `timeout_s`."""
    if process.poll() is not None:
        return
    try:
        process.send_signal(signal.SIGTERM)  # the watchdog: one signal each for the others
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=5)
    except ProcessLookupError:
        pass


def _ask_for_parent_death_signal(sig: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _stop_everything(child: subprocess.Popen) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    # The server's own workers may linger after it: nothing of the group survives.
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m hlm_ray.watchdog PARENT_PID -- COMMAND...", file=sys.stderr)
        return 2
    parent = int(argv[0])
    _ask_for_parent_death_signal(signal.SIGTERM)
    child = subprocess.Popen(argv[2:])  # same process group as this watchdog

    def on_signal(signum, frame):
        _stop_everything(child)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    while True:
        try:
            return child.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent:  # the parent died (we were re-parented)
            _stop_everything(child)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
