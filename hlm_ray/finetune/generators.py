"""The generator fine-tune each CPU preset records: a headless decoder's new head, trained with
cross-entropy for a fixed number of steps of a fixed batch at a fixed rate, the same whatever the
pretraining budget (as the paper's 10k steps are), chosen once per preset on the validation split
of the training corpus by `hlm_ray.tune.generator_grid` from `GRIDS[preset]`.

    from hlm_ray.finetune.generators import GENERATORS
    GENERATORS["cpu"]   # {"optim.max_steps": 40, "optim.global_batch_size": 4, "optim.lr": 0.001}

`hlm_ray.downstream` applies it on top of the preset's `clm` recipe (`clm.fixed_config`); the
sweeps charge its FLOPs to the headless arm and print its share of the arm's compute.
"""

GRIDS = {
    # The smoke test: seconds.
    "tiny": {"steps": (10, 20), "batches": (2,), "lrs": (3e-3,)},
    # At most 40 steps of 4 sequences of 64 tokens: about 8% of the cpu decoder's smallest
    # scaling budget and 1% of its largest (the paper's fine-tune: about 2.5% of pretraining).
    "cpu": {"steps": (20, 40), "batches": (2, 4), "lrs": (3e-4, 1e-3, 3e-3)},
}
GENERATORS = {
    "tiny": {"optim.max_steps": 20, "optim.global_batch_size": 2, "optim.lr": 3e-3},
    # python -m hlm_ray.tune.generator_grid --preset cpu (docs/reproduction.md has its table).
    "cpu": {"optim.max_steps": 40, "optim.global_batch_size": 4, "optim.lr": 1e-3},
}
