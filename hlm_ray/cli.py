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

Bad input prints one line, ``error: ...``, and exits with status 2; Ctrl-C stops the run
(its MLflow run marked KILLED), prints the command that continues it and exits with 130.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hlm_ray.errors import HLMError
from hlm_ray.paths import resolve_output
from hlm_ray.tune import scripts as sweep_scripts
from hlm_ray.tune.scripts import SWEEPS  # noqa: F401 (the kinds `hlm sweep` offers)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="named preset (hlm presets; default tiny-decoder)")
    p.add_argument("--objective", help="headless | vanilla | mixed (default: the preset's)")
    p.add_argument("--config", help="YAML file of overrides (nested sections)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, repeatable: --set optim.lr=3e-4",
    )


def _launch_args(p: argparse.ArgumentParser) -> None:
    # Defaults are filled in by `_launch_settings` (a resumed run takes its own saved ones).
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
    _device_arg(p)
    p.add_argument("--experiment", help="MLflow experiment name (default hlm_ray)")


def _device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),  # hlm_ray.device.DEVICES (not imported: no torch here)
        default="auto",
        help="auto (default): the GPU when this process or Ray worker sees one, else the CPU",
    )


def _device_overrides(args) -> list[str]:
    """--device as a config override; an explicit --set run.device=... still wins."""
    return [] if args.device == "auto" else [f"run.device={args.device}"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hlm_ray")
    except PackageNotFoundError:  # run from a checkout that was never pip-installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hlm",
        description="Headless language models on Ray: pretrain (headless or vanilla), fine-tune, "
        "evaluate, sweep, generate and serve. `hlm COMMAND --help` describes each command.",
    )
    parser.add_argument(
        "--version", action="version", version=f"hlm {_version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="pretrain one model (Ray Train, tracked in MLflow)",
        description="Pretrain one model from a preset (plus YAML and --set overrides) on Ray "
        "Train or in this process; checkpoints, metrics and the final model go to the run "
        "folder and MLflow. --resume continues a run; --dry-run prints its cost plan.",
    )
    _config_args(train)
    _launch_args(train)
    train.add_argument("--output", help="run folder (default runs/<preset>-<objective>)")
    train.add_argument(
        "--resume",
        help="a run folder (its newest valid checkpoint) or a checkpoint folder to continue, "
        "with the run's own config and launch settings",
    )
    from hlm_ray.plan import add_arguments as plan_arguments

    plan_arguments(train)

    sync = sub.add_parser(
        "sync",
        help="send a run's metrics that MLflow missed (an outage)",
        description="Send MLflow what a run recorded while the tracking server was down: the "
        "missing metric points (never the ones it has), params, final artifacts, status.",
    )
    sync.add_argument("run", help="the run folder (an `hlm train --output`)")

    compare = sub.add_parser(
        "compare",
        help="pretrain headless and vanilla, print both",
        description="Pretrain the preset once headless and once vanilla, then print both "
        "summaries and plot their loss curves and throughput side by side.",
    )
    _config_args(compare)
    _launch_args(compare)
    compare.add_argument(
        "--output", default=None, help="folder for both runs and the plot (replaced on re-run)"
    )

    sub.add_parser(
        "presets",
        help="list the presets",
        description="List the named presets: architecture, shape, sequence length, batch, "
        "learning rate, schedule and steps.",
    )

    finetune = sub.add_parser(
        "finetune",
        help="headless decoder -> generator (clm); encoder -> classifier (glue/xnli)",
        description="clm: give a headless decoder a real output head (an untied copy of its "
        "input embedding) trained with cross-entropy, then score it on LAMBADA; glue:/xnli: "
        "fine-tune an encoder as a sequence classifier over seeds, best epoch reported.",
    )
    finetune.add_argument("--task", required=True, help="clm | glue:<name> | xnli:<lang>")
    finetune.add_argument("--model", required=True, help="run/checkpoint/model folder or models:/")
    finetune.add_argument(
        "--recipe",
        default="tiny",
        help="clm: tiny | code | text | appendix; classifiers: tiny | paper (default tiny)",
    )
    finetune.add_argument("--output", help="output folder (default: <model run>-<task>)")
    finetune.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="clm config override"
    )
    finetune.add_argument("--probe", action="store_true", help="clm: train only the new head")
    finetune.add_argument(
        "--register",
        metavar="NAME",
        help="register the result in MLflow's model registry as NAME (clm: text-generation; "
        "classifiers: text-classification); load it as models:/NAME/VERSION",
    )
    finetune.add_argument(
        "--alias", metavar="A", help="with --register: point models:/NAME@A at the new version"
    )
    finetune.add_argument(
        "--eval-limit", type=int, default=500, help="clm: LAMBADA passages scored (0 = all)"
    )
    finetune.add_argument("--seeds", help="classifiers: comma-separated seeds, e.g. 0,1,2")
    finetune.add_argument("--epochs", type=int, help="classifiers: epochs")
    finetune.add_argument("--lr", type=float, help="classifiers: learning rate")
    finetune.add_argument("--loss", choices=("balanced", "ce"), help="classifiers: loss")
    finetune.add_argument(
        "--eval-languages", help="xnli: 'all' to evaluate every language (zero-shot protocol)"
    )
    finetune.add_argument("--train-limit", type=int, help="classifiers: training examples used")
    finetune.add_argument("--train-file", help="classifiers: your own training file")
    finetune.add_argument("--eval-file", help="classifiers: your own evaluation file")
    _launch_args(finetune)

    ev = sub.add_parser(
        "eval",
        help="LAMBADA, bits per byte, synonyms, anisotropy, lm-evaluation-harness tasks",
        description="Score a model on evaluation tasks at the context length it was trained "
        "on; JSON per task in --output, a table printed, and metrics logged to the model's "
        "MLflow run (eval/...).",
    )
    ev.add_argument("--model", required=True, help="run/checkpoint/model folder or models:/")
    ev.add_argument(
        "--task",
        required=True,
        help="comma-separated: lambada, bpb, synonyms, anisotropy, then optionally "
        "harness:<lm-eval task>[,<task>...] (takes the rest of the list), e.g. "
        "lambada,harness:lambada_openai,sst2",
    )
    ev.add_argument("--limit", type=int, help="examples per task (default: all)")
    ev.add_argument("--batch-size", type=int, default=32, help="sequences per forward pass (32)")
    _device_arg(ev)
    ev.add_argument("--output", help="folder for the JSON results (default <model>/eval)")
    ev.add_argument("--experiment", default="hlm_ray", help="MLflow experiment name")

    sweep_scripts.add_parser(sub)
    _generate_parser(sub)

    from hlm_ray.bench import cli as bench_cli
    from hlm_ray.prepare import cli as data_cli
    from hlm_ray.serve import cli as serve_cli

    serve_cli.add_parser(sub).set_defaults(handler=serve_cli.run)
    bench_cli.add_parser(sub).set_defaults(handler=bench_cli.run)
    data_cli.add_parser(sub).set_defaults(handler=data_cli.run)
    return parser


