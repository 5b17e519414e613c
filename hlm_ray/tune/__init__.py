"""The sweep machinery: the paper's ablations as Ray Tune grids of Train-inside-Tune trials.

    from hlm_ray.tune.presets import get_sweep
    from hlm_ray.tune.sweep import run_sweep
    spec = get_sweep("vocab", "tiny", overrides=["optim.max_steps=20"])
    outcome = run_sweep(spec, name="vocab-tiny")      # resumes when the name exists
    print(outcome.table)

Layers, each a floor above the next: `sweeps/*.py` (argument parsing) -> `tune.sweep` (grid,
resources, shared preparation, parent MLflow run, Tuner and resume) -> `tune.trial` (one trial:
a TorchTrainer through `hlm_ray.train.launch`, then the downstream protocol) -> `hlm_ray.train`.
`tune.summary` writes the table and the paper's figures; `hlm_ray.tracking.server` runs the
local tracking server the concurrent trials log through.
"""
