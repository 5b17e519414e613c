"""Fine-tune a pretrained encoder (headless or vanilla) as a sequence classifier.

    from hlm_ray.classify.finetune import PAPER, TINY, finetune_classifier, recipe
    result = finetune_classifier("runs/tiny-enc", "glue:sst2", TINY, output_dir=Path("out"))
    result["summary"]["eval/accuracy"]          # {"mean", "std", "values"} at each seed's best epoch
    finetune_classifier(model_dir, "xnli:en", recipe("paper", "xnli:en"), eval_languages="all",
                        output_dir=Path("out"))    # zero-shot: train English, evaluate all seven
    finetune_classifier(model_dir, "glue:cola", replace(PAPER, epochs=3), output_dir=...)

The settings are a typed `hlm_ray.config.ClassifyConfig` (fields documented there). The paper's
protocol (Appendix B.2, `PAPER`): AdamW lr 1e-5, batch 32, a constant schedule after
a linear warm-up over 10% of the steps, 10 epochs, balanced cross-entropy, 3 seeds, evaluation
after every epoch and the best epoch reported. The main text gives weight decay 0.01 and Table 13
gives 0: `PAPER` follows the text (and the authors' GLUE script). XNLI (Table 15, `PAPER_XNLI`):
lr 2e-5, batch 128, plain cross-entropy, no weight decay (the epoch count is not given; 10).

The model is `AutoModelForSequenceClassification.from_pretrained(model_dir)`: it reads the
encoder weights of a bare `BertModel` (headless) or a `*ForMaskedLM` (vanilla) folder and adds a
new pooler + classifier (seeded per run); the load is checked so that no encoder weight is left
randomly initialised. Inputs are ``[cls] a [sep]`` or ``[cls] a [sep] b [sep]`` built here, since
hlm_ray's byte-level tokenizers add no special tokens themselves (a tokenizer that does, such
as a hub BERT's, encodes the pair itself); pairs are truncated longest-first (as the
`tokenizers` library does, so the saved tokenizer matches: `classify/template.py`) to
min(max_length, model positions); batches are padded per batch with an attention mask, and
segment ids stay 0 (hlm_ray pretraining never uses a second segment).

The best epoch of a seed maximises the task's main metric; for XNLI evaluated on several
languages, the mean over those languages. Everything lands in ``<output_dir>/classify_<task>.json``
(``glue:sst2`` -> ``classify_glue_sst2.json``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from hlm_ray.classify.loss import LOSSES, regression_mse
from hlm_ray.classify.metrics import task_metrics
from hlm_ray.classify.tasks import GLUE_EVAL, Example, TaskSpec, get_task, load_task
from hlm_ray.classify.template import adds_special_tokens, special_ids, with_classifier_template
from hlm_ray.config import ClassifyConfig
from hlm_ray.device import resolve_device
from hlm_ray.errors import HLMError, one_line
from hlm_ray.model_card import write_model_card
from hlm_ray.models import max_input_positions
from hlm_ray.pretrained import model_info, resolve_model_dir
from hlm_ray.tokenizer import load_tokenizer
from hlm_ray.tracking import Tracker

# The recipes `--recipe` names. TINY: seconds on a CPU; a higher lr than the paper's so that a
# tiny encoder learns something.
TINY = ClassifyConfig(
    seeds=(0,), epochs=3, lr=3e-4, batch_size=16, max_length=64, train_limit=1024, eval_limit=512
)
PAPER = ClassifyConfig()  # the defaults are the paper's GLUE protocol
PAPER_XNLI = replace(PAPER, lr=2e-5, batch_size=128, weight_decay=0.0, loss="ce")
RECIPES = {"tiny": TINY, "paper": PAPER}


def recipe(name: str, task: str) -> ClassifyConfig:
    """The settings of recipe `name` for `task` (the paper used other ones for XNLI)."""
    if name not in RECIPES:
        raise HLMError(f"unknown recipe {name!r}; recipes: {', '.join(RECIPES)}")
    if name == "paper" and task.startswith("xnli:"):
        return PAPER_XNLI
    return RECIPES[name]


# ----------------------------------------------------------------------------- inputs


def _truncate_pair(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Longest-first truncation exactly as the `tokenizers` library does it (so a saved
    tokenizer called with ``truncation=True`` builds the same inputs): a text no longer than
    half the budget is kept whole and the other gets the rest; otherwise the shorter gets
    budget // 2 and the longer the rest (the second text, when both are equally long)."""
    if len_a + len_b <= budget:
        return len_a, len_b
    short = min(len_a, len_b)
    if short <= budget // 2:
        keep_short, keep_long = short, budget - short
    else:
        keep_short, keep_long = budget // 2, budget - budget // 2
    if len_a > len_b:
        return min(len_a, keep_long), min(len_b, keep_short)
    return min(len_a, keep_short), min(len_b, keep_long)