def _generate_parser(sub) -> None:
    gen = sub.add_parser(
        "generate",
        help="print a sample from a decoder (run, checkpoint or models:/ URI)",
        description="Load a decoder (a vanilla run, or a headless one fine-tuned with `hlm "
        "finetune --task clm`) and print the prompt and a sample, streamed as it is decoded.",
    )
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument("--model", required=True, help="run/checkpoint/model folder or models:/")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (32)")
    gen.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature; 0 is greedy (1.0)"
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1.0: off)")
    gen.add_argument("--seed", type=int, help="sampling seed: the same seed, the same text")
    gen.add_argument(
        "--allow-raw-head",
        action="store_true",
        help="generate from a headless decoder that was never fine-tuned (its raw Eᵀ head)",
    )
    _device_arg(gen)


def cmd_generate(args) -> int:
    from hlm_ray.generate import Generator

    generator = Generator.load(args.model, device=args.device, allow_raw_head=args.allow_raw_head)
    print(args.prompt, end="", flush=True)
    finish = None
    for delta in generator.stream(
        args.prompt,
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    ):
        print(delta.text, end="", flush=True)
        finish = delta.finish_reason or finish
    print()
    print(f"[{generator.name}: finish_reason={finish}]", file=sys.stderr)
    return 0


def _load(args, output: str | None, objective: str | None):
    from hlm_ray.presets import load_config

    overrides = [*_device_overrides(args), *args.set]
    if output:
        overrides.append(f"run.output_dir={resolve_output(output)}")
    return load_config(
        args.preset or "tiny-decoder",
        objective=objective,
        yaml_file=args.config,
        overrides=overrides,
    )


def _launch_settings(args, run_dir: Path | None = None) -> None:
    """Fill the launch flags not given: from the run's launch.json on resume, else defaults."""
    from hlm_ray.train.resume import LAUNCH_DEFAULTS, launch_settings

    given = {k: getattr(args, k, None) for k in LAUNCH_DEFAULTS}
    vars(args).update(launch_settings(run_dir, given))


