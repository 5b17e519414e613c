"""The bare tier: what a stock PyTorch node (torch, transformers, tokenizers; no Ray, no MLflow)
checks on its GPU. Each function takes the output folder and returns a `Row`.

    from hlm_ray.gpu_check.bare import check_losses
    row = check_losses(Path("runs/gpu-check"))        # Row("losses", "PASS", "...")

The tiny models come from the shared corpus when it is there, else from a generated text file
(a copied checkout may travel without the data folder); they are trained once per output folder
(`trained`) and reused by the generation and classifier checks.
"""

from __future__ import annotations

import csv
import math
import random
import subprocess
import sys
from pathlib import Path

from hlm_ray.gpu_check.table import Row

ROOT = Path(__file__).resolve().parents[2]
EXTREME_TOL = 1e-3  # relative |bf16-autocast loss − float64 loss|, logits up to ~1e4
DEVICE = "cuda"  # what the checks validate; a CPU smoke test of the code paths sets "cpu"
# The attention check's model and batch: (batch, sequence, hidden, heads). On a GPU, sequences
# long enough for the fused kernels to matter; the CPU smoke test sets a small one (bf16 math
# attention at this size takes minutes on a CPU without bf16 instructions).
ATTENTION_SHAPE = (4, 1024, 512, 8)


def _finite(x: float) -> bool:
    return math.isfinite(x)


def corpus_overrides(out: Path) -> list[str]:
    """`data.sources` pointing at a generated corpus when the shared one is missing."""
    from hlm_ray.paths import has_shared

    if has_shared("corpus/en"):
        return []
    text = out / "corpus" / "generated.txt"
    if not text.is_file():
        text.parent.mkdir(parents=True, exist_ok=True)
        words = ("the", "cat", "sat", "on", "a", "mat", "while", "the", "dog", "ran", "after",
                 "one", "red", "ball", "in", "the", "sun")  # fmt: skip
        rng = random.Random(0)  # distinct documents: the train/val split hashes each one
        lines = [" ".join(rng.choices(words, k=16)) + "." for _ in range(6000)]
        text.write_text("\n\n".join(lines) + "\n")
    return [f"data.sources=[{text}]"]


def trained(out: Path, preset: str, objective: str, steps: int = 60) -> tuple[Path, dict, list]:
    """(run folder, summary, train losses) of a bf16 run of `preset` on cuda, made once."""
    import json

    from hlm_ray.presets import load_config
    from hlm_ray.tracking import read_metrics
    from hlm_ray.train.loop import train_worker

    folder = out / "train" / f"{preset}-{objective}"
    done = folder / "gpu_check_summary.json"
    if not done.is_file():
        overrides = [
            f"run.output_dir={folder}",
            f"run.device={DEVICE}",
            "optim.precision=bf16",
            f"optim.max_steps={steps}",
            "run.log_every=10",
            f"run.eval_every={steps}",
            f"run.checkpoint_every={steps}",
            *corpus_overrides(out),
        ]
        cfg = load_config(preset, objective=objective, overrides=overrides)
        summary = train_worker(cfg.to_dict(), progress=False)
        done.write_text(json.dumps(summary, default=str))
    losses = [r["train/loss"] for r in read_metrics(folder) if "train/loss" in r]
    return folder, json.loads(done.read_text()), losses


def check_losses(out: Path) -> Row:
    """CWT and cross-entropy under cuda bf16 autocast against float64, logits up to ~1e4 included
    (the gpu tests' scale: a bf16 logit there would be off by tens)."""
    import torch
    import torch.nn.functional as F

    from hlm_ray.objectives import cross_entropy_head, cwt_loss_from_ids

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    figures, ok = [], True
    for name, scale in (("normal", 1.0), ("extreme", 20.0)):
        pred = (torch.randn(512, 64, generator=g) * scale).to(DEVICE)
        table = (torch.randn(1024, 64, generator=g) * scale).to(DEVICE)
        ids = torch.randint(0, 1024, (512,), generator=g).to(DEVICE)
        ref = {
            "cwt": cwt_loss_from_ids(pred.double(), ids, table.double()).item(),
            "ce": F.cross_entropy(F.linear(pred.double(), table.double()), ids).item(),
        }
        impls = ["full", "chunked"] + (
            ["linear"] if hasattr(torch.nn, "LinearCrossEntropyOptions") else []
        )
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            got = {"cwt": cwt_loss_from_ids(pred, ids, table).item()}
            for impl in impls:
                ce = cross_entropy_head(pred, table, None, ids, impl=impl, chunk_size=128)
                got[f"ce_{impl}"] = ce.item()
        worst = max(
            abs(v - ref[k.split("_")[0]]) / max(1.0, abs(ref[k.split("_")[0]]))
            for k, v in got.items()
        )
        ok &= all(map(_finite, got.values())) and worst < EXTREME_TOL
        figures.append(f"{name} (largest logit {(pred @ table.T).abs().max().item():.0f}): "
                       f"worst rel. error {worst:.1e} over {','.join(got)}")  # fmt: skip
    return Row("losses", "PASS" if ok else "MISS", "; ".join(figures))


