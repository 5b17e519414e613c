"""Bits per byte of held-out text: a language-modelling score comparable across tokenizers.

A loss per token depends on how much text a token covers; dividing the total negative
log-likelihood (in bits) by the UTF-8 bytes of the text removes the tokenizer from the number.

    from hlm_ray.evaluate.bpb import bits_per_byte, default_bpb_texts
    texts = default_bpb_texts(limit=500)
    bits_per_byte(model, tokenizer, texts, batch_size=16)["bpb"]

Protocol: each text is its own document, preceded by the end-of-text token (pretraining puts it
between documents, so the first token is predicted the way the model learned to). A document
longer than the window (`seq_len`: `hlm eval` passes the length the model was trained on,
`evaluate.common.trained_context_length`; else the model's positions) is cut into non-overlapping
windows; each window's input starts with the token before its first target, so every token of
the text is scored exactly once, with at most one window of context. Bytes are those of the
text itself (``len(text.encode())``), exact for any tokenizer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from hlm_ray.errors import HLMError
from hlm_ray.evaluate.common import eval_mode
from hlm_ray.evaluate.lambada import load_lambada
from hlm_ray.models import max_input_positions
from hlm_ray.unigram import bpb_result

DEFAULT_NUM_TEXTS = 500
_DEFAULT_WINDOW = 1024  # when neither `seq_len` nor the model's config gives one


def default_bpb_texts(limit: int | None = DEFAULT_NUM_TEXTS) -> list[str]:
    """The LAMBADA passages (context + " " + final word), the first `limit` of them.

    Why these: they are novels outside every pretraining corpus hlm_ray ships (Shakespeare,
    WikiText, Moby Dick), so the score is held out; and they are fixed text, byte-identical
    whatever the tokenizer, so runs with different vocabularies score the same bytes."""
    return [ex["context"] + " " + ex["continuation"] for ex in load_lambada(limit=limit)]


def require_decoder(model, what: str) -> None:
    """`HLMError` unless `model` is a causal LM (an encoder has no next-token head)."""
    config = getattr(model, "config", None)
    family = getattr(config, "hlm_family", None)
    if family is None and config is not None:
        name = type(model).__name__
        family = "decoder" if name.endswith(("ForCausalLM", "LMHeadModel")) else "encoder"
    if family == "encoder":
        raise HLMError(f"{what} needs a decoder with a head; {type(model).__name__} is an encoder")


def document_windows(ids: list[int], eos_id: int, window: int) -> list[tuple[list[int], list[int]]]:
    """(input, targets) windows covering `ids` once: input = [eos] + ids shifted, cut every
    `window` tokens, each input starting at the token before its first target."""
    stream = [eos_id, *ids]
    return [
        (stream[start : start + window], stream[start + 1 : start + window + 1])
        for start in range(0, len(ids), window)
    ]


def bits_per_byte(
    model,
    tokenizer,
    texts: list[str],
    *,
    batch_size: int = 16,
    seq_len: int | None = None,
    device: str | None = None,
    progress: bool = True,
) -> dict:
    """{"bpb", "nats_per_token", "tokens", "bytes", "documents"} of `model` over `texts`."""
    require_decoder(model, "bits per byte")
    if batch_size < 1:
        raise HLMError(f"batch_size={batch_size} must be at least 1")
    texts = [t for t in texts if t]
    if not texts:
        raise HLMError("bits per byte needs at least one non-empty text")
    if tokenizer.eos_token_id is None:
        raise HLMError("bits per byte needs a tokenizer with an end-of-text (eos) token")
    limit = max_input_positions(getattr(model, "config", None))
    if seq_len is not None and limit is not None and seq_len > limit:
        raise HLMError(f"seq_len={seq_len} exceeds the model's {limit} positions")
    window = seq_len or limit or _DEFAULT_WINDOW
    windows = [
        w
        for text in texts
        for w in document_windows(
            tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id, window
        )
    ]
    windows.sort(key=lambda w: -len(w[0]))  # similar lengths per batch: little padding
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    total_nats = 0.0
    batches = range(0, len(windows), batch_size)
    with eval_mode(model, device) as device:
        for start in tqdm(batches, desc="bits per byte", unit="batch", disable=not progress):
            total_nats += _batch_nats(model, windows[start : start + batch_size], pad_id, device)
    return bpb_result(total_nats, sum(len(targets) for _, targets in windows), texts)


def _batch_nats(model, windows: list[tuple[list[int], list[int]]], pad_id: int, device) -> float:
    """Summed -log p(target) over the windows (right-padded into one batch)."""
    width = max(len(inp) for inp, _ in windows)
    input_ids_BL = torch.full((len(windows), width), pad_id, dtype=torch.long)
    mask_BL = torch.zeros_like(input_ids_BL)
    for row, (inp, _) in enumerate(windows):
        input_ids_BL[row, : len(inp)] = torch.tensor(inp)
        mask_BL[row, : len(inp)] = 1
    logits_BLV = model(input_ids=input_ids_BL.to(device), attention_mask=mask_BL.to(device)).logits
    nats = 0.0
    for row, (_, targets) in enumerate(windows):
        # One row at a time in float32: never a float32 copy of the whole (B, L, V).
        row_logits_LV = logits_BLV[row, : len(targets)].float()
        target_L = torch.tensor(targets, device=row_logits_LV.device)
        nats += F.cross_entropy(row_logits_LV, target_L, reduction="sum").item()
    return nats
