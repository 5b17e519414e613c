"""Choose a headless decoder's generator fine-tune on held-out text of its own corpus: each point
of a small grid (steps, batch, learning rate) is fine-tuned, and scored by the bits per byte of the
validation split of the training corpus (`val/token_bpb`, the fine-tune's last evaluation over
`eval_batches` batches), never on the texts a report scores.

    rows = generator_grid("runs/h/model", GRID, output_dir="runs/grid", recipe="tiny")
    best = min(rows, key=lambda r: r["val_bpb"])     # {"steps", "batch", "lr", "val_bpb", ...}

Each fine-tune is the same `train_worker` run a sweep trial's downstream step makes
(`hlm_ray.finetune.clm.clm_config`, warm-up a tenth of its steps), in this process.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

EVAL_BATCHES = 50
"""Validation batches each fine-tune is scored on (its whole validation split at CPU scale)."""


def grid_points(steps, batches, lrs) -> list[dict[str, Any]]:
    return [
        {"optim.max_steps": s, "optim.global_batch_size": b, "optim.lr": lr}
        for s, b, lr in itertools.product(steps, batches, lrs)
    ]


def generator_grid(
    model_dir: str | Path, points: list[dict[str, Any]], *, output_dir: str | Path, recipe: str
) -> list[dict[str, Any]]:
    """One row per grid point: its settings, the validation bits per byte, tokens, seconds."""
    from hlm_ray.config import apply_overrides
    from hlm_ray.finetune.clm import clm_config, fixed_config
    from hlm_ray.train.loop import train_worker

    out = Path(output_dir)
    rows = []
    for i, settings in enumerate(points):
        folder = out / f"point-{i:02d}"
        cfg, facts = clm_config(model_dir, recipe=recipe, output_dir=folder)
        cfg, facts = fixed_config(cfg, facts, settings)
        steps = cfg.optim.max_steps
        cfg = apply_overrides(cfg, {"run.eval_batches": EVAL_BATCHES, "run.eval_every": steps,
                                    "run.checkpoint_every": steps, "run.log_every": steps})  # fmt: skip
        started = time.perf_counter()
        summary = train_worker(cfg.to_dict(), progress=False)
        row = {
            "steps": steps,
            "batch": cfg.optim.global_batch_size,
            "lr": cfg.optim.lr,
            "val_bpb": float(summary["metrics"]["val/token_bpb"]),
            "tokens": facts["finetune_tokens"],
            "seconds": round(time.perf_counter() - started, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "grid.json").write_text(json.dumps(rows, indent=1))
    return rows
