"""A decoder's readout record (readout.json): the prior's smoothing, and for a headless decoder
the scale and weight of its prior readout: the derived ones (1, 1) it is read with, and the ones
fitted on the validation split of its corpus, recorded beside them as a check.

    record = readout_record(model, counts_V, val_counts_V, val_blocks, temperature=1.0)
    write_record(model_dir, record)                         # hlm_ray.readout
    z_NV, y_N = tied_logits(model, val_blocks)              # the rows the fit reads
    fit = fit_prior(z_NV / tau, y_N, log_q_V)               # {"scale", "prior_weight", "nats"}

The prior readout's logits are s·z + β·log q(w), z = h·Eᵀ/τ. Their cross-entropy is convex in
(s, β) (the logits are linear in both; its Hessian is the covariance of (z, log q) under the
readout's softmax), so Newton's method from the derived point (1, 1) finds the optimum in a
few passes over the rows. The rows' logits z are computed once and kept: at most
`MAX_LOGITS` floats (rows × V; 2^24, 64 MB), so about 330 rows at V = 50k and `MAX_ROWS` at
V ≤ 8k: plenty for two numbers. If the fit does not lower the cross-entropy of the derived
point on those rows (it always should), the derived (1, 1) is kept and the record says so.

Why the derived pair is the one used: the argument (docs/readout.md) gives s = β = 1, and the
fitted pair, a few hundred validation tokens' worth, scored held-out text 0.01-0.02 bits per
byte worse than the derived one at the scaling sweep's cpu settings (fitted 1.12/1.02 and
0.96/1.05 at 300G and 2.4T FLOPs). Copy `prior.fit`'s scale and weight into `prior` to read a
model with them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from hlm_ray.readout import is_raw_headless
from hlm_ray.unigram import Unigram

MAX_LOGITS = 1 << 24
MAX_ROWS = 2048
_CHUNK = 256  # rows per chunk of the fit's passes (chunk × V floats at a time)
_NEWTON_STEPS = 20


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


def _moments(z_NV, y_N, log_q_V, scale: float, weight: float):
    """Mean cross-entropy of scale·z + weight·log q over the rows, with its gradient (2,) and
    Hessian (2, 2) in (scale, weight): the features' mean and covariance under the readout's
    softmax, in one chunked pass (float64 sums)."""
    loss, grad, hess = 0.0, torch.zeros(2, dtype=torch.float64), torch.zeros(2, 2).double()
    for lo in range(0, len(y_N), _CHUNK):
        z_CV, y_C = z_NV[lo : lo + _CHUNK], y_N[lo : lo + _CHUNK]
        logits_CV = scale * z_CV + weight * log_q_V
        lse_C = torch.logsumexp(logits_CV, -1)
        p_CV = torch.exp(logits_CV - lse_C[:, None])
        pz_CV = p_CV * z_CV
        ez, el = pz_CV.sum(-1), p_CV @ log_q_V  # E_p[z], E_p[log q] per row
        ezz, ezl, ell = (pz_CV * z_CV).sum(-1), pz_CV @ log_q_V, p_CV @ log_q_V.square()
        zy, ly = z_CV.gather(1, y_C[:, None])[:, 0], log_q_V[y_C]
        loss += float((lse_C - scale * zy - weight * ly).double().sum())
        grad += torch.stack([(ez - zy).sum(), (el - ly).sum()]).double()
        cov = [ezz - ez * ez, ezl - ez * el, ell - el * el]
        sums = [float(c.double().sum()) for c in cov]
        hess += torch.tensor([[sums[0], sums[1]], [sums[1], sums[2]]], dtype=torch.float64)
    n = len(y_N)
    return loss / n, grad / n, hess / n


def fit_prior(z_NV: torch.Tensor, y_N: torch.Tensor, log_q_V) -> dict[str, Any]:
    """The scale s and weight β that minimise the cross-entropy of s·z + β·log q on the rows
    (Newton's method from the derived (1, 1), halving a step that does not lower the loss);
    with the nats per token of the tied (1, 0), derived (1, 1) and fitted readouts."""
    log_q = torch.as_tensor(np.asarray(log_q_V), dtype=torch.float32)
    theta = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss, grad, hess = _moments(z_NV, y_N, log_q, 1.0, 1.0)
    nats = {"tied": _moments(z_NV, y_N, log_q, 1.0, 0.0)[0], "derived": loss}
    for _ in range(_NEWTON_STEPS):
        step = -torch.linalg.solve(hess + 1e-9 * torch.eye(2, dtype=torch.float64), grad)
        if float(-(grad @ step)) < 1e-10:  # the decrease Newton predicts: converged
            break
        for _ in range(20):
            trial = theta + step
            moments = _moments(z_NV, y_N, log_q, float(trial[0]), float(trial[1]))
            if math.isfinite(moments[0]) and moments[0] <= loss:
                break
            step = step / 2
        else:
            break
        theta, (loss, grad, hess) = trial, moments
    scale, weight = (float(t) for t in theta)
    method = "fitted"
    if not (math.isfinite(loss) and loss <= nats["derived"]):
        scale, weight, loss, method = 1.0, 1.0, nats["derived"], "derived (the fit did not help)"
    nats["fitted"] = loss
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
    smoothing fitted on `val_counts_V`; for a raw headless decoder also `readout: prior` with
    its scale and weight, derived (s = β = 1), and those fitted on `val_blocks` under
    `prior.fit` (none without them); a decoder with a trained head records `readout: head`."""
    unigram = Unigram.fit(counts_V, val_counts_V)
    record: dict[str, Any] = {
        "temperature": temperature,
        "alpha": unigram.alpha,
        "alpha_source": unigram.alpha_source,
    }
    config = model.config.to_dict()
    if not is_raw_headless(config):
        return {"readout": "head", **record}
    prior: dict[str, Any] = {"scale": 1.0, "prior_weight": 1.0, "method": "derived"}
    if val_blocks is not None and len(val_blocks) > 0:
        z_NV, y_N = tied_logits(model, val_blocks)
        fit = fit_prior(z_NV / temperature, y_N, unigram.log_probs())
        prior["fit"] = {**fit, "tokens": len(y_N), "split": split}
    return {"readout": "prior", **record, "prior": prior}
