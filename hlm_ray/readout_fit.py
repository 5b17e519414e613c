"""A decoder's readout record (readout.json): the prior's smoothing, and for a headless decoder
the scale and weight of its prior readout, fitted on the validation split of its corpus.

    record = readout_record(model, counts_V, val_counts_V, val_blocks, temperature=1.0)
    write_record(model_dir, record)                         # hlm_ray.readout
    z_NV, y_N = tied_logits(model, val_blocks)              # the rows the fit reads
    fit = fit_prior(z_NV / tau, y_N, log_q_V)               # {"scale", "prior_weight", "nats"}

The prior readout's logits are s·z + β·log q(w), z = h·Eᵀ/τ. Their cross-entropy is convex in
(s, β) (the logits are linear in both), so L-BFGS from the derived point (1, 1) finds the
optimum in a few iterations. The rows' logits z are computed once and kept: at most
`MAX_LOGITS` floats (rows × V; 2^25, 128 MB), so about 670 rows at V = 50k and `MAX_ROWS` at
V ≤ 8k: plenty for two numbers. If the fit does not lower the cross-entropy of the derived
point on those rows (it always should), the derived (1, 1) is kept and the record says so.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hlm_ray.readout import is_raw_headless
from hlm_ray.unigram import Unigram

MAX_LOGITS = 1 << 25
MAX_ROWS = 4096
_CHUNK = 512  # rows per chunk of the fit's cross-entropy (chunk × V floats at a time)


@torch.no_grad()
def tied_logits(model, blocks, *, max_rows: int | None = None, batch_size: int = 8):
    """(z (N, V) float32 CPU, next-token targets y (N,)) of the first validation blocks, from
    the model's own head (a raw headless decoder's is Eᵀ, without τ): at most `max_rows`
    (default: MAX_ROWS, and MAX_LOGITS / V) rows, whole blocks first."""
    vocab = int(model.config.vocab_size)
    limit = max_rows or min(MAX_ROWS, MAX_LOGITS // vocab)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    logits, targets, rows = [], [], 0
    try:
        for start in range(0, len(blocks), batch_size):
            ids_BL = blocks[start : start + batch_size].to(device)
            out_BLV = model(input_ids=ids_BL).logits[:, :-1]
            z_NV = out_BLV.reshape(-1, vocab).float().cpu()
            y_N = ids_BL[:, 1:].reshape(-1).cpu()
            take = min(len(y_N), limit - rows)
            logits.append(z_NV[:take])
            targets.append(y_N[:take])
            rows += take
            if rows >= limit:
                break
    finally:
        model.train(was_training)
    return torch.cat(logits), torch.cat(targets)


def _nats(z_NV, y_N, log_q_V, scale, weight) -> torch.Tensor:
    """Mean cross-entropy of scale·z + weight·log q over the rows (chunked, differentiable)."""
    total = 0.0
    for lo in range(0, len(y_N), _CHUNK):
        logits = scale * z_NV[lo : lo + _CHUNK] + weight * log_q_V
        total = total + F.cross_entropy(logits, y_N[lo : lo + _CHUNK], reduction="sum")
    return total / len(y_N)


def fit_prior(z_NV: torch.Tensor, y_N: torch.Tensor, log_q_V) -> dict[str, Any]:
    """The scale s and weight β that minimise the cross-entropy of s·z + β·log q on the rows;
    with the nats per token of the tied (1, 0), derived (1, 1) and fitted readouts."""
    log_q = torch.as_tensor(np.asarray(log_q_V), dtype=torch.float32)
    params = torch.tensor([1.0, 1.0], requires_grad=True)
    opt = torch.optim.LBFGS([params], lr=1.0, max_iter=50, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = _nats(z_NV, y_N, log_q, params[0], params[1])
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        nats = {
            "tied": float(_nats(z_NV, y_N, log_q, 1.0, 0.0)),
            "derived": float(_nats(z_NV, y_N, log_q, 1.0, 1.0)),
        }
        scale, weight = (float(p) for p in params.detach())
        fitted = float(_nats(z_NV, y_N, log_q, scale, weight))
    if not (math.isfinite(fitted) and fitted <= nats["derived"]):
        scale, weight, fitted, method = 1.0, 1.0, nats["derived"], "derived (the fit did not help)"
    else:
        method = "fitted"
    nats["fitted"] = fitted
    return {"scale": scale, "prior_weight": weight, "method": method, "nats": nats}


def readout_record(
    model,
    counts_V,
    val_counts_V,
    val_blocks,
    *,
    temperature: float,
    split: str = "the validation split of its training corpus",
) -> dict[str, Any]:
    """readout.json for `model` (a decoder) whose training tokens have `counts_V`: add-alpha
    smoothing fitted on `val_counts_V`; for a raw headless decoder also the prior readout's
    scale and weight fitted on `val_blocks` (None: derived, s = β = 1) and `readout: prior`;
    a decoder with a trained head records `readout: head`."""
    unigram = Unigram.fit(counts_V, val_counts_V)
    record: dict[str, Any] = {
        "temperature": temperature,
        "alpha": unigram.alpha,
        "alpha_source": unigram.alpha_source,
    }
    config = model.config.to_dict()
    if not is_raw_headless(config):
        return {"readout": "head", **record}
    if val_blocks is None or len(val_blocks) == 0:
        prior = {"scale": 1.0, "prior_weight": 1.0, "method": "derived (no validation text)"}
    else:
        z_NV, y_N = tied_logits(model, val_blocks)
        prior = fit_prior(z_NV / temperature, y_N, unigram.log_probs())
        prior |= {"tokens": len(y_N), "split": split}
    return {"readout": "prior", **record, "prior": prior}
