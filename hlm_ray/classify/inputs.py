"""Classifier inputs: examples to token ids ``[cls] a [sep] (b [sep])`` (pairs truncated
longest-first), encoded splits, and padded batches.

    encoder = PairEncoder(tokenizer, max_len=64)
    split = encode_split(encoder, limit_examples(examples, 1024), spec)
    for ids_BL, mask_BL, labels_B in batches(split, order, 16, encoder.pad_id, device): ...

hlm_ray's byte-level tokenizers add no special tokens themselves, so the inputs are built here (a
tokenizer that does, such as a hub BERT's, encodes the pair itself); pairs are truncated as the
`tokenizers` library does, so the saved tokenizer (`template.py`) builds the same inputs. Batches
are padded per batch with an attention mask; segment ids stay 0 (hlm_ray pretraining never uses a
second segment).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from hlm_ray.classify.tasks import Example, TaskSpec
from hlm_ray.classify.template import adds_special_tokens, special_ids
from hlm_ray.errors import HLMError


def truncate_pair(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Longest-first truncation exactly as the `tokenizers` library does it (so a saved
    tokenizer called with ``truncation=True`` builds the same inputs): a text no longer than
    half the budget is kept whole and the other gets the rest; otherwise the shorter gets
    budget // 2 and the longer the rest (the second text, when both are equally long)."""
    if len_a + len_b <= budget:
        return len_a, len_b
    short = min(len_a, len_b)
    if short <= budget // 2:
        keep_short, keep_long = short, budget - short
    else:
        keep_short, keep_long = budget // 2, budget - budget // 2
    if len_a > len_b:
        return min(len_a, keep_long), min(len_b, keep_short)
    return min(len_a, keep_short), min(len_b, keep_long)


class PairEncoder:
    """Token ids ``[cls] a [sep] (b [sep])`` of examples, at most `max_len` long."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, max_len: int):
        if max_len < 8:
            raise HLMError(f"max_length={max_len} is too short for a classifier input; use >= 8")
        self.tokenizer, self.max_len = tokenizer, max_len
        self.own_specials = adds_special_tokens(tokenizer)
        # A tokenizer without cls / sep (a decoder's) falls back to bos / eos, then to none.
        cls, sep = special_ids(tokenizer)
        self.prefix = [cls] if cls is not None else []
        self.sep = [sep] if sep is not None else []
        self.pad_id = next(i for i in (tokenizer.pad_token_id, sep, 0) if i is not None)

    def __call__(self, examples: Sequence[Example]) -> list[list[int]]:
        texts_a = [e.text_a for e in examples]
        texts_b = (
            [e.text_b for e in examples] if examples and examples[0].text_b is not None else None
        )
        if self.own_specials:
            enc = self.tokenizer(texts_a, texts_b, truncation=True, max_length=self.max_len)
            return [ids or [self.pad_id] for ids in enc["input_ids"]]
        ids_a = self.tokenizer(texts_a, add_special_tokens=False)["input_ids"]
        ids_b = self.tokenizer(texts_b, add_special_tokens=False)["input_ids"] if texts_b else None
        n_special = len(self.prefix) + len(self.sep) * (2 if ids_b else 1)
        budget = self.max_len - n_special
        out = []
        for i, a in enumerate(ids_a):
            if ids_b is None:
                seq = self.prefix + a[:budget] + self.sep
            else:
                b = ids_b[i]
                len_a, len_b = truncate_pair(len(a), len(b), budget)
                seq = self.prefix + a[:len_a] + self.sep + b[:len_b] + self.sep
            out.append(seq or [self.pad_id])  # never an all-masked row
        return out


@dataclass
class EncodedSplit:
    ids: list[list[int]]
    labels: torch.Tensor  # (N,) int64 class ids, or float32 scores for regression

    def __len__(self) -> int:
        return len(self.ids)


def encode_split(encoder: PairEncoder, examples: list[Example], spec: TaskSpec) -> EncodedSplit:
    dtype = torch.float32 if spec.regression else torch.long
    return EncodedSplit(encoder(examples), torch.tensor([e.label for e in examples], dtype=dtype))


def batches(
    split: EncodedSplit, order: Sequence[int], batch_size: int, pad_id: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids_BL, attention_mask_BL, labels_B), padded to each batch's longest row."""
    for start in range(0, len(order), batch_size):
        idx = list(order[start : start + batch_size])
        rows = [split.ids[i] for i in idx]
        ids_BL = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
        mask_BL = torch.zeros_like(ids_BL)
        for r, row in enumerate(rows):
            ids_BL[r, : len(row)] = torch.tensor(row)
            mask_BL[r, : len(row)] = 1
        yield ids_BL.to(device), mask_BL.to(device), split.labels[idx].to(device)


def limit_examples(examples: list[Example], limit: int | None) -> list[Example]:
    """A fixed random subset (the same rows for every XNLI language: equal lengths)."""
    if limit is None or len(examples) <= limit:
        return examples
    keep = np.random.default_rng(0).permutation(len(examples))[:limit]
    return [examples[i] for i in keep]
