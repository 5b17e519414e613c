"""Byte-level BPE tokenizers: train (cached), load from anywhere, and count bytes per token.

Every tokenizer hlm_ray uses is a `transformers.PreTrainedTokenizerFast`. Trained ones live in
``cache_dir("tokenizers", <key>)`` with a ``token_bytes.npy`` (UTF-8 bytes per token id) so that
runs with different vocabularies can be compared in bits per byte.

    from hlm_ray.tokenizer import load_tokenizer, special_tokens_for, train_bpe
    specials = special_tokens_for("encoder")
    folder = train_bpe(texts, 8192, specials)          # trains once, then a cache hit
    tok = load_tokenizer(folder)
    gpt2 = load_tokenizer("tokenizers/gpt2", specials)  # shared data folder, + pad/mask/cls/sep
    nbytes = token_byte_lengths(tok)                    # int32 (len(tok),)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hlm_ray.errors import HLMError, one_line
from hlm_ray.paths import HUB_FALLBACKS, cache_dir, data_dir, has_shared, shared_file

log = logging.getLogger(__name__)

TOKEN_BYTES_FILE = "token_bytes.npy"
META_FILE = "hlm_tokenizer.json"
BYTE_ALPHABET = 256
_SOURCE_HINT = (
    "pass a tokenizer.json, a folder holding one, a GPT-2 folder with encoder.json + vocab.bpe, "
    "a path inside the data folder, or a hub name"
)


# ----------------------------------------------------------------------------- special tokens


def special_tokens_for(family: str) -> dict[str, str]:
    """The special tokens a model family needs, keyed by `PreTrainedTokenizerFast` attribute."""
    decoder = {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
    if family == "decoder":
        return decoder
    if family == "encoder":
        return {
            **decoder,
            "mask_token": "<|mask|>",
            "cls_token": "<|cls|>",
            "sep_token": "<|sep|>",
        }
    raise HLMError(f"unknown model family {family!r}; use 'decoder' or 'encoder'")


def _add_missing_specials(tok: PreTrainedTokenizerFast, special_tokens: dict[str, str]) -> None:
    """Give `tok` each requested role it lacks; a role it already has keeps its token.

    A requested token that is already in the vocabulary (GPT-NeoX's <|endoftext|>) is marked
    special with its existing id; only new strings grow the vocabulary.
    """
    missing = {role: token for role, token in special_tokens.items() if getattr(tok, role) is None}
    if missing:
        tok.add_special_tokens(missing)


# ----------------------------------------------------------------------------- training


def _used_texts(texts: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    """The non-empty texts in order, cut after `max_bytes` UTF-8 bytes (deterministic prefix)."""
    left = max_bytes
    for text in texts:
        if not text:
            continue
        if left is not None:
            raw = text.encode("utf-8")
            if len(raw) > left:
                # Cut on a byte budget; drop a multi-byte character split by the cut.
                text = raw[:left].decode("utf-8", errors="ignore")
            left -= len(raw)
            if not text:
                return
        yield text
        if left is not None and left <= 0:
            return


def _corpus_sha256(texts: Iterable[str]) -> tuple[str, int]:
    """sha256 over length-prefixed UTF-8 texts (so ["ab", "c"] != ["a", "bc"]) and the count."""
    digest, count = hashlib.sha256(), 0
    for text in texts:
        raw = text.encode("utf-8")
        digest.update(len(raw).to_bytes(8, "little"))
        digest.update(raw)
        count += 1
    return digest.hexdigest(), count


def _training_key(corpus_sha: str, settings: dict) -> str:
    payload = json.dumps({"corpus_sha256": corpus_sha, **settings}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def _new_byte_level_bpe() -> Tokenizer:
    """An empty GPT-2-style tokenizer: byte-level pre-tokenizer, decoder and post-processor."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _train(texts: Iterable[str], vocab_size: int, specials: list[str], min_frequency: int):
    """Train a byte-level BPE on `texts`; special tokens get ids 0..len(specials)-1."""
    tok = _new_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even unseen ones
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _check_vocab_size(vocab_size: int, special_tokens: dict[str, str]) -> None:
    if len(set(special_tokens.values())) != len(special_tokens):
        raise HLMError(f"special tokens must be distinct strings, got {special_tokens}")
    minimum = BYTE_ALPHABET + len(special_tokens)
    if vocab_size < minimum:
        raise HLMError(
            f"vocab_size={vocab_size} is below the {BYTE_ALPHABET} byte-level + "
            f"{len(special_tokens)} special tokens; use at least {minimum}"
        )


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: dict[str, str],
    *,
    min_frequency: int = 2,
    max_bytes: int | None = None,
) -> Path:
    """Train (or find in the cache) a byte-level BPE and return its folder.

    `texts` must be re-iterable (a list, a `datasets` column): it is read once to hash it and
    once to train. The folder loads with `AutoTokenizer.from_pretrained` / `load_tokenizer`.
    """
    _check_vocab_size(vocab_size, special_tokens)
    if max_bytes is not None and max_bytes <= 0:
        raise HLMError(f"max_bytes={max_bytes} must be positive (or None for all the text)")
    corpus_sha, count = _corpus_sha256(_used_texts(texts, max_bytes))
    if count == 0:
        raise HLMError("the tokenizer training corpus is empty; pass at least one non-empty text")
    settings = {
        "vocab_size": vocab_size,
        "special_tokens": list(special_tokens.items()),
        "min_frequency": min_frequency,
        "max_bytes": max_bytes,
        "tokenizers_version": tokenizers.__version__,
    }
    key = _training_key(corpus_sha, settings)
    root = cache_dir("tokenizers")
    target = root / f"bpe{vocab_size}-{key[:24]}"
    if (target / META_FILE).exists():
        return target
    # Only one process trains a given tokenizer; the others wait here, then find the folder.
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / META_FILE).exists():
            meta = {"corpus_sha256": corpus_sha, "requested_vocab_size": vocab_size}
            used = _used_texts(texts, max_bytes)
            _build(target, used, special_tokens, min_frequency, meta)
    return target


