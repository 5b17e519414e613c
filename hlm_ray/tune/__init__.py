"""The sweep machinery: the paper's ablations as Ray Tune grids of Train-inside-Tune trials.

    from hlm_ray.tune.spec import SweepSpec, get_sweep
    from hlm_ray.tune.sweep import run_sweep
    spec = get_sweep(PRESETS, "tiny", overrides=["optim.max_steps=20"])   # a script's presets
    outcome = run_sweep(spec, name="vocab-tiny")      # resumes when the name exists
    print(outcome.table)

An ablation is an `Axis` record (`tune.axis`) and its presets (`SweepSpec`s; `tiny_scale`,
`paper_scale`), both defined in its script in `sweeps/` with a `SweepScript` (`tune.cli`): the
machinery knows no axis by name. What belongs to one sweep lives in its own modules: the
headline comparison's families (`tune.families`) and report (`tune.headline`), Figure 7's
report (`tune.vocab_report`), the compute sweep's three parts (`tune.scaling`), curve fits and
multiplier (`tune.scaling_fit`) and report (`tune.scaling_report`); `tune.stats`, `tune.report`
and `tune.curve` serve them.

Layers, each a floor above the next: `sweeps/*.py` (the experiment) -> `tune.cli` (arguments,
dry run, the printed summary, the script's report) -> `tune.sweep` (grid, resources, shared
preparation, parent MLflow run, Tuner and resume) -> `tune.trial` (one trial: a TorchTrainer
through `hlm_ray.train.launch`, then the downstream protocol) -> `hlm_ray.train`.
`tune.summary` writes the table and the axis's figures; `hlm_ray.tracking.server` runs the local
tracking server the concurrent trials log through.
"""
