"""hlm_ray.unigram: counts, add-alpha smoothing fitted on held-out counts, and the unigram
model's bits per byte, which must equal `evaluate.bpb` scoring a model whose logits are the log
prior at every position (the same protocol, token for token)."""

import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import hlm_ray.unigram as unigram
from hlm_ray.errors import HLMError
from hlm_ray.evaluate.bpb import bits_per_byte
from hlm_ray.prepare.request import Prepared
from hlm_ray.unigram import (
    ALPHAS,
    Unigram,
    bpb_result,
    count_split,
    count_tokens,
    cross_entropy,
    load_counts,
    save_counts,
    unigram_bpb,
)


class CharTokenizer:
    """Bytes as tokens (ids 1..256), 0 the end-of-text: a tokenizer with no surprises."""

    eos_token_id = 0
    pad_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [b + 1 for b in text.encode("utf-8")]


class PriorModel(nn.Module):
    """A causal LM whose logits are the same (V,) vector at every position."""

    def __init__(self, log_q):
        super().__init__()
        self.log_q = nn.Parameter(torch.as_tensor(log_q, dtype=torch.float32))
        self.config = SimpleNamespace(hlm_family="decoder", max_position_embeddings=None)

    def forward(self, input_ids, attention_mask=None):
        b, length = input_ids.shape
        return SimpleNamespace(logits=self.log_q.expand(b, length, -1))


def test_counts_are_a_plain_histogram_and_refuse_foreign_ids():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, size=10_000).astype(np.uint16)
    expected = np.array([(ids == i).sum() for i in range(64)])
    assert (count_tokens(ids, 64) == expected).all()
    with pytest.raises(HLMError, match="outside the vocabulary of 40"):
        count_tokens(ids, 40)


def test_log_probs_are_add_alpha_and_normalised():
    counts = np.array([5, 0, 3, 2])
    model = Unigram(counts, 0.5, "")
    q = np.exp(model.log_probs())
    assert math.isclose(q.sum(), 1.0, rel_tol=1e-12)
    assert np.allclose(q, (counts + 0.5) / (10 + 0.5 * 4))


def test_alpha_is_fitted_on_held_out_counts():
    """Many unseen-in-training tokens held out: a large alpha wins; held-out text that follows
    the training frequencies exactly: the smallest alpha of the grid wins."""
    train = np.array([1000, 500, 0, 0, 0, 0, 0, 0])
    assert Unigram.fit(train, np.array([0, 0, 50, 50, 50, 50, 50, 50])).alpha == ALPHAS[-1]
    assert Unigram.fit(train, np.array([200, 100, 0, 0, 0, 0, 0, 0])).alpha == ALPHAS[0]
    fitted = Unigram.fit(train, np.array([600, 300, 1, 0, 0, 0, 0, 0]))
    grid = [cross_entropy(Unigram(train, a, ""), np.array([600, 300, 1, 0, 0, 0, 0, 0]))
            for a in ALPHAS]  # fmt: skip
    assert fitted.alpha == ALPHAS[int(np.argmin(grid))] and "fitted on 901" in fitted.alpha_source
    assert Unigram.fit(train).alpha == 0.5  # no held-out counts: the default, said so


@pytest.mark.parametrize("alpha", [1e-3, 0.5, 10.0])
def test_unigram_bpb_equals_the_bpb_protocol_on_a_prior_model(alpha):
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 100, size=257)
    model = Unigram(counts, alpha, "")
    texts = ["The history of the city", "ünïcödé and  spaces", "x" * 300]
    got = unigram_bpb(model, CharTokenizer(), texts)
    ref = bits_per_byte(
        PriorModel(model.log_probs()), CharTokenizer(), texts, seq_len=64, progress=False
    )
    assert got["tokens"] == ref["tokens"] and got["bytes"] == ref["bytes"]
    assert math.isclose(got["bpb"], ref["bpb"], rel_tol=1e-5)


def test_a_uniform_model_scores_log2_v_bits_per_token():
    model = Unigram(np.zeros(257, dtype=np.int64) + 7, 0.5, "")
    out = unigram_bpb(model, CharTokenizer(), ["abc"])
    assert math.isclose(out["bpb"], math.log2(257), rel_tol=1e-12)  # one byte per token


def test_counts_round_trip_and_damage_is_one_line(tmp_path):
    counts = np.arange(131_072, dtype=np.int64) % 7
    path = save_counts(tmp_path / "token_counts.npz", counts, source="test")
    back, meta = load_counts(path)
    assert (back == counts).all() and meta["source"] == "test" and meta["tokens"] == counts.sum()
    assert path.stat().st_size < 400_000  # small: compressed
    (tmp_path / "bad.npz").write_bytes(b"garbage")
    with pytest.raises(HLMError, match="not a token-counts file"):
        load_counts(tmp_path / "bad.npz")


# ------------------------------------------------------------------ the exact promises, by hand


def _error(match_text: str):
    """pytest.raises for an HLMError whose whole message is `match_text` (what the user reads)."""
    return pytest.raises(HLMError, match="^" + re.escape(match_text) + "$")


