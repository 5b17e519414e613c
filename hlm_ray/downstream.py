"""The stages after pretraining, chained and recorded: evaluate, fine-tune, register.

    results = evaluate("runs/tiny-gen", ["lambada", "bpb"], output_dir="runs/tiny-gen/eval")
    out = finetune_generator("runs/tiny-headless", output_dir="runs/tiny-gen", register="tiny-gen")
    out = finetune_encoder("runs/tiny-enc", "glue:sst2", output_dir="runs/tiny-enc/glue-sst2")
    scores = run_downstream(Path("runs/x/model"), recipe="tiny", output_dir=..., tracker=...)

`hlm finetune` / `hlm eval` are thin over these; a sweep trial calls `run_downstream`, the
paper's protocol for the model's family (decoders: a headless arm is fine-tuned into a generator
first, then LAMBADA and bits per byte; encoders: the GLUE-style fine-tuning average).
Everything is logged to MLflow when a run is given (or found in the model's run folder).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from hlm_ray.config import Config, apply_overrides
from hlm_ray.device import device_name
from hlm_ray.errors import HLMError
from hlm_ray.finetune.generators import GENERATORS
from hlm_ray.finetune.source import source_model
from hlm_ray.model_card import write_model_card
from hlm_ray.pretrained import load_pretrained, model_info
from hlm_ray.tracking import MlflowTracker, Tracker, default_tracking_uri, read_run_ref

# Registered models' input examples (MLflow shows them and checks the signature with them).
SINGLE_EXAMPLE = "a gripping, beautifully acted film"
PAIR_EXAMPLE = {"text": "The cat sat on the mat.", "text_pair": "A cat was sitting on a mat."}

# What a sweep trial runs downstream, per recipe. The paper's GLUE average leaves RTE out.
DOWNSTREAM = {
    "tiny": {
        "lambada_limit": 500,
        "bpb_limit": 200,
        "glue_tasks": ("glue:sst2",),
        "clm_recipe": "tiny",
        "classify": "tiny",
    },
    "paper": {
        "lambada_limit": None,
        "bpb_limit": None,
        "glue_tasks": ("glue:cola", "glue:sst2", "glue:mrpc", "glue:qnli"),
        "clm_recipe": "text",
        "classify": "paper",
    },
    # sweeps/headline.py (paper Tables 1 and 3). The GLUE average leaves RTE out (scored and
    # reported on its own); a headless decoder's generator fine-tune gets `clm_share` of its
    # pretraining tokens (the paper: under 2%) instead of its recipe's step count.
    "headline-tiny": {
        "lambada_limit": 64,
        "bpb_limit": 16,
        "glue_tasks": ("glue:sst2", "glue:rte"),
        "average_excludes": ("glue:rte",),
        "clm_recipe": "tiny",
        "clm_share": 0.02,
        "classify": "tiny",
        "classify_settings": {"epochs": 1, "train_limit": 128, "eval_limit": 64},
    },
    "headline-cpu": {
        "lambada_limit": 500,
        "bpb_limit": 100,
        "glue_tasks": ("glue:sst2", "glue:cola", "glue:mrpc", "glue:rte", "glue:qnli"),
        "average_excludes": ("glue:rte",),
        "clm_recipe": "tiny",
        "clm_share": 0.02,
        "classify": "tiny",
        "classify_settings": {"epochs": 3, "train_limit": 1024, "eval_limit": 256},
    },
    "headline-paper": {
        "lambada_limit": None,
        "bpb_limit": None,
        "glue_tasks": ("glue:sst2", "glue:cola", "glue:mrpc", "glue:rte", "glue:qnli"),
        "average_excludes": ("glue:rte",),
        # The multilingual encoder (paper Figure 6) is scored on XNLI zero-shot: fine-tuned on
        # English, evaluated on the seven languages.
        "tasks_by_model_type": {"distilbert": ("xnli:en",)},
        "clm_recipe": "text",
        "clm_share": 0.02,
        "classify": "paper",
    },
}
# sweeps/scaling.py: decoders scored on bits per byte of held-out text alone (`score`), a
# headless arm after its generator fine-tune: the preset's `GENERATORS` settings on top of its
# `clm_recipe` (the paper preset: the `text` recipe, 10k steps of 256 sequences, as it is).
for _scale, _limit, _clm in (("tiny", 16, "tiny"), ("cpu", 100, "tiny"), ("paper", None, "text")):
    DOWNSTREAM[f"scaling-{_scale}"] = {
        "decoder_tasks": ("bpb",),
        "score": "bpb/bits_per_byte",
        "bpb_limit": _limit,
        "clm_recipe": _clm,
        "clm_settings": GENERATORS.get(_scale, {}),
    }
# The headline comparison's cpu decoders get the same generator as the scaling sweep's.
DOWNSTREAM["headline-cpu"] = {
    **{k: v for k, v in DOWNSTREAM["headline-cpu"].items() if k != "clm_share"},
    "clm_settings": GENERATORS["cpu"],
}


def share_steps(pretrain_tokens: int, share: float, tokens_per_step: int) -> int:
    """Optimizer steps of a fine-tune given `share` of the pretraining tokens (rounded down:
    never more than the share; at least one step)."""
    if not 0.0 < share < 1.0:
        raise HLMError(f"clm_share={share} must be a fraction between 0 and 1 (e.g. 0.02)")
    return max(1, math.floor(share * pretrain_tokens / tokens_per_step))


def run_tracker(model_ref: str | Path, experiment: str = "hlm_ray") -> Tracker:
    """The MLflow run of the run folder the model came from (its `mlflow_run.json`), or a no-op
    tracker when there is none (a bare model folder, a registry URI)."""
    if str(model_ref).startswith("models:/"):
        return Tracker()
    folder = Path(model_ref)
    for candidate in (folder, folder.parent):
        saved = read_run_ref(candidate)
        if saved is not None:
            return MlflowTracker(
                experiment, tracking_uri=saved.get("tracking_uri"), run_id=saved["run_id"]
            )
    return Tracker()


def evaluate(
    model_ref: str | Path,
    tasks: Sequence[str],
    *,
    output_dir: str | Path,
    limit: int | None = None,
    batch_size: int = 32,
    device: str = "auto",
    tracker: Tracker | None = None,
    progress: bool = True,
    readout: str | None = None,
) -> list[dict[str, Any]]:
    """Run each evaluation task on the model; JSON per task in `output_dir`; metrics and
    figures to `tracker` (prefixed ``eval/``). A decoder is scored through `readout`
    (`hlm_ray.readout`; None: the model's default)."""
    from hlm_ray.evaluate import get_task, write_result

    runners = [get_task(name) for name in tasks]  # unknown names fail before any loading
    device = device_name(device)
    pre = load_pretrained(model_ref, device=device, readout=readout or "auto")
    out = Path(output_dir)
    tracker = tracker or Tracker()
    results = []
    for runner in runners:
        result = runner(
            pre,
            output_dir=out,
            limit=limit,
            batch_size=batch_size,
            device=device,
            progress=progress,
        )
        path = write_result(result, out)
        tracker.log_metrics(
            {f"eval/{k}": float(v) for k, v in result["metrics"].items() if _finite(v)}, step=0
        )
        tracker.log_artifact(path, "eval")
        for figure in result.get("figures", []):
            tracker.log_artifact(figure, "eval")
        results.append(result)
    return results


def finetune_generator(
    model_ref: str | Path,
    *,
    output_dir: str | Path,
    recipe: str = "tiny",
    probe: bool = False,
    overrides: list[str] | dict[str, Any] | None = None,
    train: Callable[[Config], dict[str, Any]] | None = None,
    eval_limit: int | None = 500,
    register: str | None = None,
    alias: str | None = None,
    experiment: str = "hlm_ray",
    progress: bool = True,
) -> dict[str, Any]:
    """Fine-tune a headless decoder into a generator, score it on LAMBADA (and bits per byte),
    write its model card, and register it (as MLflow's ``text-generation`` model `register`,
    `alias` pointing at the new version). `train` runs the config (the CLI passes Ray Train or
    the local loop; the default is the local loop, with its own MLflow run)."""
    from hlm_ray.finetune.clm import clm_config, write_facts
    from hlm_ray.train.checkpoint import refuse_existing

    cfg, facts = clm_config(
        model_ref, recipe=recipe, probe=probe, output_dir=output_dir, overrides=overrides
    )
    refuse_existing(cfg.run.output_dir)
    out = Path(cfg.run.output_dir)
    started = time.perf_counter()
    summary = (train or _train_local(experiment, progress))(cfg)
    facts["finetune_seconds"] = time.perf_counter() - started
    write_facts(out, facts)
    tracker = run_tracker(out, experiment)
    tracker.log_params({f"finetune.{k}": v for k, v in facts.items() if k != "finetune_seconds"})
    results = evaluate(
        out,
        ["lambada", "bpb"],
        output_dir=out / "eval",
        limit=eval_limit,
        tracker=tracker,
        progress=progress,
    )
    tracker.log_artifact(out / "finetune.json")
    metrics = {k: v for r in results for k, v in r["metrics"].items()}
    write_model_card(out / "model", scores={k: v for k, v in metrics.items() if _finite(v)})
    registered = None
    if register:
        registered = _register(
            out / "model",
            register,
            task="text-generation",
            run_id=getattr(tracker, "run_id", None),
            experiment=experiment,
            extra=[out / "config.yaml", out / "finetune.json"],
            results={"metrics": metrics, "finetune": facts},
            tags={"hlm.source_model": facts["source_model"], "hlm.recipe": facts["recipe"]},
            alias=alias,
        )
    tracker.finish("FINISHED")
    return {
        "summary": summary,
        "facts": facts,
        "results": results,
        "model_dir": str(out / "model"),
        "registered": registered,
    }


def _register(model_dir: Path, name: str, *, extra: list[Path], **kwargs) -> dict[str, Any]:
    from hlm_ray.tracking import register_model

    extra_files = [path for path in extra if path.is_file()]
    name, version = register_model(model_dir, name, extra_files=extra_files, **kwargs)
    return {"name": name, "version": version, "uri": f"models:/{name}/{version}"}


def _train_local(experiment: str, progress: bool) -> Callable[[Config], dict[str, Any]]:
    from hlm_ray.train.launch import train_local

    return lambda cfg: train_local(cfg, experiment=experiment, progress=progress)


def finetune_encoder(
    model_ref: str | Path,
    task: str,
    *,
    output_dir: str | Path,
    recipe: str = "tiny",
    settings: dict[str, Any] | None = None,
    experiment: str = "hlm_ray",
    tracker: Tracker | None = None,
    progress: bool = True,
    save_model: bool = False,
    register: str | None = None,
    alias: str | None = None,
) -> dict[str, Any]:
    """Fine-tune an encoder into a classifier on `task` (GLUE / XNLI), seeds and best epoch as
    in the paper; logged to its own MLflow run unless a tracker is given. `save_model` keeps
    the best (seed, epoch) model in ``<output_dir>/classify_<task>_model/`` (with its card and
    a tokenizer that adds [CLS]/[SEP]); `register` also registers it as MLflow's
    ``text-classification`` model of that name (`alias` pointing at the new version)."""
    from hlm_ray.classify.finetune import finetune_classifier
    from hlm_ray.classify.recipes import recipe as classify_recipe

    source_model(model_ref, "encoder", task, hint="decoders are fine-tuned with --task clm")
    chosen = classify_recipe(recipe, task)
    names = {f.name for f in fields(chosen)}
    overrides = {k: v for k, v in (settings or {}).items() if k in names}
    data_options = {k: v for k, v in (settings or {}).items() if k not in names}
    chosen = replace(chosen, **overrides)
    kwargs = {**asdict(chosen), **data_options}
    own = tracker is None
    if own:
        name = f"{Path(output_dir).name}"
        tracker = MlflowTracker(
            experiment,
            name,
            tracking_uri=default_tracking_uri(),
            tags={"task": task, "source_model": str(model_ref), "stage": "classify"},
        )
    tracker.log_params({"task": task, "recipe": recipe, **{k: str(v) for k, v in kwargs.items()}})
    try:
        result = finetune_classifier(
            str(model_ref),
            task,
            chosen,
            output_dir=Path(output_dir),
            tracker=tracker,
            progress=progress,
            save_best_model=save_model or bool(register),
            **data_options,
        )
    except BaseException:
        if own:
            tracker.finish("FAILED")
        raise
    for path in Path(output_dir).glob("classify_*.json"):
        tracker.log_artifact(path, "classify")
    if register:
        from hlm_ray.classify import get_task

        scores = {k: v["mean"] for k, v in result["summary"].items()}
        result["registered"] = _register(
            Path(result["best_model"]),
            register,
            task="text-classification",
            input_example=PAIR_EXAMPLE if get_task(task).is_pair else SINGLE_EXAMPLE,
            run_id=getattr(tracker, "run_id", None),
            experiment=experiment,
            extra=[],
            results={"metrics": scores, "task": task, "settings": result["settings"]},
            tags={"hlm.source_model": str(model_ref), "hlm.task": task, "hlm.recipe": recipe},
            alias=alias,
        )
    if own:
        tracker.finish("FINISHED")
    return result


def run_downstream(
    model_dir: Path,
    *,
    recipe: str,
    output_dir: Path,
    tracker: Tracker,
    progress: bool = False,
) -> dict[str, float]:
    """The paper's downstream protocol for the model's family; flat metrics for a sweep trial.

    Decoders: a headless arm is fine-tuned into a generator (`clm` recipe of `recipe`), then
    both arms are scored on LAMBADA (``downstream/score`` = accuracy) and bits per byte, and
    the model as pretrained through its other readouts (`hlm_ray.evaluate.readouts`):
    ``bpb/tied`` and ``bpb/prior`` for a headless arm, ``bpb/prior`` for a vanilla one.
    Encoders: fine-tuned on the recipe's GLUE tasks; ``downstream/score`` is the mean of each
    task's main metric (mean over seeds of the best epoch)."""
    if recipe not in DOWNSTREAM:
        raise HLMError(
            f"unknown downstream recipe {recipe!r}; choose one of {', '.join(DOWNSTREAM)}"
        )
    plan = DOWNSTREAM[recipe]
    info = model_info(model_dir)
    output_dir = Path(output_dir)
    metrics: dict[str, float] = {}
    device = device_name("auto")  # the trial's GPU, when it reserved one (CUDA_VISIBLE_DEVICES)
    if info["objective"] == "headless" and not info["finetuned"]:
        metrics.update(_update_probe(model_dir, output_dir, device))
    if info["family"] == "decoder":
        scored = model_dir
        if info["objective"] == "headless" and not info["finetuned"]:
            started = time.perf_counter()
            from hlm_ray.finetune.clm import clm_config, fixed_config
            from hlm_ray.train.loop import train_worker

            cfg, facts = clm_config(
                model_dir, recipe=plan["clm_recipe"], output_dir=output_dir / "clm"
            )
            if plan.get("clm_settings"):
                cfg, facts = fixed_config(cfg, facts, plan["clm_settings"])
            elif plan.get("clm_share") and facts["pretrain_tokens"]:
                cfg, facts = _share_config(cfg, facts, plan["clm_share"])
                metrics["finetune/share"] = plan["clm_share"]
            train_worker(cfg.to_dict(), progress=progress)
            metrics["finetune/steps"] = cfg.optim.max_steps
            metrics["finetune/tokens"] = facts["finetune_tokens"]
            scored = output_dir / "clm" / "model"
            metrics["finetune/seconds"] = time.perf_counter() - started
            metrics["finetune/pretrain_token_fraction"] = facts["pretrain_token_fraction"] or 0.0
        pre = load_pretrained(scored, device=device)
        from hlm_ray.evaluate import get_task

        for name in plan.get("decoder_tasks", ("lambada", "bpb")):
            result = get_task(name)(
                pre,
                output_dir=output_dir,
                limit=plan[f"{name}_limit"],
                batch_size=32,
                device=device,
                progress=progress,
            )
            metrics.update(result["metrics"])
        if "bpb" in plan.get("decoder_tasks", ("lambada", "bpb")):
            # The never-fine-tuned model through its other readouts: bpb/tied and bpb/prior
            # (headless), bpb/prior (vanilla: its head + log q, which should score worse).
            from hlm_ray.evaluate.readouts import readout_bpb

            metrics.update(readout_bpb(model_dir, limit=plan["bpb_limit"], device=device))
        if scored != model_dir:  # the generator this trial made: say what it is
            write_model_card(scored, scores={k: v for k, v in metrics.items() if _finite(v)})
        metrics["downstream/score"] = metrics[plan.get("score", "lambada/accuracy")]
        metrics["bpb"] = metrics["bpb/bits_per_byte"]
    else:
        scores = []
        tasks = plan.get("tasks_by_model_type", {}).get(info["model_type"], plan["glue_tasks"])
        for task in tasks:
            extra = {"eval_languages": "all"} if task.startswith("xnli:") else {}
            result = finetune_encoder(
                model_dir,
                task,
                output_dir=output_dir / task.replace(":", "-"),
                recipe=plan["classify"],
                settings={**plan.get("classify_settings", {}), **extra, "device": device},
                tracker=Tracker(),
                progress=progress,
            )
            score = float(result["summary"][result["main_metric"]]["mean"])
            metrics[f"{task}/score"] = score
            if task not in plan.get("average_excludes", ()):
                scores.append(score)
        metrics["downstream/score"] = sum(scores) / len(scores)
    tracker.log_metrics({k: v for k, v in metrics.items() if _finite(v)}, step=0)
    return metrics


def _share_config(cfg: Config, facts: dict[str, Any], share: float):
    """The generator fine-tune cut to `share` of the pretraining tokens (warm-up at most a
    quarter of its steps), and its facts updated."""
    per_step = cfg.optim.global_batch_size * cfg.data.seq_len
    steps = share_steps(facts["pretrain_tokens"], share, per_step)
    warmup = min(cfg.optim.warmup_steps, steps // 4)
    cfg = apply_overrides(cfg, {"optim.max_steps": steps, "optim.warmup_steps": warmup})
    tokens = steps * per_step
    facts = {
        **facts,
        "finetune_tokens": tokens,
        "pretrain_token_fraction": tokens / facts["pretrain_tokens"],
    }
    return cfg, facts


def _update_probe(model_dir: Path, output_dir: Path, device: str) -> dict[str, float]:
    """The lazy embedding update's speed beside the dense one on this run's model shape
    (`hlm_ray.bench.update_probe`): the step times in update_probe.json, their medians as
    `speed/*` metrics."""
    import statistics

    from hlm_ray.bench.update_probe import update_probe, write_probe
    from hlm_ray.pretrained import run_config_of

    cfg = run_config_of(Path(model_dir))
    if cfg is None:
        return {}
    import json

    vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    times = update_probe(cfg, vocab, device)
    write_probe(times, output_dir, cfg.optim.micro_batch_size * cfg.data.seq_len)
    dense, lazy = (statistics.median(times[k]) for k in ("dense", "lazy"))
    return {
        "speed/dense_step_s": dense,
        "speed/lazy_step_s": lazy,
        "speed/lazy_speedup": dense / lazy,
    }


def format_classification(result: dict[str, Any]) -> str:
    """A Markdown table: one row per metric, mean ± std over seeds at each seed's best epoch."""
    seeds = result["seeds"]
    best = ", ".join(f"seed {s['seed']}: epoch {s['best_epoch']}" for s in seeds)
    lines = [
        f"{result['task']} on {result['model']['ref']} ({result['data']['note']})",
        f"best epochs by {result['main_metric']}: {best}",
        "",
        "| metric | mean | std | per seed |",
        "|---|---|---|---|",
    ]
    for key, stats in result["summary"].items():
        values = ", ".join(f"{v:.4f}" for v in stats["values"])
        std = stats["std"]
        std_text = "-" if std is None or not math.isfinite(std) else f"{std:.4f}"
        lines.append(f"| {key} | {stats['mean']:.4f} | {std_text} | {values} |")
    return "\n".join(lines)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
