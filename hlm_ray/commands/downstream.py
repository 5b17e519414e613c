"""`hlm finetune` and `hlm eval`: from a pretrained model to a generator or a classifier, and
its scores.

    hlm finetune --task clm --model runs/tiny-headless --register hlm-tiny-generator
    hlm finetune --task glue:sst2 --model runs/tiny-encoder-headless
    hlm eval --model runs/tiny-headless-clm --task lambada,bpb
    hlm eval --model runs/tiny-gen --task lambada,harness:lambada_openai
"""

from __future__ import annotations

from pathlib import Path

from hlm_ray.commands.common import (
    add_command,
    default_output,
    device_arg,
    device_overrides,
    launch_args,
    launch_settings,
    readout_arg,
    run_training,
)
from hlm_ray.errors import HLMError
from hlm_ray.paths import resolve_output

MODEL_HELP = "run/checkpoint/model folder or models:/"
# Classifier flags passed on to the recipe as they are (--seeds is parsed first).
CLASSIFIER_SETTINGS = ("epochs", "lr", "loss", "eval_languages", "train_limit", "train_file")


def add_parsers(sub) -> None:
    finetune = add_command(sub, "finetune", cmd_finetune)
    finetune.add_argument("--task", required=True, help="clm | glue:<name> | xnli:<lang>")
    finetune.add_argument("--model", required=True, help=MODEL_HELP)
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
    launch_args(finetune)

    ev = add_command(sub, "eval", cmd_eval)
    ev.add_argument("--model", required=True, help=MODEL_HELP)
    ev.add_argument(
        "--task",
        required=True,
        help="comma-separated: lambada, bpb, synonyms, anisotropy, then optionally "
        "harness:<lm-eval task>[,<task>...] (takes the rest of the list), e.g. "
        "lambada,harness:lambada_openai,sst2",
    )
    ev.add_argument(
        "--limit",
        type=int,
        help="examples per task, 1 or more (default: each task's own: every LAMBADA passage "
        "and harness document, the first 500 passages for bpb, 200 for anisotropy)",
    )
    ev.add_argument("--batch-size", type=int, default=32, help="sequences per forward pass (32)")
    readout_arg(ev)
    device_arg(ev)
    ev.add_argument(
        "--output",
        help="folder for the JSON results (default: eval/ in the model's run folder; "
        "runs/NAME-VERSION-eval for models:/NAME/VERSION)",
    )
    ev.add_argument("--experiment", default="hlm_ray", help="MLflow experiment name")


def cmd_finetune(args) -> int:
    """headless decoder -> generator (clm); encoder -> classifier (glue/xnli)

    clm: give a headless decoder a real output head (an untied copy of its input embedding)
    trained with cross-entropy, then score it on LAMBADA; glue:/xnli: fine-tune an encoder as a
    sequence classifier over seeds, best epoch reported."""
    if args.alias and not args.register:
        raise HLMError("--alias names a version of a registered model: give --register NAME too")
    launch_settings(args)
    suffix = args.task.replace(":", "-")
    output = str(resolve_output(args.output or default_output(args.model, suffix)))
    if args.task == "clm":
        return _finetune_generator(args, output)
    if args.task.startswith(("glue:", "xnli:")):
        return _finetune_classifier(args, output)
    raise HLMError(
        f"unknown task {args.task!r}; choose clm, glue:sst2, glue:cola, glue:mrpc, glue:rte, "
        "glue:qnli, glue:stsb (your files) or xnli:<ar|de|en|es|fr|hi|zh>"
    )


def _finetune_generator(args, output: str) -> int:
    from hlm_ray import downstream
    from hlm_ray.evaluate import format_results

    print(f"fine-tuning {args.model} into a generator ({args.recipe}) -> {output}")
    out = downstream.finetune_generator(
        args.model,
        output_dir=output,
        recipe=args.recipe,
        probe=args.probe,
        overrides=[*device_overrides(args), *args.set],
        train=lambda cfg: run_training(cfg, args),
        eval_limit=args.eval_limit or None,
        register=args.register,
        alias=args.alias,
        experiment=args.experiment,
    )
    facts = out["facts"]
    fraction = facts["pretrain_token_fraction"]
    print(
        f"\nfine-tuned on {facts['finetune_tokens']:,} tokens"
        + (f" ({fraction:.1%} of pretraining)" if fraction else "")
        + f": {out['model_dir']}"
    )
    print(format_results(out["results"]))
    _print_registered(out["registered"], args.alias)
    return 0


def _finetune_classifier(args, output: str) -> int:
    from hlm_ray import downstream

    settings = {k: getattr(args, k) for k in CLASSIFIER_SETTINGS if getattr(args, k) is not None}
    if args.seeds:
        settings["seeds"] = tuple(int(s) for s in args.seeds.split(","))
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
    _print_registered(result.get("registered"), args.alias)
    return 0


def _print_registered(reg: dict | None, alias: str | None) -> None:
    if reg:
        print(f"registered {reg['name']} version {reg['version']}: {reg['uri']}")
        if alias:
            print(f"alias: models:/{reg['name']}@{alias}")


def cmd_eval(args) -> int:
    """LAMBADA, bits per byte, synonyms, anisotropy, lm-evaluation-harness tasks

    Score a model on evaluation tasks at the context length it was trained on; JSON per task in
    --output, a table printed, and metrics logged to the model's MLflow run (eval/...)."""
    from hlm_ray.evaluate.harness import check_tasks, require_harness, split_tasks
    from hlm_ray.pretrained import resolve_model_dir

    if args.limit is not None and args.limit < 1:  # 0 silently meant bpb's default of 500
        raise HLMError(
            f"--limit={args.limit}: give 1 or more examples per task, or leave --limit out "
            "for each task's default"
        )
    tasks = split_tasks(args.task)
    check_tasks(tasks)  # before torch: a mistyped task is answered at once
    require_harness(tasks)
    folder = Path(resolve_model_dir(args.model))
    output = args.output or str(folder.parent / "eval")
    _check_readout(folder, args.readout)
    if args.model.startswith("models:/"):
        output = args.output or default_output(args.model, "eval")
    out_dir = resolve_output(output)
    existed = Path(out_dir).exists()
    from hlm_ray import downstream
    from hlm_ray.evaluate import format_results

    tracker = downstream.run_tracker(args.model, args.experiment)
    try:
        results = downstream.evaluate(
            args.model,
            tasks,
            output_dir=out_dir,
            limit=args.limit,
            batch_size=args.batch_size,
            device=args.device,
            tracker=tracker,
            readout=args.readout,
        )
    finally:
        # The model's own run, reopened to log eval/ metrics, was finished before: a failed
        # evaluation does not fail it (nor leave it RUNNING).
        tracker.finish("FINISHED")
        if not existed and Path(out_dir).is_dir() and not any(Path(out_dir).iterdir()):
            Path(out_dir).rmdir()  # a task that failed first leaves no empty folder
    print(format_results(results))
    print(f"results: {output}")
    return 0


def _check_readout(folder: Path, readout: str | None) -> None:
    """A decoder's readout, with its readout.json and token counts, checked before any model
    loads: a damaged record or counts file is one line here, not a traceback mid-evaluation."""
    from hlm_ray.pretrained import model_info
    from hlm_ray.readout import resolve_readout

    if model_info(folder)["family"] == "decoder":
        resolve_readout(folder, readout)
