"""Stop the Ray cluster started with `ray start --temp-dir DIR`, and nothing else on the machine.

    python -m hlm_ray.ray_stop /tmp/ray-mine          # SIGTERM, SIGKILL what is left after 10 s

`ray stop` stops every Ray of the machine (another user's, another job's), and `pkill -f DIR`
matched 5 of the cluster's 20 or so processes: a worker's command line is `ray::IDLE`, the
dashboard's modules are forked. Every process of a cluster keeps files open in its session
folder under DIR (its logs: GCS, raylet, dashboard and its modules, agents, monitor, each
worker's stdout and stderr), so those processes are found by their open files, with DIR in a
command line as a second sign, and their descendants. The GCS server and the autoscaler monitor
outlived SIGTERM by half a minute: what is still there after the grace period gets SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

GRACE_S = 10.0


def cluster_processes(temp_dir: str | Path) -> list:
    """The processes of the cluster whose `--temp-dir` is `temp_dir` (psutil Processes), this
    process and its parents excluded."""
    import psutil

    root = os.path.realpath(temp_dir)
    inside = root + os.sep
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter():
        if proc.pid in mine:
            continue
        try:
            uses = any(inside in arg or arg == root for arg in proc.cmdline()) or any(
                os.path.realpath(f.path).startswith(inside) for f in proc.open_files()
            )
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if uses:
            found[proc.pid] = proc
    for proc in list(found.values()):
        with contextlib.suppress(psutil.NoSuchProcess):
            found.update({c.pid: c for c in proc.children(recursive=True) if c.pid not in mine})
    return list(found.values())


def stop(temp_dir: str | Path, grace_s: float = GRACE_S) -> int:
    """SIGTERM every process of the cluster, SIGKILL those left after `grace_s`; how many."""
    import psutil

    procs = cluster_processes(temp_dir)
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    return len(procs)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(
            "usage: python -m hlm_ray.ray_stop TEMP_DIR (the folder given to `ray start "
            "--temp-dir`; it must exist)",
            file=sys.stderr,
        )
        return 2
    started = time.monotonic()
    count = stop(argv[0])
    print(f"stopped {count} process(es) of the Ray cluster in {argv[0]} "
          f"({time.monotonic() - started:.0f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
