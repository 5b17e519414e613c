"""The floor under a decoder's language-modelling scores: the unigram model of its run's training
tokens (`hlm_ray.unigram`), scored on the same texts through the same protocol, so that every bits
per byte and perplexity comes with the number a model that learnt only token frequencies gets.

    floor = run_floor(pre)                       # Floor | None, and why not in `floor_missing(pre)`
    floor.bpb(pre.tokenizer, texts)              # {"bpb/unigram_floor": ...}
    floor.lambada_perplexity(pre.tokenizer, examples)   # {"lambada/unigram_perplexity": ...}

Where the counts come from, first found: the prepared folder the run trained on (`data.prepared`,
or the cache's folder for its sources and tokenizer; never prepared here), its training split in
the run's blocks (`data.seq_len`, `data.max_tokens`) with alpha fitted on its validation split;
else the counts saved beside the model (`token_counts.npz`, what training counted), alpha the
default. The counts of a prepared split are cached by its fingerprint (`HLM_CACHE_DIR/counts`):
a paper-scale corpus is read once per machine.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hlm_ray.errors import HLMError
from hlm_ray.unigram import COUNTS_FILE, Unigram, load_counts, save_counts, unigram_bpb

log = logging.getLogger(__name__)

BPB_FLOOR = "bpb/unigram_floor"
PPL_FLOOR = "lambada/unigram_perplexity"


@dataclass(frozen=True)
class Floor:
    model: Unigram
    source: str
    """Where the counts came from, in words."""

    def bpb(self, tokenizer, texts: list[str]) -> dict[str, float]:
        return {BPB_FLOOR: unigram_bpb(self.model, tokenizer, texts)["bpb"]}

    def lambada_perplexity(self, tokenizer, examples: list[dict]) -> dict[str, float]:
        """lm-eval's LAMBADA perplexity (exp of minus the mean summed log-likelihood of each
        passage's continuation tokens, `evaluate.lambada.encode_pair`'s tokens) of the unigram
        model: it ignores the context, as a model that learnt only frequencies would."""
        from hlm_ray.evaluate.lambada import encode_pair

        log_q = self.model.log_probs()
        total = 0.0
        for ex in examples:
            _, continuation = encode_pair(tokenizer, ex["context"], ex["continuation"])
            total += float(log_q[np.asarray(continuation, dtype=np.int64)].sum())
        mean = total / len(examples)
        return {PPL_FLOOR: math.exp(-mean) if -mean < 709 else math.inf}


def run_floor(pre) -> Floor | None:
    """The floor of a loaded `Pretrained` model (module docstring); None when no counts can be
    found on this machine (`floor_missing` says why)."""
    cfg = pre.run_config
    if cfg is not None:
        try:
            prepared = find_prepared(cfg)
        except HLMError as err:
            log.info("no floor from the prepared folder: %s", err)
            prepared = None
        if prepared is not None:
            return _from_prepared(prepared, cfg)
    path = Path(pre.path) / COUNTS_FILE
    if path.is_file():
        counts, meta = load_counts(path)
        return Floor(
            Unigram.fit(counts), f"{COUNTS_FILE} beside the model ({meta['tokens']:,} tokens)"
        )
    return None


def floor_missing(pre) -> str:
    if pre.run_config is None:
        return f"no training config and no {COUNTS_FILE} beside the model"
    return f"its prepared training corpus is not on this machine and there is no {COUNTS_FILE}"


def find_prepared(cfg):
    """The prepared folder `cfg` trains on, if it is already there (nothing is prepared)."""
    from hlm_ray.prepare import open_prepared
    from hlm_ray.prepare.request import PrepareRequest, default_output
    from hlm_ray.prepare.sources import resolve_sources
    from hlm_ray.prepare.store import MANIFEST

    if cfg.data.prepared:
        return open_prepared(cfg.data.prepared)
    request = PrepareRequest.from_config(cfg)
    if any(not _local(s) for s in request.sources):
        return None  # a hub dataset: never fetched for a floor
    folder = Path(default_output(request, request.key(resolve_sources(request.sources))))
    return open_prepared(folder) if (folder / MANIFEST).is_file() else None


def _local(source: str) -> bool:
    from hlm_ray.paths import has_shared

    return Path(source).expanduser().exists() or has_shared(source)


def _from_prepared(prepared, cfg) -> Floor:
    seq_len, max_tokens = cfg.data.seq_len, cfg.data.max_tokens
    train = cached_counts(prepared, "train", seq_len, max_tokens)
    val = cached_counts(prepared, "val", seq_len, None)
    model = Unigram.fit(train, val)
    return Floor(model, f"the training split of {prepared.uri} ({int(train.sum()):,} tokens)")


def cached_counts(prepared, split: str, seq_len: int, max_tokens: int | None) -> np.ndarray:
    """`unigram.count_split`, cached by the folder's fingerprint and the block settings."""
    from hlm_ray.paths import cache_dir
    from hlm_ray.unigram import count_split

    name = f"{prepared.fingerprint[:24]}-{split}-{seq_len}-{max_tokens or 'all'}.npz"
    path = cache_dir("counts") / name
    if path.is_file():
        try:
            return load_counts(path)[0]
        except HLMError:
            pass  # damaged: count again
    counts = count_split(prepared, split, seq_len=seq_len, max_tokens=max_tokens)
    save_counts(path, counts, source=f"{split} split of {prepared.uri}", seq_len=seq_len)
    return counts
