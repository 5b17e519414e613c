"""Validation during training: the held-out slice scored by the run's own objective.

    val = evaluate(module, corpus.val, cfg, env, masking, token_bytes, amp)
    val["val/loss"], val["val/token_bpb"]       # the latter for objectives with a vocabulary head

`val/token_bpb` follows `hlm_ray/evaluate/bpb.py`: a target that stands for no bytes of text
(the end-of-text token between packed documents, or any special token; `token_bytes` is 0 for
them) is not scored, so the number is the nats of the text's own tokens over its bytes,
``sum(-log p(t) for non-EOS targets t) / (ln 2 · sum(bytes(t)))``. Counting EOS's loss with
0 bytes would inflate it by how often documents end.
"""

from __future__ import annotations

import math

import torch

from hlm_ray.config import Config
from hlm_ray.device import autocast
from hlm_ray.models import hidden_states, lm_head
from hlm_ray.objectives import IGNORE_INDEX, vanilla_causal_loss, vanilla_masked_loss
from hlm_ray.train.inputs import load_batch, stream_seed
from hlm_ray.train.lm_objective import LMObjective


@torch.no_grad()
def evaluate(module, val_blocks, cfg: Config, env, masking, token_bytes, amp) -> dict:
    """Validation on the first `run.eval_batches` micro-batches of the held-out slice.
    Vanilla: loss, perplexity, bits per byte. Headless: CWT loss and in-batch top-1 accuracy."""
    inner = module.module if hasattr(module, "module") else module
    inner.eval()
    mb = cfg.optim.micro_batch_size
    sums = {"loss": 0.0, "rows": 0, "acc": 0.0, "nats": 0.0, "bytes": 0}
    for b in range(min(cfg.run.eval_batches, math.ceil(len(val_blocks) / mb))):
        idx = torch.arange(b * mb, min((b + 1) * mb, len(val_blocks)))
        input_ids, labels = load_batch(val_blocks, idx, env, masking, cfg.run.seed, -1, b)
        with autocast(env.device, amp):
            seed = stream_seed(cfg.run.seed, -1, env.rank, b)
            parts = inner(input_ids, labels, negative_seed=seed, return_accuracy=True)
            if "ce" in parts:
                nats, num_bytes = text_nats_and_bytes(inner, input_ids, labels, token_bytes)
                sums["nats"] += nats
                sums["bytes"] += num_bytes
        out = parts["loss"]
        rows = int(out.num_rows)
        sums["loss"] += out.loss.item() * rows
        sums["rows"] += rows
        if "cwt" in parts and parts["cwt"].accuracy is not None:
            sums["acc"] += parts["cwt"].accuracy.item() * rows
        if "ce" in parts:
            sums["ce"] = sums.get("ce", 0.0) + parts["ce"].loss.item() * rows
    inner.train()
    rows = max(sums["rows"], 1)
    metrics = {"val/loss": sums["loss"] / rows}
    if cfg.objective.name in ("headless", "mixed"):
        metrics["val/accuracy"] = sums["acc"] / rows
    if cfg.objective.name in ("vanilla", "mixed"):
        metrics["val/ce"] = sums["ce"] / rows  # every target, EOS included: the training loss
        metrics["val/perplexity"] = math.exp(min(sums["ce"] / rows, 50.0))
        metrics["val/token_bpb"] = sums["nats"] / math.log(2) / max(sums["bytes"], 1)
    return metrics


def text_nats_and_bytes(
    inner: LMObjective, input_ids_BL: torch.Tensor, labels_BL, token_bytes: torch.Tensor
) -> tuple[float, int]:
    """(summed -log p over the targets that are text, their UTF-8 bytes) of one micro-batch
    through the vocabulary head; zero-byte targets (EOS, special tokens) are left out."""
    model, cfg = inner.model, inner.cfg
    head = dict(impl=cfg.ce_impl, chunk_size=cfg.ce_chunk_size)  # as training: bounded logits
    hidden_BLD = hidden_states(model, input_ids_BL)
    if labels_BL is None:  # decoder: targets input[:, 1:]; keep_BL[:, 1:] is what is scored
        keep_BL = token_bytes[input_ids_BL] > 0
        targets_K = input_ids_BL[:, 1:][keep_BL[:, 1:]]
        if not len(targets_K):
            return 0.0, 0
        out = vanilla_causal_loss(
            hidden_BLD, input_ids_BL, lm_head(model), target_mask_BL=keep_BL, **head
        )
    else:  # encoder: the masked originals that are text
        labels_BL = labels_BL.masked_fill(token_bytes[labels_BL.clamp(min=0)] == 0, IGNORE_INDEX)
        targets_K = labels_BL[labels_BL != IGNORE_INDEX]
        if not len(targets_K):
            return 0.0, 0
        out = vanilla_masked_loss(hidden_BLD, labels_BL, lm_head(model), **head)
    # LossOutput.loss is the mean over the kept rows.
    return out.loss.item() * int(out.num_rows), int(token_bytes[targets_K].sum())
