"""The `hlm` command: thin over the modules.

    hlm train --preset tiny-decoder --objective headless --output runs/tiny-headless
    hlm train --preset bert-small --config my.yaml --set optim.lr=3e-4 --set data.seq_len=64
    hlm train --preset tiny-decoder --num-workers 2               # 2 Ray Train workers (gloo)
    hlm train --resume runs/tiny-headless --set optim.max_steps=300   # the run's own config
    hlm sync runs/tiny-headless              # send what MLflow missed during a tracking outage
    hlm compare --preset tiny-decoder --output runs/compare    # headless and vanilla, side by side
    hlm presets                                                 # list the presets
    hlm finetune --task clm --model runs/tiny-headless --register hlm-tiny-generator  # -> a generator
    hlm finetune --task glue:sst2 --model runs/tiny-encoder-headless         # -> a classifier
    hlm eval --model runs/tiny-headless-clm --task lambada,bpb             # scores, to MLflow
    hlm serve --model models:/hlm-tiny-generator/1                # OpenAI-style HTTP endpoint
    hlm bench --preset cpu                                           # headless vs vanilla speed
    hlm data prepare --preset tiny-decoder --set data.sources=[DIR] --output OUT  # token shards
    hlm eval --model runs/tiny-gen --task lambada,harness:lambada_openai  # lm-evaluation-harness
    hlm sweep vocab --preset tiny --dry-run         # the same as python sweeps/vocab.py ...
    hlm generate --model runs/tiny-headless-clm "The cat" --max-tokens 20     # one sample
    hlm --version

The commands live in `hlm_ray/commands/` (one module per family) and with their stages
(`serve/cli.py`, `bench/cli.py`, `prepare/cli.py`, `tune/scripts.py`). Bad input prints one line, ``error: ...``, and exits with status 2; Ctrl-C stops the run
(its MLflow run marked KILLED), prints the command that continues it and exits with 130.
"""

from __future__ import annotations

import argparse
import sys

from hlm_ray import threads
from hlm_ray.errors import exit_status
from hlm_ray.train.interrupt import sigint_interrupts
from hlm_ray.tune import scripts as sweep_scripts
from hlm_ray.tune.scripts import SWEEPS  # noqa: F401 (the kinds `hlm sweep` offers)


def _version() -> str:
    """What `hlm --version` prints."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"hlm {version('hlm_ray')}"
    except PackageNotFoundError:  # run from a checkout that was never pip-installed
        return "hlm unknown (not installed)"


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `hlm` parser. `argv`: the command line it is built for, when known: a sweep script
    is loaded (torch, transformers: seconds) only for `hlm sweep KIND`, so that a typo in any
    other command is answered at once. None: every script, for what walks the whole parser."""
    parser = argparse.ArgumentParser(
        prog="hlm",
        description="Headless language models on Ray: pretrain (headless or vanilla), fine-tune, "
        "evaluate, sweep, generate and serve. `hlm COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="version", version=_version(), help="print the version")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from hlm_ray.bench import cli as bench_cli
    from hlm_ray.commands import downstream, generate, train
    from hlm_ray.prepare import cli as data_cli
    from hlm_ray.serve import cli as serve_cli

    train.add_parsers(sub)  # train, sync, compare, presets
    downstream.add_parsers(sub)  # finetune, eval
    sweep_scripts.add_parser(sub, only=_sweep_kind(argv))
    generate.add_parsers(sub)
    serve_cli.add_parser(sub).set_defaults(handler=serve_cli.run)
    bench_cli.add_parser(sub).set_defaults(handler=bench_cli.run)
    data_cli.add_parser(sub).set_defaults(handler=data_cli.run)
    return parser


def _sweep_kind(argv: list[str] | None) -> str | None:
    """The KIND of `hlm sweep KIND ...` in `argv`; "" for any other command (no script
    loaded); None when `argv` is None (every script loaded)."""
    if argv is None:
        return None
    words = [a for a in argv if not a.startswith("-")]  # `hlm` has no option that takes a value
    return words[1] if words[:1] == ["sweep"] and len(words) > 1 else ""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:  # a newcomer's first command: without the parser, which imports
        print(_version())  # torch and transformers (seconds on a small machine)
        raise SystemExit(0)
    args = build_parser(argv).parse_args(argv)
    if args.command in threads.COMMANDS:  # before torch is imported: see hlm_ray/threads.py
        threads.passive_openmp()
    sigint_interrupts()  # Ctrl-C stops a run, also one started in the background by a script

    def command() -> int:
        # train and sweep print the command that continues an interrupted run: they get argv.
        if args.command == "train":
            return args.handler(args, argv)
        if args.command == "sweep":
            return sweep_scripts.run(args, argv)
        return args.handler(args)

    return exit_status(command)


if __name__ == "__main__":
    sys.exit(main())