def test_counts_are_int64_in_chunks_and_the_error_names_the_id_outside(monkeypatch):
    """Counting in chunks adds up (3 ids a chunk here, 16M in use); an id equal to V is already
    outside, and a negative id is the one named (not the largest, which may be fine)."""
    monkeypatch.setattr(unigram, "_CHUNK", 3)
    ids = np.array([2, 0, 2, 1, 2, 2, 0], dtype=np.uint16)  # three chunks: 3 + 3 + 1
    counts = count_tokens(ids, 4)
    assert counts.dtype == np.int64 and counts.tolist() == [2, 1, 4, 0]
    assert count_tokens(np.zeros(0, dtype=np.int64), 3).tolist() == [0, 0, 0]
    tail = "is outside the vocabulary of 3: the tokens and the tokenizer do not belong together"
    with _error(f"token id 3 {tail}"):
        count_tokens(np.array([0, 3, 1]), 3)  # V itself is outside (one chunk: 0, 3, 1)
    with _error(f"token id -1 {tail}"):
        count_tokens(np.array([0, 1, 2, 1, 0, 2, 2, -1]), 3)  # third chunk: 2, -1


def _prepared_folder(tmp_path, shards: dict[str, list[list[int]]], vocab_size: int) -> Prepared:
    """A prepared folder as `hlm data prepare` lays it out, reduced to what `TokenBlocks` and
    `count_split` read: uint16 shards end to end per split, and the manifest naming them."""
    splits = {}
    for split, parts in shards.items():
        entries = []
        for i, tokens in enumerate(parts):
            name = f"{split}-{i:05d}.bin"
            np.asarray(tokens, dtype=np.uint16).tofile(tmp_path / name)
            entries.append({"name": name, "num_tokens": len(tokens)})
        splits[split] = {"shards": entries}
    manifest = {"dtype": "uint16", "tokenizer": {"vocab_size": vocab_size}, "splits": splits}
    return Prepared(str(tmp_path), manifest)


def test_count_split_counts_the_whole_blocks_training_reads(tmp_path):
    """Shards of 5, 3 and 7 train tokens (15): blocks of 4 cover the first 12, across the
    shards; the 3-token tail is not read by training and not counted. `max_tokens` cuts the
    stream first (9 tokens: 2 blocks, 8 tokens); the val split is counted on its own."""
    train = [[0, 1, 2, 3, 4], [5, 5, 5], [6, 7, 8, 9, 9, 9, 9]]
    prepared = _prepared_folder(tmp_path, {"train": train, "val": [[9, 9, 1, 1, 1]]}, 10)
    counts = count_split(prepared, "train", seq_len=4)
    assert counts.dtype == np.int64
    assert counts.tolist() == [1, 1, 1, 1, 1, 3, 1, 1, 1, 1]  # 12 tokens: 0..4, 5 5 5, 6 7 8 9
    assert (
        count_split(prepared, "train", seq_len=4, max_tokens=9).tolist() == [1] * 5 + [3] + [0] * 4
    )
    assert count_split(prepared, "train", seq_len=5).tolist() == [1] * 5 + [3] + [1, 1, 1, 4]
    assert count_split(prepared, "val", seq_len=2).tolist() == [0, 2, 0, 0, 0, 0, 0, 0, 0, 2]
    # the same as counting every block TokenBlocks serves
    from hlm_ray.prepare import TokenBlocks

    blocks = TokenBlocks.open(prepared, "train", seq_len=4)
    assert (counts == np.bincount(blocks[:].numpy().ravel(), minlength=10)).all()


def test_fit_keeps_int64_counts_and_says_how_alpha_was_chosen():
    train = np.array([3, 1, 0], dtype=np.uint16)
    plain = Unigram.fit(train)  # no held-out counts
    assert plain.counts.dtype == np.int64 and plain.counts.tolist() == [3, 1, 0]
    assert (plain.alpha, plain.alpha_source) == (0.5, "add-0.5 (no held-out counts)")
    assert Unigram.fit(train, np.zeros(3)).alpha_source == "add-0.5 (no held-out counts)"
    fitted = Unigram.fit(train, np.array([0, 0, 1]))  # one held-out token is enough to fit on
    assert fitted.counts.dtype == np.int64 and fitted.counts.tolist() == [3, 1, 0]
    assert fitted.alpha == ALPHAS[-1]  # the one held-out token was never seen in training
    assert fitted.alpha_source == "add-10, fitted on 1 held-out tokens"
    big = Unigram.fit(np.array([3, 1, 0]), np.array([2_000, 1_000, 1]))
    assert big.alpha_source == f"add-{big.alpha:.3g}, fitted on 3,001 held-out tokens"


def test_fit_refuses_what_is_not_a_vector_of_counts_and_takes_what_is():
    needs = "a unigram model needs a non-empty (V,) vector of token counts"
    for bad in ([], [0, 0, 0], [[1, 2], [3, 4]]):  # empty, nothing counted, not a vector
        with _error(needs):
            Unigram.fit(np.array(bad))
    assert Unigram.fit([7]).log_probs().tolist() == [0.0]  # one token: certain
    assert Unigram.fit([1, 0]).counts.tolist() == [1, 0]  # one token counted is enough
    with _error("held-out counts of (2,) for a vocabulary of (3,)"):
        Unigram.fit([1, 2, 3], [1, 1])


