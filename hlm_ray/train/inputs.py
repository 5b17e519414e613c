"""The tokenizer and token blocks a config asks for, read from its prepared folder.

    prepared = build_prepared(cfg)              # data.prepared, or the cache's folder (made once)
    tokenizer = build_tokenizer(cfg)            # the prepared folder's tokenizer
    corpus = build_corpus(cfg, tokenizer)       # PackedCorpus(train (N, L), val (M, L)), mmap
    ids = special_ids(tokenizer)                # {"eos_token": 0, "pad_token": 1, ...}
    masking = Masking(cfg, tokenizer, ids)      # encoders: masking(blocks_BL, seed) -> (in, labels)
    input_ids, labels = load_batch(corpus.train, idx, env, masking, seed, step, micro)

Sweeps and launchers prepare in the driver before trials start, so workers only read.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerFast

from hlm_ray.config import Config
from hlm_ray.data import PackedCorpus, mask_tokens
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


class Masking:
    """Encoder inputs: BERT masking with a generator seeded by (seed, step, rank, micro)."""

    def __init__(self, cfg: Config, tokenizer, ids: dict[str, int]):
        self.mask_id = ids["mask_token"]
        self.special = sorted(set(ids.values()))
        self.vocab_size = len(tokenizer)
        self.p = cfg.data.mlm_probability

    def __call__(self, input_ids_BL: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return mask_tokens(
            input_ids_BL,
            mask_id=self.mask_id,
            special_ids=self.special,
            vocab_size=self.vocab_size,
            probability=self.p,
            generator=gen,
        )


def stream_seed(seed: int, step: int, rank: int, micro: int) -> int:
    """One random stream per (step, rank, micro-batch): masks and sampled negatives are
    reproducible on resume."""
    return (((seed * 1_000_003 + step + 1) * 4099 + rank) * 1031 + micro) % 2**63


def load_batch(blocks, idx, env, masking, seed, step, micro):
    input_ids = blocks[idx]
    labels = None
    if masking is not None:
        input_ids, labels = masking(input_ids, stream_seed(seed, step, env.rank, micro))
        labels = labels.to(env.device, non_blocking=True)
    return input_ids.to(env.device, non_blocking=True), labels
