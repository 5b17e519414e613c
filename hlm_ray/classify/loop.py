"""The classifier's training loop: per seed, epochs of training then evaluation on every eval
split, the best epoch kept (and its model saved when asked); the mean / std over seeds.

    run = Run(spec, folder, encoder, train, evals, device, settings, tracker, best_dir=None)
    per_seed = [train_seed(run, seed) for seed in settings["seeds"]]
    summary = summarise(per_seed)      # {"eval/accuracy": {"mean", "std", "values"}, ...}

The best epoch of a seed maximises the task's main metric; for XNLI evaluated on several
languages, the mean over those languages (`main_key`). Each seed seeds the new head's
initialisation and its own data order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hlm_ray.classify.inputs import EncodedSplit, PairEncoder, batches
from hlm_ray.classify.loss import LOSSES, regression_mse
from hlm_ray.classify.metrics import task_metrics
from hlm_ray.classify.model import (
    constant_with_warmup,
    load_classifier,
    param_groups,
    save_classifier,
)
from hlm_ray.classify.tasks import GLUE_EVAL, TaskSpec
from hlm_ray.tracking import Tracker
from hlm_ray.train.optim import adamw


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
    for ids_BL, mask_BL, _ in batches(split, order, batch_size, pad_id, device):
        logits_BC = model(input_ids=ids_BL, attention_mask=mask_BL).logits.float()
        preds.append(logits_BC.squeeze(-1) if spec.regression else logits_BC.argmax(-1))
    preds_sorted = torch.cat(preds).cpu().numpy()
    preds_N = np.empty_like(preds_sorted)
    preds_N[order] = preds_sorted
    return preds_N


def flat_metrics(per_split: dict[str, dict[str, float]]) -> dict[str, float]:
    """{"eval/accuracy": ...} for one GLUE split; {"eval/fr/accuracy": ..., "eval/mean/...": ...}
    for XNLI languages."""
    if list(per_split) == [GLUE_EVAL]:
        return {f"eval/{m}": v for m, v in per_split[GLUE_EVAL].items()}
    flat = {f"eval/{s}/{m}": v for s, ms in per_split.items() for m, v in ms.items()}
    if len(per_split) > 1:
        for m in next(iter(per_split.values())):
            flat[f"eval/mean/{m}"] = float(np.mean([ms[m] for ms in per_split.values()]))
    return flat


def main_key(spec: TaskSpec, splits: Sequence[str]) -> str:
    """The metric that picks a seed's best epoch."""
    if list(splits) == [GLUE_EVAL]:
        return f"eval/{spec.main_metric}"
    return f"eval/{splits[0] if len(splits) == 1 else 'mean'}/{spec.main_metric}"


@dataclass
class Run:
    """What every seed of one fine-tune shares."""

    spec: TaskSpec
    folder: Path
    """The encoder folder each seed loads afresh."""
    encoder: PairEncoder
    train: EncodedSplit
    evals: dict[str, EncodedSplit]
    device: torch.device
    settings: dict[str, Any]
    """The settings used (`ClassifyConfig` fields as a dict, as logged)."""
    tracker: Tracker
    best_dir: Path | None = None
    """Where the best (seed, epoch) model is saved; None: not saved."""
    progress: bool = True
    best_main: float = -math.inf

    @property
    def main_key(self) -> str:
        return main_key(self.spec, list(self.evals))


def _train_epoch(model, optimizer, scheduler, loss_fn, run: Run, order: list[int], epoch: int):
    """One pass over the training examples in `order`; the mean training loss."""
    model.train()
    batch_size = run.settings["batch_size"]
    pad_id = run.encoder.pad_id
    total, steps = torch.zeros((), device=run.device), 0
    bar = tqdm(
        batches(run.train, order, batch_size, pad_id, run.device),
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


def _evaluate_all(model: PreTrainedModel, run: Run) -> dict[str, float]:
    """The task's metrics on every eval split (eval mode, no gradients), flattened."""
    batch_size, pad_id = 2 * run.settings["batch_size"], run.encoder.pad_id
    per_split = {}
    for name, split in run.evals.items():
        preds_N = predict(
            model, split, run.spec, batch_size=batch_size, pad_id=pad_id, device=run.device
        )
        per_split[name] = task_metrics(run.spec, preds_N, split.labels.numpy())
    return flat_metrics(per_split)


def train_seed(run: Run, seed: int) -> dict[str, Any]:
    """Fine-tune one seed for `epochs`, evaluating after each; its epochs and its best one."""
    s, key = run.settings, run.main_key
    start = time.perf_counter()
    torch.manual_seed(seed)  # the new head's initialisation
    model, new_weights = load_classifier(run.folder, run.spec, run.device)
    optimizer = adamw(param_groups(model, s["weight_decay"]), lr=s["lr"])
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
        bar.set_postfix({key: round(metrics[key], 4)})
        if run.best_dir is not None and metrics[key] > run.best_main:
            run.best_main = metrics[key]
            facts = {"seed": seed, "epoch": epoch, key: run.best_main}
            save_classifier(
                model,
                run.encoder.tokenizer,
                run.best_dir,
                max_length=s["max_length"],
                finetuned=run.spec.name,
                facts=facts,
            )
    best = max(epochs, key=lambda e: e[key])  # the first of equal scores
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


def summarise(seeds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Mean and sample std over seeds of every metric at each seed's best epoch."""
    out = {}
    for key in seeds[0]["best"]:
        values = [r["best"][key] for r in seeds]
        std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
        out[key] = {"mean": float(np.mean(values)), "std": std, "values": values}
    return out
