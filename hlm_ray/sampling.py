"""Logit filters and per-row sampling for `hlm_ray.generate` (no Ray, no model needed).

    logits_BV = top_p_filter(top_k_filter(apply_temperature(logits_BV, t_B), k_B), p_B)
    next_B = sample_next(logits_BV, [SamplingParams(temperature=0.8)], [random.Random(1)])

    token_logprobs(logits_TV.float().log_softmax(-1), targets_T, k=2)   # OpenAI's logprobs

Each row has its own settings and its own seeded generator, so a seeded row samples the same
token alone or batched with other rows. `sample_next` only reads `temperature`, `top_k`,
`top_p` and `greedy` from a row's parameters.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TokenLogprob:
    """A token's log-probability at its position, and the most likely tokens there."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    """(token id, log-probability) of the most likely tokens, most likely first."""


# ----------------------------------------------------------------------------- logit filters


def apply_temperature(logits_BV: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (rows with temperature 0 are left as they are:
    they are decoded greedily)."""
    t_B1 = torch.where(temperature_B > 0, temperature_B, 1.0).to(logits_BV.dtype)[:, None]
    return logits_BV / t_B1


def top_k_filter(logits_BV: torch.Tensor, k_B: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits, -inf elsewhere (k = 0: keep all). Ties with the k-th
    largest value are kept."""
    vocab = logits_BV.shape[-1]
    off_B = (k_B <= 0) | (k_B >= vocab)
    sorted_BV = logits_BV.sort(dim=-1, descending=True).values
    kth_B1 = sorted_BV.gather(-1, (k_B.clamp(1, vocab) - 1)[:, None])
    drop_BV = (logits_BV < kth_B1) & ~off_B[:, None]
    return logits_BV.masked_fill(drop_BV, float("-inf"))


def top_p_filter(logits_BV: torch.Tensor, p_B: torch.Tensor) -> torch.Tensor:
    """Nucleus filter: keep, per row, the most likely tokens until their probability reaches p
    (at least one token), -inf elsewhere (p >= 1: keep all)."""
    sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
    probs_BV = sorted_BV.softmax(dim=-1)
    mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV  # probability of the tokens above
    drop_sorted_BV = (mass_before_BV >= p_B[:, None]) & (p_B < 1)[:, None]
    drop_sorted_BV[:, 0] = False  # the most likely token stays, however small p (1e-46 is 0)
    drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
    return logits_BV.masked_fill(drop_BV, float("-inf"))


def sample_next(
    logits_BV: torch.Tensor,
    params: Sequence[Any],
    generators: Sequence[random.Random | None],
) -> torch.Tensor:
    """Next token per row (B,): argmax for greedy rows, else temperature -> top-k -> top-p ->
    a draw from the row's own generator (a seeded `random.Random`: one uniform per step costs
    0.1 µs there against ~15 µs for a `torch.rand` call, per row and step)."""
    logits_BV = logits_BV.float()
    next_B = logits_BV.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return next_B
    device = logits_BV.device
    sub_BV = logits_BV[torch.tensor(sampled, device=device)]
    temperature = [params[i].temperature for i in sampled]
    # k >= V keeps every token: clamp, so that no k overflows a tensor (k = 2**63 did).
    top_k = [min(params[i].top_k or 0, logits_BV.shape[-1]) for i in sampled]
    top_p = [params[i].top_p for i in sampled]
    temperature_B = torch.tensor(temperature, device=device)
    sub_BV = apply_temperature(sub_BV, temperature_B)
    # A temperature too small for float32 (1e-300 becomes 0; 1e-39 makes the logits inf) is
    # as cold as it gets: such a row is decoded greedily, never at temperature 1 or as NaN.
    cold_B = (temperature_B == 0) | ~sub_BV.isfinite().any(dim=-1) | sub_BV.isposinf().any(-1)
    if any(top_k):  # (each filter sorts the vocabulary: skip it when no row uses it)
        sub_BV = top_k_filter(sub_BV, torch.tensor(top_k, device=device))
    if min(top_p) < 1:
        sub_BV = top_p_filter(sub_BV, torch.tensor(top_p, device=device))
    # One uniform draw per row from the row's generator, then inverse-CDF sampling for all rows
    # at once (cheaper than a multinomial call per row).
    u_B = torch.tensor([generators[i].random() for i in sampled], device=device)
    cdf_BV = sub_BV.softmax(dim=-1).cumsum(dim=-1)
    # right=True: the first token whose cumulative probability exceeds u, so a token filtered
    # out (zero probability, flat CDF) is never drawn; rounding at the top end falls back to the
    # last token that has probability.
    drawn_B = torch.searchsorted(cdf_BV, (u_B * cdf_BV[:, -1])[:, None], right=True)[:, 0]
    last_B = (sub_BV > float("-inf")).cumsum(dim=-1).argmax(dim=-1)
    warm = [row for row, cold in zip(sampled, cold_B.tolist(), strict=True) if not cold]
    drawn_B = torch.minimum(drawn_B, last_B)[~cold_B]
    next_B[torch.tensor(warm, device=device, dtype=torch.long)] = drawn_B
    return next_B


# ----------------------------------------------------------------------------- logprobs, bias


def token_logprobs(
    logprobs_TV: torch.Tensor, targets_T: torch.Tensor, k: int
) -> list[TokenLogprob]:
    """TokenLogprob per position: the target's log-probability and the k most likely tokens."""
    chosen = logprobs_TV.gather(-1, targets_T[:, None])[:, 0].tolist()
    if k:
        values, ids = (t.tolist() for t in logprobs_TV.topk(k, dim=-1))
    else:
        values = ids = [[] for _ in chosen]
    return [
        TokenLogprob(t, lp, list(zip(i, v, strict=True)))
        for t, lp, i, v in zip(targets_T.tolist(), chosen, ids, values, strict=True)
    ]


def add_logit_bias(logits_BV: torch.Tensor, params: Sequence[Any]) -> None:
    """Add each row's logit_bias to its logits, in place."""
    for i, p in enumerate(params):
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias, strict=True)
            index = torch.tensor(ids, device=logits_BV.device)
            logits_BV[i, index] += torch.tensor(biases, device=logits_BV.device)
