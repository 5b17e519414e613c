"""A unigram model of a run's training tokens: the floor every bits-per-byte score must beat,
and the log prior q(w) a headless decoder's readout adds back.

    from hlm_ray.unigram import Unigram, count_split, unigram_bpb
    counts_V = count_split(prepared, "train", seq_len=128)    # (V,) int64: the blocks training reads
    model = Unigram.fit(counts_V, held_out_V)                 # add-alpha, alpha fitted on held_out_V
    model.log_probs()                                         # (V,) float64, log q(w), sums to 1
    unigram_bpb(model, tokenizer, texts)["bpb"]               # scored as `evaluate.bpb` scores a model
    save_counts(path, counts_V, source="train split of ..."); load_counts(path)

Why a floor: a language model that has not learnt more than each token's frequency scores what
this model scores; an arm above it has learnt nothing a comparison can read (its "irreducible
loss" is this plateau). Smoothing: add-alpha, q(w) = (c(w) + alpha) / (N + alpha·V), with alpha
chosen on held-out counts (the prepared folder's validation split) from a log grid, so the floor
is as strong as a unigram model of these counts can be without looking at the scored texts.
Scoring follows `hlm_ray.evaluate.bpb` exactly: each text tokenized without special tokens,
every token scored once (the end-of-text token that precedes a document is context, not a
target), nats over the text's UTF-8 bytes.
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hlm_ray.errors import HLMError, one_line

COUNTS_FILE = "token_counts.npz"
"""The counts saved beside a model: `counts` (V,) int64 and `meta` (a JSON string)."""
DEFAULT_ALPHA = 0.5
"""Add-alpha smoothing when there are no held-out counts to fit it on."""
ALPHAS = np.geomspace(1e-3, 10.0, 41)
"""The grid alpha is fitted on (log-spaced; cross-entropy is smooth in log alpha)."""
_CHUNK = 1 << 24  # tokens per bincount: a bounded working set for any shard size


def id_outside(ids: np.ndarray, vocab_size: int) -> int | None:
    """An id of `ids` outside [0, V) to name in an error (the largest, or else the negative
    one), or None when every id is inside."""
    if len(ids) and int(ids.max()) >= vocab_size:
        return int(ids.max())
    if len(ids) and int(ids.min()) < 0:
        return int(ids.min())
    return None


def count_tokens(ids, vocab_size: int) -> np.ndarray:
    """(V,) int64 counts of the ids (any integer array); ids outside [0, V) are an error."""
    ids = np.asarray(ids)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(ids), _CHUNK):
        part = ids[start : start + _CHUNK]
        bad = id_outside(part, vocab_size)
        if bad is not None:
            raise HLMError(
                f"token id {bad} is outside the vocabulary of {vocab_size}: the "
                "tokens and the tokenizer do not belong together"
            )
        counts += np.bincount(part, minlength=vocab_size).astype(np.int64)
    return counts


def count_split(prepared, split: str, *, seq_len: int, max_tokens: int | None = None):
    """(V,) counts of the tokens of a prepared folder's split that whole blocks of `seq_len`
    cover (what `TokenBlocks` serves training; `max_tokens` as `data.max_tokens`)."""
    from hlm_ray.prepare import TokenBlocks

    blocks = TokenBlocks.open(prepared, split, seq_len=seq_len, max_tokens=max_tokens)
    vocab_size = int(prepared.manifest["tokenizer"]["vocab_size"])
    counts = np.zeros(vocab_size, dtype=np.int64)
    left = blocks.num_blocks * seq_len
    for shard in blocks.maps:
        take = min(left, len(shard))
        counts += count_tokens(shard[:take], vocab_size)
        left -= take
    return counts


@dataclass(frozen=True)
class Unigram:
    """q(w) = (c(w) + alpha) / (N + alpha·V) over a vocabulary of V = len(counts)."""

    counts: np.ndarray
    alpha: float
    alpha_source: str
    """How alpha was chosen, in words (for reports)."""

    @classmethod
    def fit(cls, counts, held_out=None) -> Unigram:
        """Alpha with the lowest cross-entropy on `held_out` counts (same vocabulary) from
        `ALPHAS`; `DEFAULT_ALPHA` without held-out counts."""
        counts = np.asarray(counts, dtype=np.int64)
        if counts.ndim != 1 or len(counts) == 0 or counts.sum() == 0:
            raise HLMError("a unigram model needs a non-empty (V,) vector of token counts")
        if held_out is None or int(np.sum(held_out)) == 0:
            return cls(counts, DEFAULT_ALPHA, f"add-{DEFAULT_ALPHA:g} (no held-out counts)")
        held = np.asarray(held_out, dtype=np.float64)
        if held.shape != counts.shape:
            raise HLMError(f"held-out counts of {held.shape} for a vocabulary of {counts.shape}")
        losses = [cross_entropy(cls(counts, float(a), ""), held) for a in ALPHAS]
        best = float(ALPHAS[int(np.argmin(losses))])
        n = int(held.sum())
        return cls(counts, best, f"add-{best:.3g}, fitted on {n:,} held-out tokens")

    @property
    def vocab_size(self) -> int:
        return len(self.counts)

    def log_probs(self) -> np.ndarray:
        """(V,) float64 natural-log probabilities; they sum to one in probability."""
        c = self.counts.astype(np.float64)
        return np.log(c + self.alpha) - math.log(c.sum() + self.alpha * len(c))


def cross_entropy(model: Unigram, held_counts: np.ndarray) -> float:
    """Mean nats per token of tokens with counts `held_counts` under `model`."""
    held = np.asarray(held_counts, dtype=np.float64)
    return float(-(held * model.log_probs()).sum() / held.sum())


def unigram_bpb(model: Unigram, tokenizer, texts: list[str]) -> dict:
    """{"bpb", "nats_per_token", "tokens", "bytes", "documents"}: the unigram model scored on
    `texts` through the bits-per-byte protocol (module docstring)."""
    texts = [t for t in texts if t]
    if not texts:
        raise HLMError("bits per byte needs at least one non-empty text")
    log_q = model.log_probs()
    nats, tokens = 0.0, 0
    for text in texts:
        ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
        bad = id_outside(ids, model.vocab_size)  # log_q[-1] would score -1 as the last id
        if bad is not None:
            raise HLMError(
                f"the tokenizer gives id {bad}, outside the counts' vocabulary of "
                f"{model.vocab_size}: counts and tokenizer do not belong together"
            )
        nats -= float(log_q[ids].sum())
        tokens += len(ids)
    return bpb_result(nats, tokens, texts)


def bpb_result(nats: float, tokens: int, texts: list[str]) -> dict[str, float]:
    """Bits per byte of `texts` from the nats their `tokens` scored: one definition for a
    model's score (`hlm_ray.evaluate.bpb`) and its floor, so both divide by the same bytes."""
    num_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return {
        "bpb": nats / math.log(2) / num_bytes,
        "nats_per_token": nats / tokens,
        "tokens": tokens,
        "bytes": num_bytes,
        "documents": len(texts),
    }


