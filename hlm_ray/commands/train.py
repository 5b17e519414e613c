"""`hlm train`, `hlm compare`, `hlm sync` and `hlm presets`: pretraining runs and their records.

hlm train --preset tiny-decoder --objective headless --output runs/tiny-headless
hlm train --resume runs/tiny-headless --set optim.max_steps=300   # the run's own config
hlm train --preset pythia-70m --num-workers 8 --gpu --dry-run --overhead-s 120   # a plan
hlm compare --preset tiny-decoder --output runs/compare
hlm sync runs/tiny-headless
hlm presets
"""

from __future__ import annotations

import sys
from pathlib import Path

from hlm_ray.commands.common import (
    add_command,
    config_args,
    device_overrides,
    launch_args,
    launch_settings,
    load_args_config,
    run_training,
)
from hlm_ray.errors import HLMError
from hlm_ray.paths import resolve_input, resolve_output


def add_parsers(sub) -> None:
    train = add_command(sub, "train", cmd_train)
    config_args(train)
    launch_args(train)
    train.add_argument("--output", help="run folder (default runs/<preset>-<objective>)")
    train.add_argument(
        "--resume",
        help="a run folder (its newest valid checkpoint) or a checkpoint folder to continue, "
        "with the run's own config and launch settings",
    )
    from hlm_ray.plan import add_arguments as plan_arguments

    plan_arguments(train)
    # One run has no per-trial start-up to add unless asked: --overhead-s adds it to the plan.
    train.set_defaults(overhead_s=0.0)

    sync = add_command(sub, "sync", cmd_sync)
    sync.add_argument(
        "run", help="the run folder (an `hlm train --output`), or a sweep's (runs/sweeps/<name>)"
    )
    sync.add_argument(
        "--tracking-uri",
        default=None,
        help="the MLflow store that holds the run (default: the one the folder recorded, then "
        "$MLFLOW_TRACKING_URI or the project's mlflow.db)",
    )

    compare = add_command(sub, "compare", cmd_compare)
    config_args(compare)
    launch_args(compare)
    compare.add_argument(
        "--output", default=None, help="folder for both runs and the plot (replaced on re-run)"
    )

    add_command(sub, "presets", cmd_presets)


