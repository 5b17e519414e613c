"""What several `hlm` commands share: their common arguments, the subcommand built from a
command function's docstring, loading a config from the arguments, launching one training run
and the default folder of a downstream result.

    train = add_command(sub, "train", cmd_train)     # help and description: cmd_train's docstring
    config_args(train); launch_args(train)
    cfg = load_args_config(args, "runs/x", "headless")
    summary = run_training(cfg, args)                # Ray Train, or this process with --local
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from pathlib import Path

from hlm_ray.paths import resolve_input, resolve_output


def add_command(sub, name: str, handler: Callable) -> argparse.ArgumentParser:
    """The subcommand `name`, run by `handler`: its help is the first paragraph of the handler's
    docstring, its description the rest (so the text lives once, beside the code)."""
    summary, _, rest = inspect.getdoc(handler).partition("\n\n")
    parser = sub.add_parser(name, help=summary, description=rest or summary)
    parser.set_defaults(handler=handler)
    return parser


def config_args(
    p: argparse.ArgumentParser, *, objective: bool = True, example: str = "optim.lr=3e-4"
) -> None:
    """--preset, --config, --set (and --objective): what a config is built from."""
    p.add_argument("--preset", help="named preset (hlm presets; default tiny-decoder)")
    if objective:
        p.add_argument("--objective", help="headless | vanilla | mixed (default: the preset's)")
    p.add_argument("--config", help="YAML file of overrides (nested sections)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"dotted override, repeatable: --set {example}",
    )


def launch_args(p: argparse.ArgumentParser) -> None:
    """Where and how a training run runs (defaults filled in by `launch_settings`: a resumed
    run takes its own saved ones)."""
    p.add_argument(
        "--local",
        action="store_true",
        default=None,
        help="run in this process, without Ray (debugging)",
    )
    p.add_argument("--num-workers", type=int, help="Ray Train workers (default 1)")
    p.add_argument("--gpu", action="store_true", default=None, help="one GPU per worker")
    p.add_argument("--cpus-per-worker", type=float, help="default 1")
    p.add_argument(
        "--max-failures", type=int, help="worker-group restarts from the last checkpoint (2)"
    )
    p.add_argument("--storage-path", help="Ray storage (default: the output folder's parent)")
    p.add_argument(
        "--placement-timeout",
        dest="placement_timeout_s",
        type=float,
        metavar="SECONDS",
        help="how long, in all, to wait for the cluster to place the workers (a node lost and "
        "not back, CPUs held by other jobs) before the run fails (600)",
    )
    device_arg(p)
    p.add_argument("--experiment", help="MLflow experiment name (default hlm_ray)")


def device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),  # hlm_ray.device.DEVICES (not imported: no torch here)
        default="auto",
        help="auto (default): the GPU when this process or Ray worker sees one, else the CPU",
    )


READOUT_CHOICES = ("head", "tied", "prior")  # hlm_ray.readout.READOUTS (no torch imported here)


def readout_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--readout",
        choices=READOUT_CHOICES,
        help="how a decoder's hidden states become logits (docs/readout.md): head (its own "
        "output head), tied (a headless decoder's input embeddings), prior (either plus the log "
        "unigram prior of its training tokens); default: the model's own, recorded in its "
        "readout.json (a headless decoder never fine-tuned: prior)",
    )


def device_overrides(args) -> list[str]:
    """--device as a config override; an explicit --set run.device=... still wins."""
    return [] if args.device == "auto" else [f"run.device={args.device}"]


def load_args_config(args, output: str | None, objective: str | None):
    """The config of --preset (default tiny-decoder), --config and --set, writing to `output`."""
    from hlm_ray.presets import load_config

    overrides = [*device_overrides(args), *args.set]
    if output:
        overrides.append(f"run.output_dir={resolve_output(output)}")
    return load_config(
        args.preset or "tiny-decoder",
        objective=objective,
        yaml_file=args.config,
        overrides=overrides,
    )


def launch_settings(args, run_dir: Path | None = None) -> None:
    """Fill the launch flags not given: from the run's launch.json on resume, else defaults."""
    from hlm_ray.train.preflight import check_workers
    from hlm_ray.train.resume import LAUNCH_DEFAULTS, launch_settings

    given = {k: getattr(args, k, None) for k in LAUNCH_DEFAULTS}
    vars(args).update(launch_settings(run_dir, given))
    check_workers(args.num_workers, local=args.local)


def run_training(cfg, args, *, resume: Path | None = None, resume_from: Path | None = None):
    """One training run, on Ray Train or (with --local) in this process; its summary. `resume`
    continues the run folder; `resume_from` names the checkpoint to continue from."""
    from hlm_ray.train.resume import LAUNCH_DEFAULTS

    if args.num_workers is None:
        launch_settings(args)
    if args.local:
        from hlm_ray.train.launch import train_local

        return train_local(cfg, experiment=args.experiment, resume_from=resume_from or resume)
    from hlm_ray.train.launch import launch

    # The saved launch settings are launch()'s keywords, but for --local and --gpu (use_gpu).
    options = {k: getattr(args, k) for k in LAUNCH_DEFAULTS if k not in ("local", "gpu")}
    return launch(
        cfg, use_gpu=args.gpu, resume=resume is not None, resume_from=resume_from, **options
    )


def default_output(model: str, suffix: str) -> str:
    """Where a result of `model` goes: beside its run folder, or under runs/ for models:/."""
    if model.startswith("models:/"):
        return f"runs/{model.removeprefix('models:/').replace('/', '-').replace('@', '-')}-{suffix}"
    folder = resolve_input(model).resolve()
    if folder.name == "model":
        folder = folder.parent
    return str(folder.with_name(f"{folder.name}-{suffix}"))