def save_counts(path: str | Path, counts, **meta) -> Path:
    """Write `counts` ((V,) integers) and `meta` (JSON-able) to `path` (.npz, compressed: a
    few hundred KB at V = 131k, most counts being small)."""
    path = Path(path)
    counts = np.asarray(counts, dtype=np.int64)
    meta = {"vocab_size": len(counts), "tokens": int(counts.sum()), **meta}
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez_compressed(tmp, counts=counts, meta=np.array(json.dumps(meta)))
    tmp.replace(path)
    return path


def load_counts(path: str | Path) -> tuple[np.ndarray, dict]:
    """(counts, meta) from a file `save_counts` wrote; one clear error for anything else."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            counts, meta = f["counts"].astype(np.int64), json.loads(str(f["meta"]))
    except FileNotFoundError:
        raise HLMError(f"{path} does not exist") from None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        # (a truncated or empty file: BadZipFile, EOFError; not an npz at all: ValueError)
        raise HLMError(
            f"{path} is not a token-counts file ({one_line(err, with_type=True)}); count the "
            "tokens again with `hlm data count`"
        ) from None
    if (
        counts.ndim != 1
        or not isinstance(meta, dict)
        or len(counts) != meta.get("vocab_size")
        or (counts < 0).any()
        or meta.get("tokens", int(counts.sum())) != int(counts.sum())
    ):
        raise HLMError(
            f"{path}: its counts do not match its own header; count them again with "
            "`hlm data count`"
        )
    return counts, meta
