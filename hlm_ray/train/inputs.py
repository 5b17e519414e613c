"""The tokenizer and token blocks a config asks for, read from its prepared folder.

    prepared = build_prepared(cfg)              # data.prepared, or the cache's folder (made once)
    tokenizer = build_tokenizer(cfg)            # the prepared folder's tokenizer
    corpus = build_corpus(cfg, tokenizer)       # PackedCorpus(train (N, L), val (M, L)), mmap
                                                # encoders: every block [CLS] ... [SEP]
    ids = special_ids(tokenizer)                # {"eos_token": 0, "pad_token": 1, ...}
    masking = Masking(cfg, tokenizer, ids)      # encoders: masking(blocks_BL, seed) -> (in, labels)
    input_ids, labels = load_batch(corpus.train, idx, env, masking, seed, step, micro)

Sweeps and launchers prepare in the driver before trials start, so workers only read.

Encoder blocks are framed as BERT's are: ``[CLS] t_1 ... t_{L-2} [SEP]`` (`FramedBlocks`), for
both objectives, so the token every classifier reads is in every pretraining input. The masking
rule never picks a special token, so [CLS] and [SEP] are never targets; what trains [CLS] is
attention: every masked position's output attends to position 0, so each loss (cross-entropy or
CWT) sends gradient through the keys and values computed from [CLS]'s input embedding (its row
of the table, shape (D,)) in every layer. Without the frame the headless MLM never reads that
row (the CWT only gathers the rows of *target* tokens) and it stayed at its random
initialisation. Decoders keep plain packed blocks (EOS between documents).
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
    """Memory-mapped train and validation blocks of `data.seq_len` tokens; an encoder's are
    framed ``[CLS] ... [SEP]`` around `seq_len - 2` tokens of the stream."""
    prepared = build_prepared(cfg, progress=False)
    framed = cfg.model.family == "encoder"
    if framed and cfg.data.seq_len < 3:
        raise HLMError(
            f"data.seq_len={cfg.data.seq_len} leaves no text in an encoder block "
            "([CLS] ... [SEP] take 2 positions); use data.seq_len >= 3"
        )
    text_len = cfg.data.seq_len - 2 if framed else cfg.data.seq_len
    train = TokenBlocks.open(prepared, "train", seq_len=text_len, max_tokens=cfg.data.max_tokens)
    val = TokenBlocks.open(prepared, "val", seq_len=text_len)
    num_tokens = train.num_blocks * text_len
    if framed:
        ids = special_ids(tokenizer if tokenizer is not None else build_tokenizer(cfg))
        train, val = (FramedBlocks(b, ids["cls_token"], ids["sep_token"]) for b in (train, val))
    return PackedCorpus(train=train, val=val, num_tokens=num_tokens)


class FramedBlocks:
    """`blocks` (N, L - 2) of a token stream as (N, L) encoder inputs ``[CLS] ... [SEP]``."""

    def __init__(self, blocks: TokenBlocks, cls_id: int, sep_id: int):
        self.blocks = blocks
        self.cls_id, self.sep_id = cls_id, sep_id
        self.seq_len = blocks.seq_len + 2
        self.num_blocks = blocks.num_blocks

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, idx) -> torch.Tensor:
        """Rows `idx` as int64 (B, seq_len) (an int: (seq_len,)), framed."""
        text_BT = self.blocks[idx]
        cls = torch.full((*text_BT.shape[:-1], 1), self.cls_id, dtype=text_BT.dtype)
        sep = torch.full_like(cls, self.sep_id)
        return torch.cat([cls, text_BT, sep], dim=-1)


def data_tags(cfg: Config) -> dict[str, str]:
    """The prepared folder a run reads, for its tags: where it was given (a URI, not the local
    copy a worker reads it through) and its fingerprint."""
    prepared = build_prepared(cfg, progress=False)
    where = cfg.data.prepared or prepared.uri
    return {"data.prepared": where, "data.fingerprint": prepared.fingerprint}


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