class PairEncoder:
    """Token ids ``[cls] a [sep] (b [sep])`` of examples, at most `max_len` long."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, max_len: int):
        if max_len < 8:
            raise HLMError(f"max_length={max_len} is too short for a classifier input; use >= 8")
        self.tokenizer, self.max_len = tokenizer, max_len
        self.own_specials = adds_special_tokens(tokenizer)
        # A tokenizer without cls / sep (a decoder's) falls back to bos / eos, then to none.
        cls, sep = special_ids(tokenizer)
        self.prefix = [cls] if cls is not None else []
        self.sep = [sep] if sep is not None else []
        self.pad_id = next(i for i in (tokenizer.pad_token_id, sep, 0) if i is not None)

    def __call__(self, examples: Sequence[Example]) -> list[list[int]]:
        texts_a = [e.text_a for e in examples]
        texts_b = (
            [e.text_b for e in examples] if examples and examples[0].text_b is not None else None
        )
        if self.own_specials:
            enc = self.tokenizer(texts_a, texts_b, truncation=True, max_length=self.max_len)
            return [ids or [self.pad_id] for ids in enc["input_ids"]]
        ids_a = self.tokenizer(texts_a, add_special_tokens=False)["input_ids"]
        ids_b = self.tokenizer(texts_b, add_special_tokens=False)["input_ids"] if texts_b else None
        n_special = len(self.prefix) + len(self.sep) * (2 if ids_b else 1)
        budget = self.max_len - n_special
        out = []
        for i, a in enumerate(ids_a):
            if ids_b is None:
                seq = self.prefix + a[:budget] + self.sep
            else:
                b = ids_b[i]
                len_a, len_b = _truncate_pair(len(a), len(b), budget)
                seq = self.prefix + a[:len_a] + self.sep + b[:len_b] + self.sep
            out.append(seq or [self.pad_id])  # never an all-masked row
        return out


@dataclass
class EncodedSplit:
    ids: list[list[int]]
    labels: torch.Tensor  # (N,) int64 class ids, or float32 scores for regression

    def __len__(self) -> int:
        return len(self.ids)


def _encode(encoder: PairEncoder, examples: list[Example], spec: TaskSpec) -> EncodedSplit:
    dtype = torch.float32 if spec.regression else torch.long
    return EncodedSplit(encoder(examples), torch.tensor([e.label for e in examples], dtype=dtype))


def _batches(
    split: EncodedSplit, order: Sequence[int], batch_size: int, pad_id: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids_BL, attention_mask_BL, labels_B), padded to each batch's longest row."""
    for start in range(0, len(order), batch_size):
        idx = list(order[start : start + batch_size])
        rows = [split.ids[i] for i in idx]
        ids_BL = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
        mask_BL = torch.zeros_like(ids_BL)
        for r, row in enumerate(rows):
            ids_BL[r, : len(row)] = torch.tensor(row)
            mask_BL[r, : len(row)] = 1
        yield ids_BL.to(device), mask_BL.to(device), split.labels[idx].to(device)


# ----------------------------------------------------------------------------- model


@contextmanager
def _quiet_transformers():
    """The missing-head-weights report is expected here (and checked below), not news."""
    from transformers.utils import logging as hf_logging

    previous, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)
        if bars:
            hf_logging.enable_progress_bar()


