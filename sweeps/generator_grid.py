"""Choose the scaling sweep's generator fine-tune for a preset on held-out text of the training
corpus: the preset's headless decoder at its smallest budget is pretrained (or given), then
fine-tuned at each point of a small grid of steps × batch × learning rate, each scored by bits per
byte on the validation split of its own corpus (`hlm_ray.finetune.grid`). The point it chooses is
what `hlm_ray.finetune.generators.GENERATORS[preset]` records, and its table what
docs/reproduction.md shows.

    python sweeps/generator_grid.py --preset cpu                  # a few minutes on 2 CPU cores
    python sweeps/generator_grid.py --preset cpu --model runs/x   # a headless decoder you have

Writes runs/generator-grid-<preset>/ (the pretrained model, each fine-tune, grid.json); the
grid (`GRIDS`) keeps the fine-tune small next to pretraining and at tens of optimizer steps.
"""

import argparse
import sys
from pathlib import Path

from scaling import PRESETS  # sweeps/ is on the path when this script runs

from hlm_ray.errors import HLMError


def main(argv=None) -> int:
    from hlm_ray.config import apply_overrides
    from hlm_ray.downstream import DOWNSTREAM
    from hlm_ray.finetune.generators import GRIDS
    from hlm_ray.finetune.grid import generator_grid, grid_points
    from hlm_ray.train.launch import train_local
    from hlm_ray.tune.scaling import budgets, search_lrs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("tiny", "cpu"), default="cpu")
    parser.add_argument("--model", help="a headless decoder (default: pretrain the preset's)")
    args = parser.parse_args(argv)
    spec = PRESETS[args.preset]
    out = Path("runs") / f"generator-grid-{args.preset}"
    model = args.model
    if model is None:
        smallest = budgets(spec)[0]
        lr = search_lrs(spec)[len(search_lrs(spec)) // 2]
        cfg = apply_overrides(spec.cell_config(smallest, "headless", 0),
                              {"optim.lr": lr, "run.output_dir": str(out / "pretrain")})  # fmt: skip
        print(f"pretraining the headless decoder at {smallest} FLOPs, lr {lr:g}", flush=True)
        if not (out / "pretrain" / "model").is_dir():
            train_local(cfg, experiment="hlm_ray-generator-grid", progress=True)
        model = str(out / "pretrain" / "model")
    grid = GRIDS[args.preset]
    rows = generator_grid(model, grid_points(grid["steps"], grid["batches"], grid["lrs"]),
                          output_dir=out, recipe=DOWNSTREAM[spec.recipe]["clm_recipe"])  # fmt: skip
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