def _build(target: Path, texts, special_tokens: dict[str, str], min_frequency: int, meta: dict):
    """Train into a temp folder next to `target`, then rename it into place (atomic)."""
    start = time.perf_counter()
    requested = meta["requested_vocab_size"]
    backend = _train(texts, requested, list(special_tokens.values()), min_frequency)
    seconds = time.perf_counter() - start
    real = backend.get_vocab_size()
    if real < requested:
        log.warning(
            "BPE training stopped at %d tokens (requested %d): the corpus has too few merges "
            "with min_frequency=%d; the model will use %d",
            real,
            requested,
            min_frequency,
            real,
        )
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        save_tokenizer(tok, tmp)
        meta = {
            **meta,
            "vocab_size": len(tok),
            "special_tokens": special_tokens,
            "min_frequency": min_frequency,
            "train_seconds": round(seconds, 3),
            "tokenizers_version": tokenizers.__version__,
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("trained a %d-token BPE in %.1f s -> %s", len(tok), seconds, target)


# ----------------------------------------------------------------------------- loading


def _from_gpt2_files(folder: Path) -> PreTrainedTokenizerFast:
    """GPT-2's original encoder.json + vocab.bpe as a fast tokenizer.

    transformers 5 ignores `GPT2TokenizerFast(vocab_file=..., merges_file=...)` (it silently
    builds an empty vocabulary), so build the `tokenizers` pipeline GPT-2 uses ourselves.
    """
    backend = _new_byte_level_bpe()
    backend.model = models.BPE.from_file(str(folder / "encoder.json"), str(folder / "vocab.bpe"))
    eos = "<|endoftext|>"
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=eos, bos_token=eos, unk_token=eos
    )


def _from_path(path: Path) -> PreTrainedTokenizerFast:
    """A tokenizer from a local file or folder; `HLMError` when it cannot be read."""
    try:
        if path.is_file():
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        if (path / "tokenizer.json").is_file():
            # from_pretrained also reads tokenizer_config.json (special-token roles) if present.
            return PreTrainedTokenizerFast.from_pretrained(str(path))
        if (path / "encoder.json").is_file() and (path / "vocab.bpe").is_file():
            return _from_gpt2_files(path)
    except Exception as err:  # tokenizers raises plain Exception subclasses on bad JSON
        raise HLMError(f"cannot read tokenizer {path}: {one_line(err)}; {_SOURCE_HINT}") from err
    raise HLMError(
        f"cannot read tokenizer {path}: no tokenizer.json or encoder.json + vocab.bpe; "
        + _SOURCE_HINT
    )


