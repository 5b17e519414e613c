"""docs/walkthrough.md run as a reader runs it: the fenced bash block under "## The commands",
exactly as written, in order, in a fresh folder.

    PYTHONPATH=. python -m pytest -q tests/test_walkthrough.py

The block runs under `bash` with `set -euo pipefail` (a command that fails fails the test) in
`tmp_path`, where `.venv` is a link to the Python running the tests. The environment adds only
what the page leaves to the machine: `HLM_DATA_DIR` (the shipped data), the session's MLflow store
(`MLFLOW_TRACKING_URI`, set by conftest.py) and no `RAY_ADDRESS`, so each command starts and
stops its own local Ray, as on a reader's machine (the session's cluster stays the tests'). The
block runs in a process group of its own: whatever is left of it afterwards (the server, if the
page did not stop it) is ended through that group, never by name.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "walkthrough.md"
HEADING = "## The commands"
PORT = 8000  # `hlm serve`'s default, which the page uses
DEADLINE_S = 900  # the whole block; about three minutes on 2 idle cores


def walkthrough_block(text: str) -> str:
    """The first fenced bash block after the "## The commands" heading."""
    assert HEADING in text, f"{PAGE.name} has no {HEADING!r} heading"
    match = re.search(r"^```bash\n(.*?)^```", text.split(HEADING, 1)[1], re.M | re.S)
    assert match, f"no ```bash block under {HEADING!r} in {PAGE.name}"
    return match[1]


def completion(log: str) -> dict:
    """The completion object curl printed (other output may follow it on the same line)."""
    start = log.rfind('{"id"')
    assert start >= 0, f"no completion in the output:\n{log[-3000:]}"
    return json.JSONDecoder().raw_decode(log[start:])[0]


def test_the_block_takes_each_stage_once():
    """Plain: the block is found and runs each stage of the path exactly once, in order."""
    block = walkthrough_block(PAGE.read_text())
    stages = ["hlm train ", "hlm finetune --task clm ", "hlm eval ", "hlm serve ", "curl -s "]
    starts = [block.find(s) for s in stages]
    assert all(i >= 0 for i in starts), dict(zip(stages, starts, strict=True))
    assert starts == sorted(starts), "the stages are out of order"
    for stage in stages[:4]:
        assert block.count(stage) == 1, f"{stage!r} appears {block.count(stage)} times"
    assert "--register hlm-walkthrough" in block and "models:/hlm-walkthrough/1" in block
    assert "Authorization: Bearer $HLM_API_KEY" in block


@pytest.mark.slow
@pytest.mark.ray
def test_the_walkthrough_runs_as_written(tmp_path):
    from hlm_ray.paths import data_dir

    with socket.socket() as probe:  # the page serves on the default port
        try:
            probe.bind(("127.0.0.1", PORT))
        except OSError as err:
            pytest.fail(f"port {PORT}, which the walkthrough serves on, is taken: {err}")
    (tmp_path / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    script = tmp_path / "walkthrough.sh"
    script.write_text("set -euo pipefail\n" + walkthrough_block(PAGE.read_text()))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["HLM_DATA_DIR"] = str(data_dir())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    log_path = tmp_path / "walkthrough.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            ["bash", str(script)],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, to stop what it leaves behind
        )
    try:
        try:
            code = proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"not done in {DEADLINE_S} s:\n{log_path.read_text()[-4000:]}")
        log = log_path.read_text()
        assert code == 0, f"the walkthrough failed (exit {code}):\n{log[-4000:]}"
        reply = completion(log)
        assert reply["object"] == "text_completion", reply
        assert reply["model"].startswith("hlm-walkthrough"), reply  # the registered model
        choice = reply["choices"][0]
        assert isinstance(choice["text"], str) and choice["finish_reason"] in ("length", "stop")
        assert reply["usage"]["prompt_tokens"] > 0, reply
        runs = tmp_path / "runs" / "walkthrough"
        assert (runs / "generator" / "model" / "config.json").is_file()
        for task in ("lambada", "bpb"):
            assert (runs / "eval" / f"eval_{task}.json").is_file(), f"no eval_{task}.json"
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """Wait for the block's process group to end (the page stops its server), then end what is
    left: SIGTERM (the server's clean shutdown; Ray's processes exit on it), then SIGKILL."""
    for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        if sig is not None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the block's shell: a zombie still counts as a group member
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)
