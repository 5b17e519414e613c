"""The vocabulary-size ablation (paper Figure 7): vocabulary sizes × {headless, vanilla}.

    python sweeps/vocab.py --preset tiny                       # 2 sizes × 2 objectives, 2 CPUs
    python sweeps/vocab.py --preset paper                      # BERT-Small, 6 sizes, GPU workers
    python sweeps/vocab.py --set sweep.values=[512,2048] --num-seeds 3
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python sweeps/vocab.py --preset tiny

Each trial trains (or finds cached) the BPE of its size, pretrains through a TorchTrainer, runs
the downstream protocol of its family and reports. The same --name resumes the sweep. Results:
runs/sweeps/<name>/summary.md, the figures beside it, and the MLflow parent run.
"""

import sys

from hlm_ray.tune.cli import sweep_main


def main(argv: list[str] | None = None) -> int:
    return sweep_main("vocab", argv)


if __name__ == "__main__":
    sys.exit(main())
