"""Benchmarks: ratios measured side by side in one run, never timed tests.

    hlm bench --preset cpu            # or: python -m hlm_ray.bench --preset cpu

- `loss_head`: forward + backward of the loss alone, CWT vs cross-entropy, over K and V.
- `train_step`: a real model's training step, headless vs the strongest vanilla, over V.
- `ray_overhead`: the same loop bare and under a 1-worker Ray TorchTrainer.
- `suite.run_bench` runs a preset (`presets`), `report` turns rows into targets, tables, figures.
"""
