"""README.md's commands for a machine where another Ray already runs: that Ray holds the
default ports (GCS 6379, dashboard 8265, its agent 52365, the client server 10001), and
`ray job submit` as the README's first block writes it fails there. The README's second block,
run as written (its job's entrypoint swapped for a probe, the sweep itself is the demo's test),
starts a cluster beside it, submits to it, and the README's stop line
(`python -m hlm_ray.ray_stop <its session folder>`) stops it, all of it, and it alone.

Both clusters run in a network namespace of this test's own (loopback only), so the default
ports are free for the "other" Ray whatever else runs on the machine; a private HOME keeps the
token Ray writes (~/.ray) out of the user's. Skipped where namespaces cannot be made (not root,
no iproute2)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "--dashboard-port="  # the README block that moves the ports
PROBE = "python -c \"import ray; ray.init(); print('cpus', ray.cluster_resources()['CPU'])\""


def readme_block() -> str:
    """The README's bash block for a machine where another Ray runs."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (block,) = [b for b in blocks if MARK in b]
    return block


def _namespaces_reason() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs Linux and root (a network namespace of its own)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return None


def _kill_namespace(netns: str) -> None:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    for pid in out.split():
        subprocess.run(["kill", "-9", pid], capture_output=True)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True)


@pytest.mark.ray
@pytest.mark.slow
def test_the_readme_submits_beside_a_ray_that_holds_the_default_ports():
    reason = _namespaces_reason()
    if reason:
        pytest.skip(reason)
    block = readme_block()
    top = Path(tempfile.mkdtemp(prefix="rp", dir="/tmp"))  # short: Ray's socket paths
    mine = top / "mine"
    # Before its last line, the stop: the other Ray is up then too.
    assert block.strip().splitlines()[-1] == "python -m hlm_ray.ray_stop /tmp/ray-mine", block
    up = 'curl -s -o /dev/null http://127.0.0.1:8265 && echo "other before: up"\n'
    block = block.replace("python -m hlm_ray.ray_stop", up + "python -m hlm_ray.ray_stop")
    block = block.replace("/tmp/ray-mine", str(mine))
    left = f"from hlm_ray.ray_stop import cluster_processes; print('left', len(cluster_processes('{mine}')))"
    block = re.sub(r"-- \\\n\s*python sweeps/vocab.py --preset tiny", f"-- {PROBE}", block)
    assert PROBE in block, block
    script = f"""set -e
ip link set lo up
# the other Ray, on every default port
ray start --head --num-cpus=1 --dashboard-host=127.0.0.1 --temp-dir={top}/other \\
    --disable-usage-stats
{block}
curl -s -o /dev/null http://127.0.0.1:8275 && echo "mine after stop: up" || echo "mine after stop: down"
python -c "{left}"
curl -s -o /dev/null http://127.0.0.1:8265 && echo "other after stop: up"
"""
    netns = f"hlmtest-ports-{uuid.uuid4().hex[:6]}"
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(top / "home"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    # From a file: the stop matches command lines, and `bash -c` carries the script in its own.
    (top / "run.sh").write_text(script)
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        done = subprocess.run(
            ["ip", "netns", "exec", netns, "bash", str(top / "run.sh")],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=420,
        )
    finally:
        _kill_namespace(netns)
        shutil.rmtree(top, ignore_errors=True)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    assert "cpus 2.0" in said, said[-4000:]  # the job ran on the README's cluster (2 CPUs)
    assert "other before: up" in said and "other after stop: up" in said, said[-2000:]
    assert "mine after stop: down" in said and "left 0" in said, said[-2000:]
    assert re.search(r"stopped \d{2,} process\(es\) of the Ray cluster", said), said[-2000:]
