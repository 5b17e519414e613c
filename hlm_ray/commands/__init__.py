"""The `hlm` subcommands, one module per family; `hlm_ray.cli` builds the parser from them.

    common.py     arguments several commands share, launching a training run, default folders
    train.py      hlm train, hlm compare, hlm sync, hlm presets
    downstream.py hlm finetune, hlm eval
    generate.py   hlm generate

Each command is a function `cmd_<name>(args)` whose docstring gives its `--help` text (the first
line, then the description); `hlm serve`, `hlm bench`, `hlm data` and `hlm sweep` live with
their stages (`serve/cli.py`, `bench/cli.py`, `prepare/cli.py`, `tune/scripts.py`).
"""