def load_classifier(
    folder: Path, spec: TaskSpec, device: torch.device
) -> tuple[PreTrainedModel, list[str]]:
    """The encoder in `folder` with a new classification head, and the names of the new weights.

    Raises `HLMError` when an encoder weight was not found in the checkpoint (it would be
    silently re-initialised otherwise)."""
    from transformers import AutoModelForSequenceClassification

    labels = spec.label_names or ("score",)
    try:
        with _quiet_transformers():
            model, info = AutoModelForSequenceClassification.from_pretrained(
                str(folder),
                num_labels=spec.num_labels,
                problem_type="regression" if spec.regression else "single_label_classification",
                id2label=dict(enumerate(labels)),
                label2id={name: i for i, name in enumerate(labels)},
                output_loading_info=True,
            )
    except (OSError, ValueError) as err:
        raise HLMError(f"cannot load {folder} as a classifier: {one_line(err)}") from None
    prefix = f"{model.base_model_prefix}."
    # A bare or MLM checkpoint has no pooler (hlm_ray builds BertModel without one): it is head.
    missing_body = [k for k in info["missing_keys"] if k.startswith(prefix) and ".pooler." not in k]
    if missing_body:
        raise HLMError(
            f"{folder}: {len(missing_body)} encoder weights (e.g. {missing_body[0]}) are not in "
            "the checkpoint; pass an encoder saved by hlm_ray or save_pretrained"
        )
    return model.to(device), sorted(info["missing_keys"])


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (by shape, as hlm_ray.train.optim does)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def constant_with_warmup(
    optimizer: torch.optim.Optimizer, warmup_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """lr ramps linearly over the first `warmup_steps` steps ((step + 1) / warmup), then stays."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
    )


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def predict(
    model: PreTrainedModel,
    split: EncodedSplit,
    spec: TaskSpec,
    *,
    batch_size: int,
    pad_id: int,
    device: torch.device,
) -> np.ndarray:
    """(N,) predicted class ids (scores for regression) of an encoded split, in its order."""
    model.eval()
    order = np.argsort([len(ids) for ids in split.ids], kind="stable")  # less padding
    preds = []
    for ids_BL, mask_BL, _ in _batches(split, order, batch_size, pad_id, device):
        logits_BC = model(input_ids=ids_BL, attention_mask=mask_BL).logits.float()
        preds.append(logits_BC.squeeze(-1) if spec.regression else logits_BC.argmax(-1))
    preds_sorted = torch.cat(preds).cpu().numpy()
    preds_N = np.empty_like(preds_sorted)
    preds_N[order] = preds_sorted
    return preds_N


def evaluate(
    model: PreTrainedModel,
    split: EncodedSplit,
    spec: TaskSpec,
    *,
    batch_size: int,
    pad_id: int,
    device: torch.device,
) -> dict[str, float]:
    """The task's metrics on one encoded split (eval mode, no gradients)."""
    preds_N = predict(model, split, spec, batch_size=batch_size, pad_id=pad_id, device=device)
    return task_metrics(spec, preds_N, split.labels.numpy())


def _flat_metrics(per_split: dict[str, dict[str, float]]) -> dict[str, float]:
    """{"eval/accuracy": ...} for one GLUE split; {"eval/fr/accuracy": ..., "eval/mean/...": ...}
    for XNLI languages."""
    if list(per_split) == [GLUE_EVAL]:
        return {f"eval/{m}": v for m, v in per_split[GLUE_EVAL].items()}
    flat = {f"eval/{s}/{m}": v for s, ms in per_split.items() for m, v in ms.items()}
    if len(per_split) > 1:
        for m in next(iter(per_split.values())):
            flat[f"eval/mean/{m}"] = float(np.mean([ms[m] for ms in per_split.values()]))
    return flat


def _main_key(spec: TaskSpec, splits: Sequence[str]) -> str:
    if list(splits) == [GLUE_EVAL]:
        return f"eval/{spec.main_metric}"
    return f"eval/{splits[0] if len(splits) == 1 else 'mean'}/{spec.main_metric}"


# ----------------------------------------------------------------------------- the run


@dataclass
class _Run:
    spec: TaskSpec
    folder: Path
    tokenizer: PreTrainedTokenizerFast
    train: EncodedSplit
    evals: dict[str, EncodedSplit]
    pad_id: int
    device: torch.device
    settings: dict[str, Any]
    main_key: str
    tracker: Tracker
    progress: bool
    best_dir: Path | None
    best_main: float = -math.inf


def _train_epoch(model, optimizer, scheduler, loss_fn, run: _Run, order: list[int], epoch: int):
    """One pass over the training examples in `order`; the mean training loss."""
    model.train()
    batch_size = run.settings["batch_size"]
    batches = _batches(run.train, order, batch_size, run.pad_id, run.device)
    total, steps = torch.zeros((), device=run.device), 0
    bar = tqdm(
        batches,
        total=math.ceil(len(order) / batch_size),
        leave=False,
        disable=not run.progress,
        desc=f"epoch {epoch}",
    )
    for ids_BL, mask_BL, labels_B in bar:
        logits_BC = model(input_ids=ids_BL, attention_mask=mask_BL).logits
        loss = loss_fn(logits_BC, labels_B)  # raw logits: no softmax before the loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        total, steps = total + loss.detach(), steps + 1  # no host sync per step
    return total.item() / steps


def _evaluate_all(model: PreTrainedModel, run: _Run) -> dict[str, float]:
    per_split = {
        name: evaluate(
            model,
            split,
            run.spec,
            batch_size=2 * run.settings["batch_size"],
            pad_id=run.pad_id,
            device=run.device,
        )
        for name, split in run.evals.items()
    }
    return _flat_metrics(per_split)


def _train_seed(run: _Run, seed: int) -> dict[str, Any]:
    s = run.settings
    start = time.perf_counter()
    torch.manual_seed(seed)  # the new head's initialisation
    model, new_weights = load_classifier(run.folder, run.spec, run.device)
    optimizer = torch.optim.AdamW(_param_groups(model, s["weight_decay"]), lr=s["lr"])
    total_steps = math.ceil(len(run.train) / s["batch_size"]) * s["epochs"]
    warmup = round(s["warmup_fraction"] * total_steps)
    scheduler = constant_with_warmup(optimizer, warmup)
    loss_fn = regression_mse if run.spec.regression else LOSSES[s["loss"]]
    order_rng = torch.Generator().manual_seed(seed)  # the data order
    epochs = []
    bar = tqdm(
        range(1, s["epochs"] + 1),
        desc=f"{run.spec.name} seed {seed}",
        unit="epoch",
        disable=not run.progress,
    )
    for epoch in bar:
        order = torch.randperm(len(run.train), generator=order_rng).tolist()
        train_loss = _train_epoch(model, optimizer, scheduler, loss_fn, run, order, epoch)
        metrics = {"train/loss": train_loss, **_evaluate_all(model, run)}
        epochs.append({"epoch": epoch, **metrics})
        run.tracker.log_metrics({f"seed{seed}/{k}": v for k, v in metrics.items()}, step=epoch)
        bar.set_postfix({run.main_key: round(metrics[run.main_key], 4)})
        if run.best_dir is not None and metrics[run.main_key] > run.best_main:
            run.best_main = metrics[run.main_key]
            _save_model(model, run, seed, epoch)
    best = max(epochs, key=lambda e: e[run.main_key])  # the first of equal scores
    return {
        "seed": seed,
        "epochs": epochs,
        "best_epoch": best["epoch"],
        "best": {k: v for k, v in best.items() if k != "epoch"},
        "new_weights": new_weights,
        "steps": total_steps,
        "warmup_steps": warmup,
        "wall_s": round(time.perf_counter() - start, 2),
    }


def _save_model(model: PreTrainedModel, run: _Run, seed: int, epoch: int) -> None:
    model.config.hlm_finetuned = run.spec.name
    model.config.hlm_classify = {"seed": seed, "epoch": epoch, run.main_key: run.best_main}
    with _quiet_transformers():
        model.save_pretrained(str(run.best_dir))
        # The saved tokenizer adds [cls]/[sep] itself, as PairEncoder did: a transformers
        # pipeline on the folder feeds the model what it was trained on.
        tokenizer = with_classifier_template(run.tokenizer, max_length=run.settings["max_length"])
        tokenizer.save_pretrained(str(run.best_dir))


def _summary(seeds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Mean and sample std over seeds of every metric at each seed's best epoch."""
    out = {}
    for key in seeds[0]["best"]:
        values = [r["best"][key] for r in seeds]
        std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
        out[key] = {"mean": float(np.mean(values)), "std": std, "values": values}
    return out


def limit_examples(examples: list[Example], limit: int | None) -> list[Example]:
    """A fixed random subset (the same rows for every XNLI language: equal lengths)."""
    if limit is None or len(examples) <= limit:
        return examples
    keep = np.random.default_rng(0).permutation(len(examples))[:limit]
    return [examples[i] for i in keep]


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
    folder = resolve_model_dir(model_ref)
    info = model_info(folder)
    if info["family"] != "encoder":
        raise HLMError(f"{task} needs an encoder; {folder} is a decoder ({info['model_type']})")
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
    train = _encode(encoder, limit_examples(data.train, settings.train_limit), spec)
    evals = {
        k: _encode(encoder, limit_examples(v, settings.eval_limit), spec)
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
    run = _Run(
        spec=spec,
        folder=folder,
        tokenizer=tokenizer,
        train=train,
        evals=evals,
        pad_id=encoder.pad_id,
        device=device_t,
        settings=used,
        main_key=_main_key(spec, list(evals)),
        tracker=tracker,
        progress=progress,
        best_dir=output_dir / f"classify_{slug}_model" if save_best_model else None,
    )
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
    per_seed = [_train_seed(run, seed) for seed in seeds]
    summary = _summary(per_seed)
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