def test_cross_entropy_is_mean_nats_per_held_out_token():
    """counts (3, 1), add-1: q = (4/6, 2/6); held out 2 × token 0, 1 × token 1."""
    model = Unigram(np.array([3, 1]), 1.0, "")
    expected = -(2 * math.log(4 / 6) + math.log(2 / 6)) / 3
    assert math.isclose(cross_entropy(model, np.array([2, 1])), expected, rel_tol=1e-12)


def test_bpb_result_divides_by_utf8_bytes_and_tokens():
    out = bpb_result(10.0, 4, ["ab", "ü", "x"])  # 2 + 2 + 1 bytes
    assert out == {"bpb": 10.0 / math.log(2) / 5, "nats_per_token": 2.5, "tokens": 4,
                   "bytes": 5, "documents": 3}  # fmt: skip


def _bos_tokenizer():
    """A real fast tokenizer (Hugging Face) that puts <bos> (id 0) before every text unless
    told add_special_tokens=False: words a..d are ids 1..4."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "a": 1, "b": 2, "c": 3, "d": 4, "<unk>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", unk_token="<unk>")


def test_unigram_bpb_scores_the_texts_tokens_without_special_tokens():
    """The <bos> a tokenizer adds is not scored (it is context); texts that tokenize to nothing
    add bytes and no tokens; counts (1, 2, 3, 4, 0, 0) add-0.5: q(id) = (counts[id] + 0.5) / 13."""
    tok = _bos_tokenizer()
    assert tok.encode("a b") == [0, 1, 2]  # the tokenizer does add it by default
    model = Unigram(np.array([1, 2, 3, 4, 0, 0]), 0.5, "")
    texts = ["a b", "d d c", "", "  "]  # "" is dropped; "  " is 2 bytes, no token
    nats = -sum(math.log((c + 0.5) / 13) for c in [2, 3, 0, 0, 4])
    out = unigram_bpb(model, tok, texts)
    assert (out["tokens"], out["bytes"], out["documents"]) == (5, 3 + 5 + 2, 3)
    assert math.isclose(out["bpb"], nats / math.log(2) / 10, rel_tol=1e-12)


def test_unigram_bpb_refuses_no_text_and_a_foreign_tokenizer():
    model = Unigram(np.ones(5, dtype=np.int64), 0.5, "")  # ids 0..4: <unk> (5) is outside
    with _error("bits per byte needs at least one non-empty text"):
        unigram_bpb(model, _bos_tokenizer(), ["", ""])
    with _error("the tokenizer gives id 5, outside the counts' vocabulary of 5: counts and "
                "tokenizer do not belong together"):  # fmt: skip
        unigram_bpb(model, _bos_tokenizer(), ["a b", "a zzz"])  # ids 1, 5: 5 is named

    class Ids:  # a tokenizer that hands out the ids it is given
        def __init__(self, ids):
            self.ids = ids

        def encode(self, text, add_special_tokens=True):
            return self.ids

    assert unigram_bpb(model, Ids([0, 4]), ["a b"])["tokens"] == 2  # 0 and V - 1 are inside
    with _error("the tokenizer gives id -1, outside the counts' vocabulary of 5: counts and "
                "tokenizer do not belong together"):  # fmt: skip
        unigram_bpb(model, Ids([1, -1]), ["a b"])  # log_q[-1] would be the last id's


def test_a_counts_file_is_int64_and_each_damage_has_its_message(tmp_path):
    path = save_counts(tmp_path / "c.npz", np.array([3, 0, 2], dtype=np.uint16), source="t")
    with np.load(path) as f:  # the file's format: int64 counts, a JSON header
        assert f["counts"].dtype == np.int64
        assert json.loads(str(f["meta"])) == {"vocab_size": 3, "tokens": 5, "source": "t"}
    counts, meta = load_counts(path)
    assert counts.dtype == np.int64 and counts.tolist() == [3, 0, 2]
    with _error(f"{tmp_path / 'missing.npz'} does not exist"):
        load_counts(tmp_path / "missing.npz")
    np.savez(tmp_path / "no_meta.npz", counts=np.arange(3))
    again = "; count the tokens again with `hlm data count`"
    with _error(f"{tmp_path / 'no_meta.npz'} is not a token-counts file (KeyError: 'meta is "
                f"not a file in the archive'){again}"):  # fmt: skip
        load_counts(tmp_path / "no_meta.npz")
    header = {"vocab_size": 3}
    for name, bad in [("short", [1, 2]), ("negative", [1, -2, 3]), ("square", [[1, 2]] * 3)]:
        np.savez(tmp_path / f"{name}.npz", counts=np.array(bad), meta=np.array(json.dumps(header)))
        with _error(f"{tmp_path / name}.npz: its counts do not match its own header; count "
                    "them again with `hlm data count`"):  # fmt: skip
            load_counts(tmp_path / f"{name}.npz")