def cmd_train(args, argv: list[str]) -> int:
    """pretrain one model (Ray Train, tracked in MLflow)

    Pretrain one model from a preset (plus YAML and --set overrides) on Ray Train or in this
    process; checkpoints, metrics and the final model go to the run folder and MLflow. --resume
    continues a run; --dry-run prints its cost plan (--overhead-s: a fixed cost added to it)."""
    # Plain Python up to the run itself: a mistyped preset, key or value, a wrong flag or
    # output folder is answered before torch, transformers, Ray or MLflow are imported.
    from hlm_ray.train.checkpoint import refuse_existing, resolve_resume
    from hlm_ray.train.preflight import check_output
    from hlm_ray.train.resume import discard_launch, resumed_config, save_launch, stored_checkpoint
    from hlm_ray.train.run_lock import acquire

    resume = resume_from = None
    if args.resume:
        stored = stored_checkpoint(args)  # a run whose checkpoints are in its storage (s3://)
        resume = stored or resolve_resume(resolve_input(args.resume))
        named = not stored and resolve_input(args.resume).resolve() == resume.resolve()
        resume_from = resume if named else None
        args.output = args.output or str(resume.parent)
        launch_settings(args, resume.parent)
        from hlm_ray.tracking.base import read_run_ref

        read_run_ref(resume.parent)  # a damaged one is one line now, not after Ray's start
        output = args.output
        overrides = [
            *device_overrides(args),
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
        launch_settings(args)
        objective = args.objective or "headless"
        output = args.output or f"runs/{args.preset or 'tiny-decoder'}-{objective}"
        cfg = load_args_config(args, output, args.objective)
    if args.dry_run:
        return _print_plan(cfg, args)
    if resume is None:
        refuse_existing(cfg.run.output_dir)
    check_output(Path(cfg.run.output_dir))
    release = acquire(cfg.run.output_dir)  # one writer per run folder, from launch.json on
    save_launch(cfg.run.output_dir, vars(args))
    where = "this process" if args.local else f"Ray Train, {args.num_workers} worker(s)"
    print(f"training {cfg.preset} ({cfg.model.arch}, {cfg.objective.name}) on {where} -> {output}")
    try:
        summary = run_training(cfg, args, resume=resume, resume_from=resume_from)
    except HLMError:
        if resume is None:
            discard_launch(cfg.run.output_dir)  # bad input: leave no lone launch.json
        raise
    except KeyboardInterrupt as err:
        from hlm_ray.train.interrupt import (
            EXIT_INTERRUPTED,
            RunInterrupted,
            continue_message,
            not_started_message,
        )

        if isinstance(err, RunInterrupted):  # an MLflow run was opened and is marked KILLED
            run_dir = Path(cfg.run.output_dir)
            said = continue_message(
                run_dir, str(output), argv, args.config, args.set, args.storage_path
            )
        else:  # preparing the tokenizer or corpus: no MLflow run was opened
            said = not_started_message(argv)
            if resume is None:
                discard_launch(cfg.run.output_dir)
        print(f"\ninterrupted: {said}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        release()
    from hlm_ray.train.summary import format_summary

    print(format_summary([summary]))
    return 0


def _print_plan(cfg, args) -> int:
    from hlm_ray.plan import assumptions_from, format_plan, train_plan

    assumptions = assumptions_from(args)
    # On GPUs when the run would use them (--gpu, or a GPU here) or a GPU plan is asked for
    # (--gpu-type, --mfu, --cluster-gpus); else on this machine's CPUs, where it would run.
    on_gpus = args.gpu or (args.gpu is None and (assumptions.gpu_asked or _local_gpus()))
    threads = None
    if args.local and not on_gpus:  # this process: torch's own thread count
        import torch

        threads = torch.get_num_threads()
    plan = train_plan(
        cfg,
        assumptions,
        workers=args.num_workers,
        gpus_per_worker=1.0 if on_gpus else 0.0,
        cpus_per_worker=args.cpus_per_worker,
        threads=threads,
        say=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(format_plan(plan))
    return 0


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def cmd_sync(args) -> int:
    """send a run's metrics that MLflow missed (an outage)

    Send MLflow what a run recorded while the tracking server was down: the missing metric
    points (never the ones it has), params, final artifacts, status. Given a sweep's folder:
    every trial's, then the parent run's summary, figures and status."""
    from hlm_ray.tracking.sync import sync_run

    folder = resolve_input(args.run)  # in a job's copy of the checkout: where outputs went
    if (folder / "sweep.json").is_file():  # tune.storage.STATE_FILE
        from hlm_ray.tune.replay import sync_sweep

        report = sync_sweep(folder, args.tracking_uri)
        print(
            f"synced sweep {args.run} to MLflow: {report['metrics_logged']} metric point(s) of "
            f"{report['trials']} trial(s), {len(report['artifacts_logged'])} file(s) on the "
            f"parent run {report['run_id']}; status {report['status']}"
        )
        return 0
    report = sync_run(folder, tracking_uri=args.tracking_uri)
    print(
        f"synced {args.run} to MLflow run {report['run_id']}: {report['metrics_logged']} metric "
        f"point(s), {report['params_logged']} param(s), "
        f"{len(report['artifacts_logged'])} artifact(s) sent; status {report['status']}"
    )
    return 0


def cmd_compare(args) -> int:
    """pretrain headless and vanilla, print both

    Pretrain the preset once headless and once vanilla, then print both summaries and plot
    their loss curves and throughput side by side."""
    import shutil

    from hlm_ray.train.summary import format_summary, plot_runs

    launch_settings(args)
    root = Path(args.output or f"runs/compare-{args.preset or 'tiny-decoder'}")
    summaries = []
    for objective in ("headless", "vanilla"):
        cfg = load_args_config(args, str(root / objective), objective)
        shutil.rmtree(cfg.run.output_dir, ignore_errors=True)  # compare always starts afresh
        print(f"\n== {objective}: {cfg.preset} ({cfg.model.arch}) -> {cfg.run.output_dir}")
        summaries.append(run_training(cfg, args))
    print()
    print(format_summary(summaries))
    figure = plot_runs([root / "headless", root / "vanilla"], root / "compare.png")
    print(f"\nloss curves and throughput: {figure}")
    return 0


def cmd_presets(args) -> int:
    """list the presets

    List the named presets: architecture, shape, sequence length, batch, learning rate,
    schedule and steps."""
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
