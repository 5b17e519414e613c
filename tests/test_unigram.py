"""hlm_ray.unigram: counts, add-alpha smoothing fitted on held-out counts, and the unigram
model's bits per byte, which must equal `evaluate.bpb` scoring a model whose logits are the log
prior at every position (the same protocol, token for token)."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from hlm_ray.errors import HLMError
from hlm_ray.evaluate.bpb import bits_per_byte
from hlm_ray.unigram import (
    ALPHAS,
    Unigram,
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
