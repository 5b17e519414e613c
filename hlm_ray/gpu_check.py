"""`make gpu-check`: validate a CUDA machine in one command (under ~9 minutes on one H100).

    python -m hlm_ray.gpu_check                  # every check; a PASS/MISS table at the end
    python -m hlm_ray.gpu_check --only train,xformers --output runs/gpu-check

Checks, each a row of the table with its figures:
  tests       the gpu-marked tests (pytest -m gpu)
  train       bf16 training of both objectives and both families (tiny presets, on cuda)
  xformers    the xformers attention backend against sdpa on the same weights (bf16)
  bench       `hlm bench --preset gpu --only train_step`: MFU of the GPT-2-small-size headless
              decoder, the strongest vanilla at V = 32k and 131k, peak memory (its targets)
  sweep       a 2-trial vocabulary sweep whose downstream step runs on the trial's GPU
  serve       `hlm serve --device cuda` answering a completion

Without a CUDA GPU it says so, runs nothing and exits 0: a CPU cannot validate any of this.
Exit status on a GPU: 0 when every check passed, 1 otherwise. The table is also written to
`<output>/gpu_check.md` for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CHECKS = ("tests", "train", "xformers", "bench", "sweep", "serve")
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    check: str
    verdict: str  # PASS | MISS
    figures: str
    seconds: float = 0.0


def format_table(rows: list[Row], device: str) -> str:
    lines = [
        f"gpu-check on {device}",
        "",
        "| check | verdict | figures | s |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r.check} | {r.verdict} | {r.figures} | {r.seconds:.0f} |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the checks


def check_tests(out: Path) -> Row:
    proc = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"], 240)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    ok = proc.returncode == 0 and "passed" in last
    return Row("tests", "PASS" if ok else "MISS", last or f"exit {proc.returncode}")


def check_train(out: Path) -> Row:
    """bf16 autocast training: the loss must fall and stay finite, for each family × objective."""
    from hlm_ray.presets import load_config
    from hlm_ray.tracking import read_metrics
    from hlm_ray.train.loop import train_worker

    figures, ok = [], True
    for preset in ("tiny-decoder", "tiny-encoder"):
        for objective in ("headless", "vanilla"):
            folder = out / "train" / f"{preset}-{objective}"
            cfg = load_config(
                preset,
                objective=objective,
                overrides=[
                    f"run.output_dir={folder}",
                    "run.device=cuda",
                    "optim.precision=bf16",
                    "optim.max_steps=60",
                    "run.log_every=10",
                    "run.eval_every=60",
                    "run.checkpoint_every=60",
                ],
            )
            summary = train_worker(cfg.to_dict(), progress=False)
            losses = [r["train/loss"] for r in read_metrics(folder) if "train/loss" in r]
            good = all(map(_finite, losses)) and losses[-1] < losses[0]
            ok &= good
            figures.append(
                f"{preset.removeprefix('tiny-')}/{objective} loss {losses[0]:.2f}→{losses[-1]:.2f} "
                f"{summary['tokens_per_s']:,.0f} tok/s"
            )
    return Row("train", "PASS" if ok else "MISS", "; ".join(figures))


def check_xformers(out: Path) -> Row:
    import torch

    from hlm_ray.config import ModelConfig
    from hlm_ray.models import build_model, hidden_states

    try:
        import xformers  # noqa: F401
    except ImportError:
        return Row("xformers", "MISS", "xformers is not installed: pip install -e '.[gpu]'")
    cfg = ModelConfig(arch="gpt2", hidden_size=256, num_layers=2, num_heads=4, max_positions=256)
    ids = {"eos_token": 0, "pad_token": 1}
    torch.manual_seed(0)
    sdpa = build_model(cfg, vocab_size=1000, objective="vanilla", special_ids=ids).cuda().eval()
    xf = build_model(
        dataclasses.replace(cfg, attn_impl="xformers"),
        vocab_size=1000,
        objective="vanilla",
        special_ids=ids,
    )
    xf.load_state_dict(sdpa.state_dict())
    xf = xf.cuda().eval()
    tokens = torch.randint(0, 1000, (4, 256), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = hidden_states(sdpa, tokens).float(), hidden_states(xf, tokens).float()
    diff = (a - b).abs().max().item()
    scale = a.abs().max().item()
    ok = diff <= 2e-2 * max(scale, 1.0)
    return Row(
        "xformers",
        "PASS" if ok else "MISS",
        f"max |xformers − sdpa| {diff:.3g} (max |h| {scale:.3g})",
    )


def check_bench(out: Path) -> Row:
    folder = out / "bench"
    cmd = [sys.executable, "-m", "hlm_ray.cli", "bench", "--preset", "gpu", "--only", "train_step"]
    proc = _run([*cmd, "--output", str(folder), "--no-progress"], 330)
    targets = folder / "targets.csv"
    if proc.returncode != 0 or not targets.is_file():
        return Row("bench", "MISS", f"hlm bench exited {proc.returncode}: {_tail(proc)}")
    rows = list(csv.DictReader(targets.open()))
    verdicts = [r["verdict"] for r in rows]
    figures = [
        f"{r['target']} ({r['scope']}): {r['measured']} vs {r['threshold']} {r['verdict']}"
        for r in rows
    ]
    steps = list(csv.DictReader((folder / "train_step.csv").open()))
    peak = max((float(r["peak_mb"]) for r in steps if r.get("peak_mb")), default=float("nan"))
    figures.append(f"peak memory {peak:,.0f} MB")
    ok = bool(verdicts) and all(v == "PASS" for v in verdicts)
    return Row("bench", "PASS" if ok else "MISS", "; ".join(figures))


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
    model = out / "train" / "tiny-decoder-vanilla" / "model"
    if not model.is_dir():
        return Row("serve", "MISS", "needs the train check's vanilla decoder (run train first)")
    port = _free_port()
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


RUNNERS: dict[str, Callable[[Path], Row]] = {
    "tests": check_tests,
    "train": check_train,
    "xformers": check_xformers,
    "bench": check_bench,
    "sweep": check_sweep,
    "serve": check_serve,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    p.add_argument("--only", help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument("--output", default="runs/gpu-check", help="folder for logs and results")
    args = p.parse_args(argv)
    only = [c.strip() for c in (args.only or ",".join(CHECKS)).split(",") if c.strip()]
    unknown = [c for c in only if c not in CHECKS]
    if unknown:
        print(
            f"error: unknown check {unknown[0]!r}; choose from {', '.join(CHECKS)}", file=sys.stderr
        )
        return 2

    import torch

    if not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA GPU is visible on this machine (torch "
            f"{torch.__version__}); nothing was run and nothing is claimed. Run `make gpu-check` "
            "on a CUDA machine (pip install -e '.[gpu]' there for xformers)."
        )
        return 0
    from hlm_ray.device import describe, resolve_device

    device = describe(resolve_device("cuda"))
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in only:
        print(f"gpu-check: {name} ...", flush=True)
        started = time.perf_counter()
        try:
            row = RUNNERS[name](out)
        except Exception as err:  # one failing check must not hide the others
            row = Row(name, "MISS", f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
        row.seconds = time.perf_counter() - started
        rows.append(row)
    table = format_table(rows, device)
    (out / "gpu_check.md").write_text(table + "\n")
    print()
    print(table)
    return 0 if all(r.verdict == "PASS" for r in rows) else 1


def _run(cmd: list[str], timeout_s: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        return subprocess.run(
            cmd, cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as err:
        return subprocess.CompletedProcess(
            cmd, 124, err.stdout or "", f"timed out after {timeout_s:.0f} s"
        )


def _tail(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    return lines[-1][:200] if lines else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


if __name__ == "__main__":
    sys.exit(main())
