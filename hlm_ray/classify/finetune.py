"""Fine-tune a pretrained encoder (headless or vanilla) as a sequence classifier: the public
entry point, from a model reference and a task name to the results file.

    from hlm_ray.classify import PAPER, TINY, finetune_classifier, recipe
    result = finetune_classifier("runs/tiny-enc", "glue:sst2", TINY, output_dir=Path("out"))
    result["summary"]["eval/accuracy"]          # {"mean", "std", "values"} at each seed's best epoch
    finetune_classifier(model_dir, "xnli:en", recipe("paper", "xnli:en"), eval_languages="all",
                        output_dir=Path("out"))    # zero-shot: train English, evaluate all seven
    finetune_classifier(model_dir, "glue:cola", replace(PAPER, epochs=3), output_dir=...)

The settings are a typed `hlm_ray.config.ClassifyConfig` (fields documented there; the recipes
in `recipes.py`). The parts: `inputs` (pairs to ids, batches), `model` (the classifier's load
and save), `loop` (epochs per seed, the best epoch). Everything lands in
``<output_dir>/classify_<task>.json`` (``glue:sst2`` -> ``classify_glue_sst2.json``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hlm_ray.classify.inputs import PairEncoder, encode_split, limit_examples
from hlm_ray.classify.loop import Run, summarise, train_seed
from hlm_ray.classify.loss import LOSSES
from hlm_ray.classify.recipes import PAPER
from hlm_ray.classify.tasks import get_task, load_task
from hlm_ray.config import ClassifyConfig
from hlm_ray.device import resolve_device
from hlm_ray.errors import HLMError
from hlm_ray.finetune.source import source_model
from hlm_ray.model_card import write_model_card
from hlm_ray.models import max_input_positions
from hlm_ray.tokenizer import load_tokenizer
from hlm_ray.tracking import Tracker


def finetune_classifier(
    model_ref: str | Path,
    task: str,
    settings: ClassifyConfig = PAPER,
    *,
    output_dir: Path,
    eval_languages: str | Sequence[str] | None = None,
    train_file: str | Path | None = None,
    eval_file: str | Path | None = None,
    eval_fraction: float = 0.2,
    split_seed: int = 0,
    device: str = "auto",
    tracker: Tracker | None = None,
    progress: bool = True,
    save_best_model: bool = False,
) -> dict[str, Any]:
    """Fine-tune `model_ref` on `task` once per seed, evaluating after every epoch.

    Returns (and writes to ``<output_dir>/classify_<task>.json``) the per-seed, per-epoch
    metrics, each seed's best epoch, and the mean / std over seeds at the best epochs.
    `tracker` (an `hlm_ray.tracking.Tracker`) gets the settings as params, every epoch's
    metrics as ``seed{s}/eval/...`` at step=epoch, and ``best/...`` summaries at the end.
    `save_best_model` saves the best (seed, epoch) model to ``classify_<task>_model/``.
    `eval_languages`, `train_file`, `eval_file`, `eval_fraction`, `split_seed`: which data
    (`hlm_ray.classify.tasks.load_task`)."""
    started = time.perf_counter()
    spec = get_task(task)
    seeds, epochs, batch_size, loss = (
        settings.seeds,
        settings.epochs,
        settings.batch_size,
        settings.loss,
    )
    if loss not in LOSSES:
        raise HLMError(f"loss={loss!r} is not one of {', '.join(LOSSES)}")
    if epochs < 1 or batch_size < 1 or not seeds:
        raise HLMError(
            f"need epochs >= 1, batch_size >= 1 and a seed (got {epochs}, "
            f"{batch_size}, {list(seeds)})"
        )
    folder, info = source_model(model_ref, "encoder", task)
    data = load_task(
        task,
        train_file=train_file,
        eval_file=eval_file,
        eval_fraction=eval_fraction,
        split_seed=split_seed,
        eval_languages=eval_languages,
    )
    tracker = tracker if tracker is not None else Tracker()
    device_t = resolve_device(device)

    tokenizer = load_tokenizer(folder)
    positions = max_input_positions(json.loads((folder / "config.json").read_text())) or 512
    encoder = PairEncoder(tokenizer, min(settings.max_length, positions))
    train = encode_split(encoder, limit_examples(data.train, settings.train_limit), spec)
    evals = {
        k: encode_split(encoder, limit_examples(v, settings.eval_limit), spec)
        for k, v in data.eval.items()
    }
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    slug = task.replace(":", "_")
    used = {
        **asdict(settings),
        "seeds": list(seeds),
        "loss": "mse" if spec.regression else loss,
        "max_length": encoder.max_len,
        "device": str(device_t),
    }
    best_dir = output_dir / f"classify_{slug}_model" if save_best_model else None
    run = Run(spec, folder, encoder, train, evals, device_t, used, tracker, best_dir, progress)
    model_desc = {"ref": str(model_ref), "path": str(folder), **info}
    data_desc = {
        "source": data.source,
        "note": data.note,
        "train_examples": len(train),
        "eval_examples": {k: len(v) for k, v in evals.items()},
        "eval_fraction": eval_fraction,
        "split_seed": split_seed,
    }
    tracker.log_params({"task": task, "model": model_desc, "data": data_desc, "finetune": used})
    per_seed = [train_seed(run, seed) for seed in seeds]
    summary = summarise(per_seed)
    result = {
        "task": task,
        "main_metric": run.main_key,
        "model": model_desc,
        "data": data_desc,
        "settings": used,
        "inputs": "own special tokens" if encoder.own_specials else "[cls] a [sep] (b [sep])",
        "seeds": per_seed,
        "best_epoch": {str(r["seed"]): r["best_epoch"] for r in per_seed},
        "summary": summary,
        "best_model": str(run.best_dir) if run.best_dir is not None else None,
        "wall_s": round(time.perf_counter() - started, 2),
    }
    path = output_dir / f"classify_{slug}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    if run.best_dir is not None:
        note = (
            f"Fine-tuned from `{model_ref}` on {task} ({data.note}). Scores: the mean over "
            f"seeds {list(seeds)} at each seed's best epoch; the saved weights are the best "
            "(seed, epoch) in `config.json`'s `hlm_classify`."
        )
        scores = {k: v["mean"] for k, v in summary.items()}
        write_model_card(run.best_dir, scores=scores, notes=[note], base=folder)
    best = {f"best/{k}": v["mean"] for k, v in summary.items()}
    best |= {f"best/{k}_std": v["std"] for k, v in summary.items()}
    tracker.log_metrics(best, step=epochs)
    tracker.log_artifact(path)
    return result
