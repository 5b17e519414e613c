"""hlm_ray.tokenizer: BPE training and its cache, loading, special tokens, bytes per token."""

import json
import logging
import multiprocessing as mp
import time

import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hlm_ray import tokenizer as tokmod
from hlm_ray.errors import HLMError
from hlm_ray.paths import has_shared, shared_file
from hlm_ray.tokenizer import (
    load_token_bytes,
    load_tokenizer,
    special_tokens_for,
    token_byte_lengths,
    tokenizer_fingerprint,
    train_bpe,
)

SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A headless language model drops the output projection and uses contrastive weight tying.",
    "Tokenizers split text into subword units; byte-level BPE never meets an unknown character.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "Training runs compare bits per byte, because losses differ across vocabularies.",
    "Numbers like 1024, 2048 and 8192 appear in configuration files and in log lines.",
]
UNICODE_TEXT = "Café naïve façade — 東京 😀🎉\n\n\tindented line\r\nend  with  spaces "
SPECIALS = special_tokens_for("encoder")


def tiny_corpus(copies: int = 12) -> list[str]:
    """A few KB of varied English: enough distinct merges for a 500-token vocabulary."""
    texts = []
    for i in range(copies):
        rotated = SENTENCES[i % len(SENTENCES) :] + SENTENCES[: i % len(SENTENCES)]
        texts.append(f"Document {i}. " + " ".join(rotated))
    return texts


@pytest.mark.parametrize("vocab_size", [300, 500])
def test_training_hits_requested_size(vocab_size):
    folder = train_bpe(tiny_corpus(), vocab_size, SPECIALS)
    tok = load_tokenizer(folder)
    meta = json.loads((folder / "hlm_tokenizer.json").read_text())
    assert len(tok) == vocab_size == meta["vocab_size"] == meta["requested_vocab_size"]
    assert load_token_bytes(folder).shape == (vocab_size,)
    assert load_token_bytes(folder).dtype == np.int32


def test_round_trip_and_special_tokens():
    folder = train_bpe(tiny_corpus(), 400, SPECIALS)
    tok = load_tokenizer(folder)
    ids = tok(UNICODE_TEXT, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == UNICODE_TEXT
    specials = list(SPECIALS.values())
    assert tok.convert_tokens_to_ids(specials) == list(range(len(specials)))
    for role, token in SPECIALS.items():
        assert getattr(tok, role) == token
        assert tok(token, add_special_tokens=False)["input_ids"] == [
            tok.convert_tokens_to_ids(token)
        ]
    # Plain encoding adds nothing around the text.
    assert tok("hello", add_special_tokens=True)["input_ids"] == tok("hello")["input_ids"]


def test_auto_tokenizer_loads_folder():
    folder = train_bpe(tiny_corpus(), 300, SPECIALS)
    auto = AutoTokenizer.from_pretrained(folder)
    fast = PreTrainedTokenizerFast.from_pretrained(folder)
    for tok in (auto, fast):
        assert len(tok) == 300
        assert tok.mask_token_id == 2 and tok.pad_token_id == 1 and tok.eos_token_id == 0
    assert tokenizer_fingerprint(auto) == tokenizer_fingerprint(load_tokenizer(folder))


def test_cache_hit_does_not_train(monkeypatch):
    """A second call finds the folder: no training, no folder built, no file rewritten."""
    first = train_bpe(tiny_corpus(), 300, SPECIALS)
    stamps = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}

    def fail(*args, **kwargs):
        raise AssertionError("trained again instead of using the cache")

    monkeypatch.setattr(tokmod, "_train", fail)
    monkeypatch.setattr(tokmod, "_build", fail)
    assert train_bpe(tiny_corpus(), 300, SPECIALS) == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == stamps
    # A different corpus, size or max_bytes is a different tokenizer.
    with pytest.raises(AssertionError):
        train_bpe(tiny_corpus(), 300, SPECIALS, max_bytes=1000)


def _train_in_child(log_path, barrier, queue):
    barrier.wait()
    queue.put(str(train_bpe(tiny_corpus(), 320, SPECIALS)))


