"""The classifier model: an encoder folder loaded with a new classification head (checked so that
no encoder weight is silently re-initialised), its optimizer groups and schedule, and the best
model saved with a tokenizer that builds the inputs it was trained on.

    model, new_weights = load_classifier(folder, spec, device)
    optimizer = adamw(param_groups(model, 0.01), lr=1e-5)   # hlm_ray.train.optim.adamw
    scheduler = constant_with_warmup(optimizer, warmup_steps=30)

The model is `AutoModelForSequenceClassification.from_pretrained(folder)`: it reads the encoder
weights of a bare `BertModel` (headless) or a `*ForMaskedLM` (vanilla) folder and adds a new
pooler + classifier (seeded per run by the caller).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from hlm_ray.classify.tasks import TaskSpec
from hlm_ray.classify.template import with_classifier_template
from hlm_ray.errors import HLMError, one_line


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


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
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


def save_classifier(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    folder: Path,
    *,
    max_length: int,
    finetuned: str,
    facts: dict,
) -> None:
    """Save the model (its config marked `hlm_finetuned` and `hlm_classify` = `facts`) and a
    tokenizer that adds [cls]/[sep] itself, as `PairEncoder` did: a transformers pipeline on the
    folder feeds the model what it was trained on."""
    model.config.hlm_finetuned = finetuned
    model.config.hlm_classify = facts
    with _quiet_transformers():
        model.save_pretrained(str(folder))
        with_classifier_template(tokenizer, max_length=max_length).save_pretrained(str(folder))
