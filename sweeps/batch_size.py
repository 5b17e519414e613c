"""The batch-size ablation (paper Figure 8): per-worker micro-batch sizes × {headless, vanilla}.

    python sweeps/batch_size.py --preset tiny                  # a tiny GPT-2, 2 sizes, 2 CPUs
    python sweeps/batch_size.py --preset paper                 # gpt2-11m, batch 16..128, GPUs
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python sweeps/batch_size.py

The micro-batch is the number of in-batch negatives of the contrastive loss (global batch =
micro-batch × workers). Headless arms are fine-tuned into generators and every trial is scored
on LAMBADA. The same --name resumes the sweep.
"""

import sys

from hlm_ray.tune.cli import sweep_main


def main(argv: list[str] | None = None) -> int:
    return sweep_main("batch_size", argv)


if __name__ == "__main__":
    sys.exit(main())
