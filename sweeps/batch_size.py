"""The batch-size ablation (paper Figure 8, Table 10): per-worker micro-batch sizes × {headless,
vanilla}.

    python sweeps/batch_size.py --preset tiny                  # a tiny GPT-2, 2 sizes, 2 CPUs
    python sweeps/batch_size.py --preset paper                 # gpt2-11m, batch 16..128, GPUs
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python sweeps/batch_size.py

The 11M-parameter GPT-2, one run per micro-batch size: the micro-batch is the number of in-batch
negatives of the contrastive loss (global batch = micro-batch × workers, no accumulation).
Headless arms are fine-tuned into generators and every trial is scored on LAMBADA. The same
--name resumes the sweep. The paper names only its largest batch (128); the other points are
spaced below it.
"""

import sys

from hlm_ray.tune.axis import Axis, Figure
from hlm_ray.tune.cli import SweepScript
from hlm_ray.tune.spec import paper_scale, tiny_scale


def micro_batch_settings(micro_batch: int, workers: int) -> dict[str, int]:
    """The paper's batch is the device batch: K = the in-batch negatives of one worker."""
    return {
        "optim.micro_batch_size": micro_batch,
        "optim.global_batch_size": micro_batch * workers,
    }


AXIS = Axis(
    name="batch_size",
    field="optim.micro_batch_size",
    settings=micro_batch_settings,
    label="micro-batch size (in-batch negatives)",
    column=("micro-batch", "micro_batch"),
    figures=(
        Figure("fig8_lambada_vs_batch_size.png", "lambada/accuracy", "LAMBADA accuracy"),
        # Not in the paper: informative where LAMBADA accuracy is still 0 (tiny models).
        Figure(
            "fig8b_bpb_vs_batch_size.png",
            "text_bpb",
            "bits per byte of held-out text (generator, lower is better)",
        ),
    ),
)

PRESETS = {
    "tiny": tiny_scale(AXIS, "tiny-gpt2", (8, 16)),
    "paper": paper_scale(AXIS, "gpt2-11m", (16, 32, 64, 128)),
}

SCRIPT = SweepScript(AXIS, PRESETS)
main = SCRIPT.main

if __name__ == "__main__":
    sys.exit(main())
