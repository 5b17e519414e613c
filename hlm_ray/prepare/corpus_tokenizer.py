"""The corpus's tokenizer: a BPE trained on a seeded sample of *training* documents (never
validation ones), or a tokenizer file; and the checks on its size.

    check_vocab_size(request)                       # before reading anything
    tok = build_tokenizer(request, pieces, say=print)
    check_vocab(tok, request, allow_smaller_vocab=False)
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from hlm_ray.errors import HLMError
from hlm_ray.prepare.request import PrepareRequest
from hlm_ray.prepare.sources import Piece, read_documents
from hlm_ray.prepare.split import split_documents


def training_sample(pieces: list[Piece], request: PrepareRequest) -> list[str]:
    """Training documents (never validation ones) from pieces in a seeded order, up to
    `train_sample_bytes` UTF-8 bytes (all of them when None)."""
    order = list(range(len(pieces)))
    random.Random(request.split_seed).shuffle(order)
    budget, texts = request.train_sample_bytes, []
    for i in order:
        docs = read_documents(
            pieces[i], text_field=request.text_field, invalid_utf8=request.invalid_utf8
        )
        for doc in split_documents(docs, request.split_seed, request.val_fraction)["train"]:
            texts.append(doc)
            if budget is not None:
                budget -= len(doc.encode("utf-8"))
                if budget <= 0:
                    return texts
    return texts


def build_tokenizer(request: PrepareRequest, pieces: list[Piece], say: Callable[[str], None]):
    """The tokenizer file's tokenizer, or a BPE trained on `training_sample` (timings said)."""
    from hlm_ray.tokenizer import load_tokenizer, special_tokens_for, train_bpe

    specials = special_tokens_for(request.family)
    if request.tokenizer_kind == "file":
        return load_tokenizer(request.tokenizer_path, special_tokens=specials)
    start = time.perf_counter()
    texts = training_sample(pieces, request)
    if not texts:
        raise HLMError(f"no text found in {list(request.sources)}: the corpus is empty")
    size = sum(len(t.encode("utf-8")) for t in texts)
    say(
        f"sampled {len(texts):,} training documents ({size / 1e6:.1f} MB) "
        f"in {time.perf_counter() - start:.1f} s; training a {request.vocab_size}-token BPE",
    )
    start = time.perf_counter()
    tok = load_tokenizer(
        train_bpe(texts, request.vocab_size, specials, min_frequency=request.min_frequency)
    )
    say(f"trained the BPE in {time.perf_counter() - start:.1f} s")
    return tok


def check_vocab(tok, request: PrepareRequest, allow_smaller_vocab: bool) -> None:
    if (
        request.tokenizer_kind == "bpe"
        and len(tok) < request.vocab_size
        and not allow_smaller_vocab
    ):
        raise HLMError(
            f"the corpus is too small for tokenizer.vocab_size={request.vocab_size}: BPE "
            f"training stopped at {len(tok)} tokens; add text, raise "
            "tokenizer.train_sample_bytes, or lower tokenizer.vocab_size"
        )


def check_vocab_size(request: PrepareRequest) -> None:
    """A BPE needs room for the byte alphabet and the family's special tokens."""
    if request.tokenizer_kind != "bpe":
        return
    from hlm_ray.tokenizer import BYTE_ALPHABET, special_tokens_for

    minimum = BYTE_ALPHABET + len(special_tokens_for(request.family))
    if request.vocab_size < minimum:
        raise HLMError(
            f"tokenizer.vocab_size={request.vocab_size} is below the {BYTE_ALPHABET} "
            f"byte-level + {minimum - BYTE_ALPHABET} special tokens; use at least {minimum}"
        )
