"""Validate a CUDA machine in one command, in tiers chosen by what imports there.

    PYTHONPATH=. python -m hlm_ray.gpu_check --output runs/gpu-check    # a checkout, nothing installed
    python -m hlm_ray.gpu_check --only losses,attention                # a subset
    make gpu-check                                                     # a networked machine

bare tier (torch, transformers, tokenizers: a stock PyTorch node; under 10 minutes on an H100):
  losses      CWT and cross-entropy under bf16 autocast against float64, extreme logits included
  train       bf16 training of both objectives × both families (tiny presets): the loss falls
  attention   which SDPA backends run the model's attention, and the kernel used by default
  xformers    xformers against sdpa on the same weights (SKIP where xformers is not installed)
  bench       `hlm bench --preset gpu --only train_step`: MFU, headless vs the strongest vanilla
              at V = 32k and 131k, peak memory; every arm of its CSV
  generate    batched greedy generation with the KV cache on cuda = the CPU's text
  classify    one classifier fine-tuning epoch on cuda
full tier (ray and mlflow must import, else each row is SKIP with that reason):
  tests, ray_train, sweep, serve      (see `hlm_ray.gpu_check.full`)

Each check is a row: PASS, MISS (failed or raised: the other checks still run) or SKIP (with its
reason). The versions it ran on are printed; the table goes to `<output>/gpu_check.md` and the rows
to `<output>/gpu_check.json`. Without a CUDA GPU it says so, runs nothing and exits 0. Exit status
on a GPU: 0 when no row is a MISS, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hlm_ray.gpu_check import bare, full
from hlm_ray.gpu_check.table import Row, exit_status, format_table, versions, write_results

# (tier, modules it needs beyond the bare stack) per check, in the order they run.
TIERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "losses": ("bare", ()),
    "train": ("bare", ()),
    "attention": ("bare", ()),
    "xformers": ("bare", ()),
    "bench": ("bare", ()),
    "generate": ("bare", ()),
    "classify": ("bare", ()),
    "tests": ("full", ("ray", "mlflow", "pytest")),
    "ray_train": ("full", ("ray", "mlflow")),
    "sweep": ("full", ("ray", "mlflow")),
    "serve": ("full", ("ray", "mlflow")),
}
CHECKS = tuple(TIERS)
RUNNERS: dict[str, Callable[[Path], Row]] = {
    "losses": bare.check_losses,
    "train": bare.check_train,
    "attention": bare.check_attention,
    "xformers": bare.check_xformers,
    "bench": bare.check_bench,
    "generate": bare.check_generate,
    "classify": bare.check_classify,
    "tests": full.check_tests,
    "ray_train": full.check_ray_train,
    "sweep": full.check_sweep,
    "serve": full.check_serve,
}
NO_GPU = (
    "gpu-check: no CUDA GPU is visible on this machine (torch {torch}, CUDA {cuda}); nothing was "
    "run and nothing is claimed. Run it on a CUDA machine."
)


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """The modules of `names` that do not import here (absent or broken)."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            missing.append(name)
    return missing


def run_checks(names: list[str], out: Path, runners: dict[str, Callable[[Path], Row]]) -> list[Row]:
    """One row per check; a check whose modules do not import is SKIP, one that raises is MISS,
    and neither stops the others."""
    rows = []
    for name in names:
        tier, needs = TIERS.get(name, ("bare", ()))
        missing = missing_modules(needs)
        if missing:
            why = f"{', '.join(missing)} not installed ({tier} tier)"
            rows.append(Row(name, "SKIP", why, 0.0, tier))
            print(f"gpu-check: {name} skipped: {why}", flush=True)
            continue
        print(f"gpu-check: {name} ...", flush=True)
        started = time.perf_counter()
        try:
            row = runners[name](out)
        except Exception as err:  # one failing check must not hide the others
            first = (str(err).splitlines() or [""])[0][:200]
            row = Row(name, "MISS", f"{type(err).__name__}: {first}")
        row.check, row.seconds, row.tier = name, time.perf_counter() - started, tier
        print(f"gpu-check: {name} {row.verdict}: {row.figures}", flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=(__doc__ or "").splitlines()[0])
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

    info = versions()
    print("gpu-check: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    if not torch.cuda.is_available():
        print(NO_GPU.format(torch=torch.__version__, cuda=torch.version.cuda))
        return 0
    from hlm_ray.device import describe, resolve_device

    device = describe(resolve_device("cuda"))
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = run_checks(only, out, RUNNERS)
    table = write_results(rows, device, info, out)
    print()
    print(table)
    return exit_status(rows)


__all__ = ["CHECKS", "RUNNERS", "TIERS", "Row", "format_table", "main", "run_checks"]