def check_train(out: Path) -> Row:
    """bf16 autocast training: the loss must fall and stay finite, for each family × objective."""
    figures, ok = [], True
    for preset in ("tiny-decoder", "tiny-encoder"):
        for objective in ("headless", "vanilla"):
            _, summary, losses = trained(out, preset, objective)
            good = bool(losses) and all(map(_finite, losses)) and losses[-1] < losses[0]
            ok &= good
            figures.append(
                f"{preset.removeprefix('tiny-')}/{objective} loss {losses[0]:.2f}→{losses[-1]:.2f} "
                f"{summary.get('tokens_per_s', float('nan')):,.0f} tok/s"
            )
    return Row("train", "PASS" if ok else "MISS", "; ".join(figures))


def check_attention(out: Path) -> Row:
    """Which SDPA backends run the model's attention (bf16), and which kernel it uses unforced
    (read from the profiler's kernel names). PASS: flash or memory-efficient runs by default."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hlm_ray.config import ModelConfig
    from hlm_ray.models import build_model, hidden_states

    batch, seq, hidden, heads = ATTENTION_SHAPE
    cfg = ModelConfig(
        arch="gpt2", hidden_size=hidden, num_layers=2, num_heads=heads, max_positions=seq
    )
    torch.manual_seed(0)
    ids = {"eos_token": 0, "pad_token": 1}
    model = (
        build_model(cfg, vocab_size=1000, objective="vanilla", special_ids=ids).to(DEVICE).eval()
    )
    tokens = torch.randint(0, 1000, (batch, seq), device=DEVICE)  # (B, T)

    def run():
        with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
            return hidden_states(model, tokens).float()

    with sdpa_kernel([SDPBackend.MATH]):
        reference = run()
    works = []
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        if not hasattr(SDPBackend, backend):
            continue
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                diff = (run() - reference).abs().max().item()
            works.append(f"{backend.split('_')[0].lower()} ok (|Δ| vs math {diff:.2g})")
        except RuntimeError as err:
            works.append(f"{backend.split('_')[0].lower()} no ({str(err).splitlines()[0][:60]})")
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if DEVICE == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        run()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    found = [
        k for k in ("flash", "fmha", "efficient", "cudnn") if any(k in n.lower() for n in names)
    ]
    used = ",".join(found) or "math (no fused attention kernel)"
    return Row("attention", "PASS" if found else "MISS", f"default: {used}; " + "; ".join(works))


def check_xformers(out: Path) -> Row:
    import torch

    try:
        import xformers  # noqa: F401
    except ImportError:
        return Row("xformers", "SKIP", "xformers is not installed (the gpu extra)")
    import dataclasses

    from hlm_ray.config import ModelConfig
    from hlm_ray.models import build_model, hidden_states

    cfg = ModelConfig(arch="gpt2", hidden_size=256, num_layers=2, num_heads=4, max_positions=256)
    ids = {"eos_token": 0, "pad_token": 1}
    torch.manual_seed(0)
    sdpa = build_model(cfg, vocab_size=1000, objective="vanilla", special_ids=ids).to(DEVICE).eval()
    xf_cfg = dataclasses.replace(cfg, attn_impl="xformers")
    xf = build_model(xf_cfg, vocab_size=1000, objective="vanilla", special_ids=ids)
    xf.load_state_dict(sdpa.state_dict())
    xf = xf.to(DEVICE).eval()
    tokens = torch.randint(0, 1000, (4, 256), device=DEVICE)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        a, b = hidden_states(sdpa, tokens).float(), hidden_states(xf, tokens).float()
    diff, scale = (a - b).abs().max().item(), a.abs().max().item()
    ok = diff <= 2e-2 * max(scale, 1.0)
    figures = f"max |xformers − sdpa| {diff:.3g} (max |h| {scale:.3g})"
    return Row("xformers", "PASS" if ok else "MISS", figures)


def check_bench(out: Path) -> Row:
    """`hlm bench --preset gpu --only train_step`: its targets, then every arm of its CSV."""
    folder = out / "bench"
    cmd = [sys.executable, "-m", "hlm_ray.cli", "bench", "--preset", "gpu", "--only", "train_step"]
    proc = run_module([*cmd, "--output", str(folder), "--no-progress"], 360)  # of the 10 min
    targets = folder / "targets.csv"
    if proc.returncode != 0 or not targets.is_file():
        return Row("bench", "MISS", f"hlm bench exited {proc.returncode}: {tail(proc)}")
    ok, figures = bench_figures(folder)
    return Row("bench", "PASS" if ok else "MISS", "; ".join(figures))


def bench_figures(folder: Path) -> tuple[bool, list[str]]:
    """(every target PASS, figures): the targets, then every arm of `train_step.csv` (the
    strongest vanilla of a point marked *), whatever arms the benchmark holds."""
    rows = list(csv.DictReader((folder / "targets.csv").open()))
    figures = [
        f"{r['target']} ({r['scope']}): {r['measured']} vs {r['threshold']} {r['verdict']}"
        for r in rows
    ]
    for r in csv.DictReader((folder / "train_step.csv").open()):
        star = "*" if r.get("strongest_vanilla") == "True" else ""
        where = f"{r['model']} V={r['V']} B={r['micro_batch']} {r['arm']}{star}"
        if r["experiment"] != "points":
            where = f"{r['experiment']}: {where}"
        if r["status"] != "ok":
            figures.append(f"{where}: {r['status']} {r['note']}".strip())
            continue
        mfu = f", MFU {float(r['mfu']):.1%}" if r["mfu"] else ""
        peak = f", peak {float(r['peak_mb']):,.0f} MB" if r["peak_mb"] else ""
        figures.append(f"{where}: {float(r['tokens_per_s']):,.0f} tok/s{mfu}{peak}")
    return bool(rows) and all(r["verdict"] == "PASS" for r in rows), figures


def check_generate(out: Path) -> Row:
    """Batched greedy generation with the KV cache on cuda = the CPU's text, same weights."""
    from hlm_ray.generate import Generator

    folder, _, _ = trained(out, "tiny-decoder", "vanilla")
    prompts = ["The", "To be or not", "First Citizen:", "A"]
    texts = {}
    for device in ("cpu", DEVICE):
        gen = Generator.load(folder, device=device)
        done = gen.generate(prompts, max_new_tokens=24, temperature=0)
        texts[device] = [c.text for c in done]
    same = sum(a == b for a, b in zip(texts["cpu"], texts[DEVICE], strict=True))
    figures = (
        f"{same}/{len(prompts)} greedy texts equal on cuda and cpu (batch "
        f"{len(prompts)}, 24 new tokens; {DEVICE}: {texts[DEVICE][0][:30]!r})"
    )
    return Row("generate", "PASS" if same == len(prompts) else "MISS", figures)


