"""The tokenizer and token blocks a config asks for, read from its prepared folder.

    prepared = build_prepared(cfg)              # data.prepared, or the cache's folder (made once)
    tokenizer = build_tokenizer(cfg)            # the prepared folder's tokenizer
    corpus = build_corpus(cfg, tokenizer)       # PackedCorpus(train (N, L), val (M, L)), mmap
    ids = special_ids(tokenizer)                # {"eos_token": 0, "pad_token": 1, ...}

Sweeps and launchers prepare in the driver before trials start, so workers only read.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from hlm_ray.config import Config
from hlm_ray.data import PackedCorpus
from hlm_ray.errors import HLMError
from hlm_ray.prepare import Prepared, TokenBlocks, ensure_prepared
from hlm_ray.tokenizer import special_tokens_for


def build_prepared(cfg: Config, *, progress: bool | None = None) -> Prepared:
    return ensure_prepared(cfg, progress=progress)


def build_tokenizer(cfg: Config) -> PreTrainedTokenizerFast:
    prepared = build_prepared(cfg)
    tokenizer = prepared.tokenizer()
    missing = [r for r in special_tokens_for(cfg.model.family) if getattr(tokenizer, r) is None]
    if missing:
        raise HLMError(
            f"the tokenizer of {prepared.path} has no {missing[0]} (prepared for another model "
            f"family); prepare the corpus for a {cfg.model.family} (--preset of that family)"
        )
    return tokenizer


def special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """Ids of the special tokens the tokenizer has, by role."""
    roles = ("eos_token", "pad_token", "mask_token", "cls_token", "sep_token")
    found = {role: getattr(tokenizer, f"{role}_id") for role in roles}
    return {role: i for role, i in found.items() if i is not None}


def build_corpus(cfg: Config, tokenizer: PreTrainedTokenizerFast | None = None) -> PackedCorpus:
    """Memory-mapped train and validation blocks (`tokenizer` is kept for the old signature)."""
    prepared = build_prepared(cfg, progress=False)
    train = TokenBlocks.open(
        prepared, "train", seq_len=cfg.data.seq_len, max_tokens=cfg.data.max_tokens
    )
    val = TokenBlocks.open(prepared, "val", seq_len=cfg.data.seq_len)
    return PackedCorpus(train=train, val=val, num_tokens=train.num_blocks * cfg.data.seq_len)


def data_tags(cfg: Config) -> dict[str, str]:
    """The prepared folder a run reads, for its tags: path and fingerprint."""
    prepared = build_prepared(cfg, progress=False)
    return {"data.prepared": prepared.uri, "data.fingerprint": prepared.fingerprint}
