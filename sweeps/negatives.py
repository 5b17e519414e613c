"""How many negatives, set apart from the batch size (the paper's footnote on a separate negative
set S_N): at a fixed micro-batch, a headless decoder's contrastive loss scores each target
against
- `own`: every target of its worker's micro-batch (the paper's setting, K = B·(L−1) rows),
- `all_workers`: every worker's targets (cross-worker negatives, K × workers columns),
- N (a number): a seeded random subset of N of the micro-batch's targets
  (`objective.num_negatives`; the subset is drawn anew for every micro-batch).

    python sweeps/negatives.py --preset tiny          # tiny GPT-2, 2 workers per trial, 2 CPUs
    python sweeps/negatives.py --preset paper         # gpt2-11m, micro-batch 64, GPU workers
    python sweeps/negatives.py --set sweep.values=[own,64,1024]

The batch-size sweep (sweeps/batch_size.py) moves the negatives and the batch together; this one
holds the batch and moves only the negatives. Each headless decoder is fine-tuned into a
generator and scored on LAMBADA and bits per byte of held-out text, as in the batch-size sweep.
Trials run 2 workers each so that `all_workers` differs from `own`.
"""

import sys

from hlm_ray.errors import HLMError
from hlm_ray.tune.axis import Axis, Figure
from hlm_ray.tune.cli import SweepScript
from hlm_ray.tune.spec import SweepSpec, paper_scale, tiny_scale

OWN, ALL_WORKERS = "own", "all_workers"


def negatives_settings(value: int | str, workers: int) -> dict:
    """The objective fields one value of the axis stands for."""
    if value == OWN:
        return {"objective.cross_worker_negatives": False, "objective.num_negatives": None}
    if value == ALL_WORKERS:
        return {"objective.cross_worker_negatives": True, "objective.num_negatives": None}
    if isinstance(value, str):
        raise HLMError(
            f"sweep.values: {value!r} is not a negative set; use {OWN}, {ALL_WORKERS} or a number"
        )
    return {"objective.cross_worker_negatives": False, "objective.num_negatives": value}


def check_negatives(spec: SweepSpec) -> None:
    for value in spec.values:
        negatives_settings(value, spec.workers_per_trial)
    if ALL_WORKERS in spec.values and spec.workers_per_trial < 2:
        raise HLMError(
            f"sweep.values has {ALL_WORKERS} but a trial has 1 worker (the same as {OWN}); "
            "use --workers-per-trial 2 or more"
        )


AXIS = Axis(
    name="negatives",
    field="objective.num_negatives",
    settings=negatives_settings,
    check=check_negatives,
    label="contrastive negatives per row (micro-batch fixed)",
    column=("negatives", "negatives"),
    figures=(
        Figure("negatives_lambada.png", "lambada/accuracy", "LAMBADA accuracy"),
        Figure("negatives_bpb.png", "text_bpb", "bits per byte of held-out text (generator)"),
    ),
    description="The number of contrastive negatives at a fixed micro-batch, as a Ray Tune sweep.",
)

# 2 workers per trial, so that all_workers differs from own.
PRESETS = {
    # K = 16 × 63 = 1008 targets per worker.
    "tiny": tiny_scale(
        AXIS,
        "tiny-gpt2",
        (OWN, ALL_WORKERS, 64),
        "optim.micro_batch_size=16",
        "optim.global_batch_size=32",
        objectives=("headless",),
        workers_per_trial=2,
    ),
    # K = 64 × 127 = 8128 targets per worker: all_workers scores 16256.
    "paper": paper_scale(
        AXIS,
        "gpt2-11m",
        (OWN, ALL_WORKERS, 256, 1024, 4096),
        "optim.micro_batch_size=64",
        "optim.global_batch_size=128",
        objectives=("headless",),
        workers_per_trial=2,
    ),
}

SCRIPT = SweepScript(AXIS, PRESETS)
main = SCRIPT.main

if __name__ == "__main__":
    sys.exit(main())
