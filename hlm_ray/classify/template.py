"""The saved tokenizer wraps inputs exactly as classifier training did.

hlm_ray's byte-level tokenizers add no special tokens, so `PairEncoder` builds classifier inputs
by hand: ``[cls] a [sep]`` and ``[cls] a [sep] b [sep]``, segment ids all 0. A saved classifier's
tokenizer gets a `TemplateProcessing` post-processor that does the same, so that
``pipeline("text-classification", model=folder)`` and ``tokenizer(a, b)`` feed the model what it
was trained on:

    tok = with_classifier_template(tokenizer, max_length=64)   # a copy; `tokenizer` is unchanged
    tok("a film", "a movie")["input_ids"] == PairEncoder(tokenizer, 64)(...)[0]  # same ids
    tok.save_pretrained(folder)

A tokenizer that already wraps its inputs (a hub BERT's) is returned unchanged: training used
its own post-processor.
"""

from __future__ import annotations

import copy

from transformers import PreTrainedTokenizerFast

from hlm_ray.errors import HLMError


def _first_id(*ids: int | None) -> int | None:
    return next((i for i in ids if i is not None), None)


def special_ids(tokenizer: PreTrainedTokenizerFast) -> tuple[int | None, int | None]:
    """(cls, sep) as training uses them: cls / sep, else bos / eos (a decoder's tokenizer)."""
    cls = _first_id(tokenizer.cls_token_id, tokenizer.bos_token_id)
    sep = _first_id(tokenizer.sep_token_id, tokenizer.eos_token_id)
    return cls, sep


def adds_special_tokens(tokenizer: PreTrainedTokenizerFast) -> bool:
    """Whether the tokenizer's own post-processor wraps inputs (hub BERT does, hlm_ray's not)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return tokenizer("a")["input_ids"] != plain


def with_classifier_template(
    tokenizer: PreTrainedTokenizerFast, *, max_length: int | None = None
) -> PreTrainedTokenizerFast:
    """A copy of `tokenizer` whose post-processor adds [cls]/[sep] as training did (segment ids
    0 for both texts: hlm_ray never trains a second segment embedding). `max_length` (what
    training truncated to) becomes `model_max_length`, so ``truncation=True`` stays in range."""
    from tokenizers.processors import TemplateProcessing

    out = copy.deepcopy(tokenizer)
    if max_length is not None:
        out.model_max_length = max_length
    if adds_special_tokens(tokenizer):
        return out
    cls, sep = special_ids(tokenizer)
    if cls is None or sep is None:
        raise HLMError(
            "the tokenizer has neither [CLS]/[SEP] nor BOS/EOS tokens; a classifier's saved "
            "tokenizer needs them to mark its inputs"
        )
    cls_tok, sep_tok = tokenizer.convert_ids_to_tokens([cls, sep])
    out.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{cls_tok}:0 $A:0 {sep_tok}:0",
        pair=f"{cls_tok}:0 $A:0 {sep_tok}:0 $B:0 {sep_tok}:0",
        special_tokens=[(cls_tok, cls), (sep_tok, sep)],
    )
    return out