def _run(cfg, args, *, resume: Path | None = None, resume_from: Path | None = None) -> dict:
    """One training run, on Ray Train or (with --local) in this process. `resume` continues
    the run folder; `resume_from` names the checkpoint to continue from."""
    if args.num_workers is None:
        _launch_settings(args)
    if args.local:
        from hlm_ray.train.launch import train_local

        return train_local(cfg, experiment=args.experiment, resume_from=resume_from or resume)
    from hlm_ray.train.launch import launch

    return launch(
        cfg,
        num_workers=args.num_workers,
        use_gpu=args.gpu,
        cpus_per_worker=args.cpus_per_worker,
        max_failures=args.max_failures,
        storage_path=args.storage_path,
        experiment=args.experiment,
        resume=resume is not None,
        resume_from=resume_from,
    )


def cmd_train(args, argv: list[str]) -> int:
    from hlm_ray.train.checkpoint import refuse_existing, resolve_resume
    from hlm_ray.train.launch import check_output, check_workers
    from hlm_ray.train.resume import resumed_config, save_launch
    from hlm_ray.train.summary import format_summary

    resume = resume_from = None
    if args.resume:
        resume = resolve_resume(args.resume)
        named = Path(args.resume).resolve() == resume.resolve()  # a checkpoint, not a run
        resume_from = resume if named else None
        args.output = args.output or str(resume.parent)
        _launch_settings(args, resume.parent)
        output = args.output
        overrides = [
            *_device_overrides(args),
            *args.set,
            f"run.output_dir={resolve_output(output)}",
        ]
        cfg = resumed_config(
            resume,
            preset=args.preset,
            objective=args.objective,
            yaml_file=args.config,
            overrides=overrides,
        )
    else:
        _launch_settings(args)
        objective = args.objective or "headless"
        output = args.output or f"runs/{args.preset or 'tiny-decoder'}-{objective}"
        cfg = _load(args, output, args.objective)
    if args.dry_run:
        from hlm_ray.plan import assumptions_from, format_plan, train_plan

        # A GPU-denominated plan: one GPU per worker, whether or not --gpu is given.
        plan = train_plan(
            cfg,
            assumptions_from(args),
            workers=args.num_workers,
            gpus_per_worker=1.0,
            cpus_per_worker=args.cpus_per_worker,
        )
        print(format_plan(plan))
        return 0
    if resume is None:
        refuse_existing(cfg.run.output_dir)
    if not args.local:
        check_workers(args.num_workers)
    check_output(Path(cfg.run.output_dir))
    save_launch(cfg.run.output_dir, vars(args))
    where = "this process" if args.local else f"Ray Train, {args.num_workers} worker(s)"
    print(f"training {cfg.preset} ({cfg.model.arch}, {cfg.objective.name}) on {where} -> {output}")
    try:
        summary = _run(cfg, args, resume=resume, resume_from=resume_from)
    except KeyboardInterrupt:
        from hlm_ray.train.interrupt import EXIT_INTERRUPTED, continue_message

        run_dir = Path(cfg.run.output_dir)
        said = continue_message(run_dir, str(output), argv, args.config, args.set)
        print(f"\ninterrupted: {said}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(format_summary([summary]))
    return 0


def cmd_sync(args) -> int:
    from hlm_ray.tracking.sync import sync_run

    report = sync_run(args.run)
    print(
        f"synced {args.run} to MLflow run {report['run_id']}: {report['metrics_logged']} metric "
        f"point(s), {report['params_logged']} param(s), "
        f"{len(report['artifacts_logged'])} artifact(s) sent; status {report['status']}"
    )
    return 0


def cmd_compare(args) -> int:
    import shutil

    from hlm_ray.train.summary import format_summary, plot_runs

    _launch_settings(args)
    root = Path(args.output or f"runs/compare-{args.preset or 'tiny-decoder'}")
    summaries = []
    for objective in ("headless", "vanilla"):
        cfg = _load(args, str(root / objective), objective)
        shutil.rmtree(cfg.run.output_dir, ignore_errors=True)  # compare always starts afresh
        print(f"\n== {objective}: {cfg.preset} ({cfg.model.arch}) -> {cfg.run.output_dir}")
        summaries.append(_run(cfg, args))
    print()
    print(format_summary(summaries))
    figure = plot_runs([root / "headless", root / "vanilla"], root / "compare.png")
    print(f"\nloss curves and throughput: {figure}")
    return 0


def cmd_presets(args) -> int:
    from hlm_ray.presets import PRESETS, get_preset

    for name in PRESETS:
        cfg = get_preset(name)
        m, o = cfg.model, cfg.optim
        print(
            f"{name:24s} {m.arch:10s} L{m.num_layers} D{m.hidden_size} H{m.num_heads} "
            f"seq {cfg.data.seq_len} batch {o.global_batch_size}/{o.micro_batch_size} "
            f"lr {o.lr:g} {o.schedule} steps {o.max_steps}"
        )
    return 0


def _default_output(model: str, suffix: str) -> str:
    if model.startswith("models:/"):
        return f"runs/{model.removeprefix('models:/').replace('/', '-').replace('@', '-')}-{suffix}"
    folder = Path(model).resolve()
    if folder.name == "model":
        folder = folder.parent
    return str(folder.with_name(f"{folder.name}-{suffix}"))


def cmd_finetune(args) -> int:
    from hlm_ray import downstream

    if args.alias and not args.register:
        raise HLMError("--alias names a version of a registered model: give --register NAME too")
    _launch_settings(args)
    suffix = args.task.replace(":", "-")
    output = str(resolve_output(args.output or _default_output(args.model, suffix)))
    if args.task == "clm":
        print(f"fine-tuning {args.model} into a generator ({args.recipe}) -> {output}")

        def train(cfg):
            return _run(cfg, args)

        out = downstream.finetune_generator(
            args.model,
            output_dir=output,
            recipe=args.recipe,
            probe=args.probe,
            overrides=[*_device_overrides(args), *args.set],
            train=train,
            eval_limit=args.eval_limit or None,
            register=args.register,
            alias=args.alias,
            experiment=args.experiment,
        )
        from hlm_ray.evaluate import format_results

        facts = out["facts"]
        fraction = facts["pretrain_token_fraction"]
        print(
            f"\nfine-tuned on {facts['finetune_tokens']:,} tokens"
            + (f" ({fraction:.1%} of pretraining)" if fraction else "")
            + f": {out['model_dir']}"
        )
        print(format_results(out["results"]))
        if out["registered"]:
            reg = out["registered"]
            print(f"registered {reg['name']} version {reg['version']}: {reg['uri']}")
            if args.alias:
                print(f"alias: models:/{reg['name']}@{args.alias}")
        return 0
    if args.task.startswith(("glue:", "xnli:")):
        settings = {}
        if args.seeds:
            settings["seeds"] = tuple(int(s) for s in args.seeds.split(","))
        for key in ("epochs", "lr", "loss", "eval_languages", "train_limit", "train_file"):
            if getattr(args, key) is not None:
                settings[key] = getattr(args, key)
        if args.eval_file:
            settings["eval_file"] = args.eval_file
        settings["device"] = args.device
        print(f"fine-tuning {args.model} on {args.task} ({args.recipe}) -> {output}")
        result = downstream.finetune_encoder(
            args.model,
            args.task,
            output_dir=output,
            recipe=args.recipe,
            settings=settings,
            experiment=args.experiment,
            save_model=True,
            register=args.register,
            alias=args.alias,
        )
        print(downstream.format_classification(result))
        print(f"best model: {result['best_model']}")
        if result.get("registered"):
            reg = result["registered"]
            print(f"registered {reg['name']} version {reg['version']}: {reg['uri']}")
        return 0
    raise HLMError(
        f"unknown task {args.task!r}; choose clm, glue:sst2, glue:cola, glue:mrpc, glue:rte, "
        "glue:qnli, glue:stsb (your files) or xnli:<ar|de|en|es|fr|hi|zh>"
    )


def cmd_eval(args) -> int:
    from hlm_ray import downstream
    from hlm_ray.evaluate import format_results
    from hlm_ray.evaluate.harness import split_tasks

    tasks = split_tasks(args.task)
    output = args.output or str(Path(downstream.resolve_model_dir(args.model)).parent / "eval")
    if args.model.startswith("models:/"):
        output = args.output or _default_output(args.model, "eval")
    tracker = downstream.run_tracker(args.model, args.experiment)
    results = downstream.evaluate(
        args.model,
        tasks,
        output_dir=resolve_output(output),
        limit=args.limit,
        batch_size=args.batch_size,
        device=args.device,
        tracker=tracker,
    )
    tracker.finish("FINISHED")
    print(format_results(results))
    print(f"results: {output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    handler = {
        "train": lambda args: cmd_train(args, argv),
        "compare": cmd_compare,
        "presets": cmd_presets,
        "finetune": cmd_finetune,
        "eval": cmd_eval,
        "sync": cmd_sync,
        "generate": cmd_generate,
        "sweep": lambda args: sweep_scripts.run(args, argv),
    }
    try:
        return handler.get(args.command, getattr(args, "handler", None))(args)
    except HLMError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