def _from_hub(name: str, local: Path | None, offline: bool = False) -> PreTrainedTokenizerFast:
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=offline)
    except Exception as err:
        where = f"not in the data folder ({local}) and " if local else ""
        raise HLMError(
            f"tokenizer {name!r}: {where}the hub could not provide it ({one_line(err)}); {_SOURCE_HINT}"
        ) from err
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise HLMError(f"tokenizer {name!r} has no fast (tokenizers) version; {_SOURCE_HINT}")
    return tok


def load_tokenizer(
    source: str | Path, special_tokens: dict[str, str] | None = None, *, offline: bool = False
) -> PreTrainedTokenizerFast:
    """Load a tokenizer from a path, a path inside the data folder, or a hub name.

    `special_tokens` roles the tokenizer lacks are added (new ids at the end); roles it already
    has keep their token (GPT-2's eos stays <|endoftext|>). `offline`: a hub name is read from
    Hugging Face's local cache only (no request, no retries), else it is an HLMError.
    """
    path = Path(source).expanduser()
    if path.exists():
        tok = _from_path(path)
    elif has_shared(str(source)):
        tok = _from_path(shared_file(str(source)))
    elif isinstance(source, Path) or str(source).startswith(("/", "./", "../", "~")):
        raise HLMError(f"no tokenizer at {path}; {_SOURCE_HINT}")
    else:
        name = str(source)
        hub = HUB_FALLBACKS.get(name)
        local = data_dir() / name if isinstance(hub, str) else None
        tok = _from_hub(hub if isinstance(hub, str) else name, local, offline)
    if special_tokens:
        _add_missing_specials(tok, special_tokens)
    return tok


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: str | Path) -> None:
    """`save_pretrained` plus ``token_bytes.npy`` (int32, UTF-8 bytes per token id)."""
    folder = Path(folder)
    tokenizer.save_pretrained(str(folder))
    np.save(folder / TOKEN_BYTES_FILE, token_byte_lengths(tokenizer))


def load_token_bytes(folder: str | Path) -> np.ndarray:
    """The folder's ``token_bytes.npy``, or computed from its tokenizer when absent."""
    path = Path(folder) / TOKEN_BYTES_FILE
    if path.exists():
        return np.load(path).astype(np.int32, copy=False)
    return token_byte_lengths(load_tokenizer(folder))


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """sha256 of the tokenizer's full JSON (vocab, merges, added tokens, pipeline)."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------- bytes per token


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's `bytes_to_unicode`: the printable stand-in character -> its byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:  # unprintable bytes are shifted past 255, in byte order
            chars[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in chars.items()}


def _is_byte_level(tokenizer: PreTrainedTokenizerFast) -> bool:
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    return "ByteLevel" in kinds


def token_byte_lengths(tokenizer: PreTrainedTokenizerFast) -> np.ndarray:
    """UTF-8 bytes each token id stands for, int32 (len(tokenizer),); 0 for special tokens.

    For any text without special tokens, ``lengths[ids].sum() == len(text.encode())`` (after the
    tokenizer's own normalizer, e.g. NFC for GPT-NeoX).
    """
    lengths = np.zeros(len(tokenizer), dtype=np.int32)
    byte_level = _is_byte_level(tokenizer)
    table = _unicode_to_byte()
    for token, idx in tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False).items():
        if byte_level and all(ch in table for ch in token):
            lengths[idx] = len(token)  # one stand-in character per byte
        else:
            lengths[idx] = len(tokenizer.decode([idx]).encode("utf-8"))
    # Added tokens match raw text (GPT-NeoX's runs of spaces) unless they are special.
    for idx, added in tokenizer.added_tokens_decoder.items():
        lengths[idx] = 0 if added.special else len(added.content.encode("utf-8"))
    return lengths
