"""The tokenizer and packed corpus a config asks for (both cached by their inputs).

    tokenizer = build_tokenizer(cfg)            # trains the BPE once, then reads the cache
    corpus = build_corpus(cfg, tokenizer)       # PackedCorpus(train (N, L), val (M, L))
    ids = special_ids(tokenizer)                # {"eos_token": 0, "pad_token": 1, ...}

Sweeps call these in the driver before trials start, so concurrent trials of one vocabulary
size find the tokenizer and tokenized corpus already built.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from hlm_ray.config import Config
from hlm_ray.data import PackedCorpus, load_texts, prepare_corpus
from hlm_ray.tokenizer import load_tokenizer, special_tokens_for, train_bpe


def build_tokenizer(cfg: Config) -> PreTrainedTokenizerFast:
    specials = special_tokens_for(cfg.model.family)
    if cfg.tokenizer.kind == "file":
        return load_tokenizer(cfg.tokenizer.path, special_tokens=specials)
    texts = load_texts(cfg.data.sources, text_field=cfg.data.text_field)["text"]
    folder = train_bpe(
        texts,
        cfg.tokenizer.vocab_size,
        specials,
        min_frequency=cfg.tokenizer.min_frequency,
        max_bytes=cfg.tokenizer.max_train_bytes,
    )
    return load_tokenizer(folder)


def special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """Ids of the special tokens the tokenizer has, by role."""
    roles = ("eos_token", "pad_token", "mask_token", "cls_token", "sep_token")
    found = {role: getattr(tokenizer, f"{role}_id") for role in roles}
    return {role: i for role, i in found.items() if i is not None}


def build_corpus(cfg: Config, tokenizer: PreTrainedTokenizerFast) -> PackedCorpus:
    return prepare_corpus(
        cfg.data.sources,
        tokenizer,
        seq_len=cfg.data.seq_len,
        val_fraction=cfg.data.val_fraction,
        eos_id=tokenizer.eos_token_id,
        max_tokens=cfg.data.max_tokens,
        text_field=cfg.data.text_field,
    )
