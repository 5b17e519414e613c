"""The lazy embedding update's effect on speed, as its own measurement: on a run's own model,
vocabulary and micro-batch, optimizer steps with the dense and with the lazy (row-wise) embedding
update timed in alternation (A B A B ...) in one process, through the training-step benchmark's
machinery (`hlm_ray.bench.train_step.alternate`; token ids uniform over the vocabulary).

    times = update_probe(cfg, vocab_size=2048)    # {"dense": [s, ...], "lazy": [s, ...]}
    write_probe(times, folder); read_probe(folder)

Why a probe and not a third arm: the sweeps compare the objectives at the same (dense) embedding
update, so that a speed or loss difference is the objective's; the lazy update changes the
optimizer, not the objective, so its effect on a headless step is measured beside it, in the
same process, and reported as its own row.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

PROBE_FILE = "update_probe.json"
WARMUP, REPEATS = 2, 10


def update_probe(cfg, vocab_size: int, device: str = "cpu") -> dict[str, list[float]]:
    """Step seconds of the headless objective with each embedding update (`REPEATS` each, after
    `WARMUP` untimed steps), on `cfg`'s model shape and micro-batch."""
    from hlm_ray.bench.presets import StepModel, TrainStepSpec
    from hlm_ray.bench.train_step import Arm, alternate, make_batches

    dev = torch.device(device)
    micro = cfg.optim.micro_batch_size
    sm = StepModel("run", cfg.model, cfg.data.seq_len, ((vocab_size, micro),))
    spec = TrainStepSpec(models=(sm,), warmup=WARMUP, repeats=REPEATS, extra_rounds=0)
    batches = make_batches(sm, vocab_size, micro, spec.batches, dev)
    arms = [Arm("dense", "headless"), Arm("lazy", "headless", "lazy")]
    results = alternate([(a.name, a, vocab_size, batches) for a in arms], sm, spec, dev, None,
                        False, "embedding update probe")  # fmt: skip
    return {label: r.get("times", []) for label, r in results.items()}


def write_probe(times: dict[str, list[float]], folder: Path, tokens_per_step: int) -> Path:
    path = Path(folder) / PROBE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"tokens_per_step": tokens_per_step, "seconds": times}))
    return path


def read_probe(folder: Path) -> dict | None:
    path = Path(folder) / PROBE_FILE
    return json.loads(path.read_text()) if path.is_file() else None