def test_concurrent_processes_train_once(monkeypatch, tmp_path):
    log_path = tmp_path / "trainings.log"
    real_train = tokmod._train

    def logged_train(*args, **kwargs):
        with open(log_path, "a") as f:
            f.write("trained\n")
        time.sleep(0.3)  # make sure the other process arrives while this one trains
        return real_train(*args, **kwargs)

    monkeypatch.setattr(tokmod, "_train", logged_train)
    ctx = mp.get_context("fork")  # children inherit the patched trainer and HLM_CACHE_DIR
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_train_in_child, args=(log_path, barrier, queue)) for _ in "ab"]
    for p in procs:
        p.start()
    folders = {queue.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(folders) == 1
    assert log_path.read_text().count("trained") == 1
    assert list((tmp_path / "hlm_cache" / "tokenizers").glob(".bpe*")) == []  # no temp folders


def test_vocab_too_small_and_empty_corpus():
    with pytest.raises(HLMError, match="use at least 261"):
        train_bpe(tiny_corpus(), 260, SPECIALS)
    with pytest.raises(HLMError, match="empty"):
        train_bpe(["", ""], 300, SPECIALS)


def test_early_stop_is_recorded(caplog):
    with caplog.at_level(logging.WARNING, logger="hlm_ray.tokenizer"):
        folder = train_bpe(["ab ab ab abc abc"], 5000, SPECIALS)
    meta = json.loads((folder / "hlm_tokenizer.json").read_text())
    assert meta["requested_vocab_size"] == 5000
    assert 261 <= meta["vocab_size"] < 5000
    assert len(load_tokenizer(folder)) == meta["vocab_size"]
    assert "requested 5000" in caplog.text


def test_max_bytes_uses_a_prefix():
    texts = tiny_corpus()
    folder = train_bpe(texts, 300, SPECIALS, max_bytes=400)
    same = train_bpe(texts[:1] + ["something else entirely"] * 3, 300, SPECIALS, max_bytes=400)
    assert len(texts[0].encode()) > 400
    assert folder == same  # only the first 400 bytes count


def test_trained_token_bytes_sum_to_utf8_length():
    tok = load_tokenizer(train_bpe(tiny_corpus(), 500, SPECIALS))
    lengths = token_byte_lengths(tok)
    assert lengths[: len(SPECIALS)].tolist() == [0] * len(SPECIALS)
    text = " ".join(tiny_corpus(3)) + UNICODE_TEXT
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert lengths[ids].sum() == len(text.encode("utf-8"))


needs_shared = pytest.mark.skipif(
    not has_shared("tokenizers/gpt2") or not has_shared("tokenizers/gpt-neox-20b"),
    reason="the shared data folder has no GPT-2 / GPT-NeoX tokenizers",
)


@needs_shared
@pytest.mark.parametrize(
    ("source", "size", "eos_id"),
    [("tokenizers/gpt2", 50257, 50256), ("tokenizers/gpt-neox-20b", 50277, 0)],
)
def test_shared_tokenizers(source, size, eos_id):
    tok = load_tokenizer(source)
    assert len(tok) == size
    # Asking for encoder specials reuses <|endoftext|> and appends pad/mask/cls/sep.
    tok = load_tokenizer(source, SPECIALS)
    assert tok.eos_token_id == eos_id
    assert len(tok) == size + 4
    assert tok.mask_token_id >= size and tok.pad_token_id >= size
    lengths = token_byte_lengths(tok)
    assert lengths.shape == (size + 4,) and lengths[eos_id] == 0 and lengths[size:].sum() == 0
    text = shared_file("corpus/en/moby_dick.txt").read_text()[20000:60000] + UNICODE_TEXT
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert lengths[ids].sum() == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


@needs_shared
def test_gpt2_matches_known_ids():
    tok = load_tokenizer("tokenizers/gpt2")
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert tok(" Hello world")["input_ids"] == [18435, 995]


def test_corrupt_tokenizer_json(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": ')
    for source in (bad, tmp_path):
        with pytest.raises(HLMError, match="cannot read tokenizer .*pass a tokenizer.json"):
            load_tokenizer(source)
    with pytest.raises(HLMError, match="no tokenizer at"):
        load_tokenizer(tmp_path / "missing" / "tokenizer.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HLMError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")


def test_unknown_family():
    with pytest.raises(HLMError, match="decoder"):
        special_tokens_for("seq2seq")
    assert special_tokens_for("decoder") == {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
