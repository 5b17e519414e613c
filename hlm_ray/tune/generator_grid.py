"""Choose a preset's generator fine-tune on held-out text of the training corpus: the preset's
headless cpu decoder at the scaling sweep's smallest budget is pretrained (or given), then
fine-tuned at each point of a small grid of steps × batch × learning rate, each scored by bits per
byte on the validation split of its own corpus (`hlm_ray.finetune.grid`). The point it chooses is
what `hlm_ray.finetune.generators.GENERATORS[preset]` records, and its table what
docs/reproduction.md shows.

    python -m hlm_ray.tune.generator_grid --preset cpu                 # minutes on 2 CPU cores
    python -m hlm_ray.tune.generator_grid --preset cpu --model runs/x  # a headless decoder you have

Writes runs/generator-grid-<preset>/ (the pretrained model, each fine-tune, grid.json); the
grid (`hlm_ray.finetune.generators.GRIDS`) keeps the fine-tune small next to pretraining and at
tens of optimizer steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hlm_ray.errors import HLMError

# The headless model each grid fine-tunes: the scaling sweep's smallest budget (sweeps/scaling.py:
# the cpu decoder at 500G FLOPs, the middle rate of its search's grid).
PRETRAIN = {
    "tiny": ("tiny-gpt2", {"budget.flops": 1e10, "optim.lr": 3e-3, "optim.global_batch_size": 16}),
    "cpu": ("tiny-gpt2", {"budget.flops": 5e11, "optim.lr": 1e-3}),
}


def pretrain_config(preset: str, output_dir: Path):
    from hlm_ray.presets import load_config
    from hlm_ray.tune.families import DECODER_CPU_SETTINGS

    base, settings = PRETRAIN[preset]
    extra = DECODER_CPU_SETTINGS if preset == "cpu" else {"budget.warmup_share": 0.1}
    return load_config(base, objective="headless", overrides={
        **extra, **settings, "objective.name": "headless", "run.output_dir": str(output_dir),
        "run.eval_every": 1_000_000, "run.checkpoint_every": 1_000_000})  # fmt: skip


def main(argv=None) -> int:
    from hlm_ray.finetune.generators import GRIDS
    from hlm_ray.finetune.grid import generator_grid, grid_points
    from hlm_ray.train.launch import train_local

    parser = argparse.ArgumentParser(
        prog="python -m hlm_ray.tune.generator_grid", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--preset", choices=sorted(GRIDS), default="cpu")
    parser.add_argument("--model", help="a headless decoder (default: pretrain the preset's)")
    args = parser.parse_args(argv)
    out = Path("runs") / f"generator-grid-{args.preset}"
    model = args.model
    if model is None:
        cfg = pretrain_config(args.preset, out / "pretrain")
        model = str(out / "pretrain" / "model")
        if not Path(model).is_dir():
            print(f"pretraining the headless decoder: {cfg.budget.flops:.3g} FLOPs, lr "
                  f"{cfg.optim.lr:g}", flush=True)  # fmt: skip
            train_local(cfg, experiment="hlm_ray-generator-grid", progress=True)
    grid = GRIDS[args.preset]
    rows = generator_grid(model, grid_points(grid["steps"], grid["batches"], grid["lrs"]),
                          output_dir=out, recipe="tiny")  # fmt: skip
    best = min(rows, key=lambda r: r["val_bpb"])
    print("\n| steps | batch | lr | validation bits per byte | tokens | seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mark = " (chosen)" if r is best else ""
        print(f"| {r['steps']} | {r['batch']} | {r['lr']:g} | {r['val_bpb']:.4f}{mark} | "
              f"{r['tokens']:,} | {r['seconds']:.0f} |")  # fmt: skip
    print(f"\nchosen: {best['steps']} steps of {best['batch']} sequences at lr {best['lr']:g}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except HLMError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