def check_classify(out: Path) -> Row:
    """One classifier fine-tuning epoch (a few steps) on cuda from the tiny vanilla encoder."""
    from dataclasses import replace

    from hlm_ray.classify import TINY, finetune_classifier

    folder, _, _ = trained(out, "tiny-encoder", "vanilla")
    data = out / "classify" / "sst2.tsv"
    data.parent.mkdir(parents=True, exist_ok=True)
    rows = ["sentence\tlabel"] + [
        f"{'a good fine' if i % 2 else 'a bad dull'} film number {i}\t{i % 2}" for i in range(48)
    ]
    data.write_text("\n".join(rows) + "\n")
    settings = replace(TINY, epochs=1, train_limit=32, eval_limit=16)
    result = finetune_classifier(
        folder / "model", "glue:sst2", settings, output_dir=out / "classify",
        train_file=data, device=DEVICE, progress=False,
    )  # fmt: skip
    device = result.get("settings", {}).get("device", "?")
    (seed,) = result["seeds"]
    loss = seed["epochs"][0]["train/loss"]
    ok = str(device).startswith(DEVICE) and _finite(loss)
    return Row(
        "classify",
        "PASS" if ok else "MISS",
        f"{seed['steps']} steps on {device}, train loss {loss:.3f}, "
        f"accuracy {seed['best']['eval/accuracy']:.2f}",
    )


def run_module(
    cmd: list[str], timeout_s: float, cwd: Path | None = None, env: dict[str, str] | None = None
):
    """A subprocess with this checkout first on PYTHONPATH (and `env` added to this process's
    environment for it alone); a timeout is exit 124."""
    import os

    env = {
        **os.environ,
        **(env or {}),
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


def tail(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    return lines[-1][:200] if lines else ""
