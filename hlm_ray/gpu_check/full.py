"""The full tier: Ray and MLflow on the GPU. Run only where both import (else SKIP rows).

  from hlm_ray.gpu_check.full import check_ray_train
  row = check_ray_train(Path("runs/gpu-check"))

tests       the gpu-marked tests (pytest -m gpu; needs pytest)
ray_train   `hlm train --gpu --num-workers 1`: a 1-GPU Ray Train run (NCCL process group)
sweep       a 2-trial vocabulary sweep whose downstream step runs on the trial's GPU
serve       `hlm serve --device cuda` answering a completion
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from hlm_ray.gpu_check.bare import ROOT, corpus_overrides, trained
from hlm_ray.gpu_check.bare import run_module as _run
from hlm_ray.gpu_check.bare import tail as _tail
from hlm_ray.gpu_check.table import Row
from hlm_ray.tracking.server import free_port


def check_tests(out: Path) -> Row:
    proc = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"], 240)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    ok = proc.returncode == 0 and "passed" in last
    return Row("tests", "PASS" if ok else "MISS", last or f"exit {proc.returncode}")


def check_ray_train(out: Path) -> Row:
    """A 1-GPU Ray Train run (its process group is NCCL on a GPU): bf16, the loss falling."""
    from hlm_ray.tracking import read_metrics

    folder = out / "ray-train"
    sets = ["optim.max_steps=40", "optim.precision=bf16", "run.log_every=10",
            "run.eval_every=40", "run.checkpoint_every=40", *corpus_overrides(out)]  # fmt: skip
    cmd = [sys.executable, "-m", "hlm_ray.cli", "train", "--preset", "tiny-decoder",
           "--objective", "headless", "--gpu", "--num-workers", "1", "--device", "cuda",
           "--output", str(folder), *[a for s in sets for a in ("--set", s)]]  # fmt: skip
    started = time.perf_counter()
    # NCCL names itself in the workers' logs (this run only: the later checks stay quiet).
    proc = _run(cmd, 300, env={"NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "INFO")})
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        return Row("ray_train", "MISS", f"hlm train exited {proc.returncode}: {_tail(proc)}")
    losses = [r["train/loss"] for r in read_metrics(folder) if "train/loss" in r]
    nccl = "NCCL INFO" in (proc.stdout + proc.stderr)
    ok = len(losses) > 1 and losses[-1] < losses[0]
    figures = (
        f"loss {losses[0]:.2f}→{losses[-1]:.2f} in {wall:.0f} s; NCCL in the logs: "
        f"{'yes' if nccl else 'not seen'}"
    )
    return Row("ray_train", "PASS" if ok else "MISS", figures)


def check_sweep(out: Path) -> Row:
    name = f"gpu-check-{int(time.time())}"
    cmd = [
        sys.executable,
        str(ROOT / "sweeps" / "vocab.py"),
        "--preset",
        "tiny",
        "--name",
        name,
        "--gpus-per-worker",
        "1",
        "--set",
        "sweep.values=[512]",
    ]
    started = time.perf_counter()
    proc = _run(cmd, 300, cwd=out)
    wall = time.perf_counter() - started
    folder = out / "runs" / "sweeps" / name
    devices = sorted(
        {
            json.loads(p.read_text())["settings"]["device"]
            for p in folder.glob("trials/*/downstream/**/classify_*.json")
        }
    )
    ok = proc.returncode == 0 and devices and all(d.startswith("cuda") for d in devices)
    return Row(
        "sweep",
        "PASS" if ok else "MISS",
        f"2 trials in {wall:.0f} s, downstream on {','.join(devices) or 'nothing found'}"
        + ("" if proc.returncode == 0 else f"; exit {proc.returncode}: {_tail(proc)}"),
    )


def check_serve(out: Path) -> Row:
    model = trained(out, "tiny-decoder", "vanilla")[0] / "model"
    port = free_port()
    log = (out / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hlm_ray.cli", "serve", "--model", str(model), "--device", "cuda",
         "--num-gpus", "1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        body = json.dumps({"prompt": "The", "max_tokens": 8}).encode()
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/completions",
                    data=body,
                    headers={"content-type": "application/json"},
                )
                started = time.perf_counter()
                with urllib.request.urlopen(req, timeout=30) as reply:
                    answer = json.loads(reply.read())
                ms = (time.perf_counter() - started) * 1000
                text = answer["choices"][0]["text"]
                return Row("serve", "PASS", f"completion of {len(text)} chars in {ms:.0f} ms")
            except OSError:
                time.sleep(2)
        return Row("serve", "MISS", f"no answer in 180 s; see {out / 'serve.log'}")
    finally:
        os.killpg(proc.pid, 2)  # SIGINT: serve shuts its Ray down
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
