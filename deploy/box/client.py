"""The client's tools for the cluster box's scenarios: what a user on a laptop does with a
cluster (`ray job submit` with the token, the Job API, MLflow through the tracking server),
from the client namespace, and the names every scenario's runs and jobs share.
"""

from __future__ import annotations

import json
import re
import time

from box import RUN_BUCKET, WORKERS, Box, last_json

ENDED = ("SUCCEEDED", "FAILED", "STOPPED")  # a job's final states
EXPERIMENT = "hlm_ray"  # `hlm train`'s
SWEEP_EXPERIMENT = "hlm_ray-sweeps"  # every sweep's (SweepSpec.experiment)
TRAIN = ["hlm", "train", "--preset", "tiny-decoder", "--set", "run.log_every=1"]
VOCAB_SWEEP = ["python", "sweeps/vocab.py", "--preset", "tiny"]
S3_RUNS = f"s3://{RUN_BUCKET}/runs"
TAG = time.strftime("%H%M%S")
"""In every run, sweep and job name: scenarios run again on a box that is up (`--reuse`) make
new ones (Ray refuses a job id twice; `hlm train` an output folder that exists)."""
S3_SWEEPS = f"s3://{RUN_BUCKET}/sweeps"


def submit(box: Box, argv: list[str], *, job: str, env: dict | None = None,
           wait: bool = True, timeout: float = 900) -> str:  # fmt: skip
    """`RAY_AUTH_MODE=token ray job submit --working-dir . -- argv` from the client; the job's
    output (waited for), or "" (`wait` False: follow it with `wait_log` and `wait_job`)."""
    cmd = ["ray", "job", "submit", "--submission-id", job, "--working-dir", "."]
    if env:
        cmd += ["--runtime-env-json", json.dumps({"env_vars": env})]
    if not wait:
        cmd.append("--no-wait")
    done = box.client([*cmd, "--", *argv], timeout=timeout)
    if wait:  # the CLI asks the Job API for the job's state once its logs end, and prints it
        said = done.stdout + done.stderr
        assert done.returncode == 0 and f"Job '{job}' succeeded" in said, (
            f"job {job} ({' '.join(argv)}) did not succeed: {said[-3000:]}"
        )
    return done.stdout


def wait_job(box: Box, job: str, timeout: float = 900) -> dict:
    """The job's end: {"status": ..., "logs": ...}."""
    state = view(box, "wait", job, "", str(timeout), timeout=timeout + 120)
    assert state["status"] in ENDED, f"job {job} still {state['status']} after {timeout:.0f} s"
    return state


def wait_log(box: Box, job: str, pattern: str, timeout: float = 600) -> re.Match:
    state = view(box, "wait", job, pattern, str(timeout), timeout=timeout + 120)
    found = re.search(pattern, state["logs"])
    if found:
        return found
    assert state["status"] not in ENDED, state["logs"][-3000:]
    raise AssertionError(f"job {job}: no {pattern!r} after {timeout:.0f} s")


def view(box: Box, *args: str, timeout: float = 300):
    """deploy/box/view.py from the client: what MLflow and the Job API hold."""
    done = box.client(["python", "deploy/box/view.py", *args], timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return last_json(done.stdout)


def one_run(box: Box, name: str) -> dict:
    found = view(box, "run", EXPERIMENT, name)
    assert len(found) == 1, f"{len(found)} MLflow runs named {name}"
    return found[0]


def worker_ips(box: Box) -> set[str]:
    return {box.nodes[name].ip for name in WORKERS}


def node_of(box: Box, ip: str) -> str:
    return next(name for name, node in box.nodes.items() if node.ip == ip)


def prepared_on_node(box: Box, name: str) -> list[str]:
    """The prepared corpora a node made in its own cache (not copies fetched from storage)."""
    done = box.run(name, ["sh", "-c", "ls $HOME/.cache/hlm_ray/prepared 2>/dev/null || true"])
    return [n for n in done.stdout.split() if n != "fetched"]


def complete_steps(run: dict, key: str, steps: int) -> None:
    got = run["steps"].get(key, [])
    assert got == list(range(1, steps + 1)), f"{run['name']}: {key} at {len(got)} of {steps} steps"
