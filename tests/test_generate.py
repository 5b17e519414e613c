"""The generation library: logit filters against plain references, the KV-cache loop against a
no-cache reference, batching, seeds, stop sequences, streaming, and which models may generate."""

from __future__ import annotations

import json
import math
import random
import shutil
import time

import numpy as np
import pytest
import torch

from hlm_ray.errors import HLMError
from hlm_ray.generate import (
    Generator,
    Row,
    SamplingParams,
    _held_back,
    apply_temperature,
    default_model_name,
    row_seed,
    sample_next,
    top_k_filter,
    top_p_filter,
)

PROMPTS = ["The cat sat on the", "Once", "", "In 1999 the city of New York had a population"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_decoder_dir):
    return tiny_decoder_dir


@pytest.fixture(scope="module")
def gen(model_dir) -> Generator:
    return Generator.load(model_dir)


def _variant(model_dir, tmp_path, **config) -> str:
    """A copy of the model folder with `config` merged into its config.json."""
    folder = tmp_path / "variant" / "model"
    shutil.copytree(model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


# ----------------------------------------------------------------------------- filters


def test_top_k_filter_matches_reference():
    logits = torch.randn(4, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ks = [0, 1, 7, 50]
    out = top_k_filter(logits, torch.tensor(ks))
    for row, k in enumerate(ks):
        values = logits[row].numpy()
        keep = np.ones(50, bool) if k in (0, 50) else values >= np.sort(values)[::-1][k - 1]
        expected = np.where(keep, values, -np.inf)
        np.testing.assert_array_equal(out[row].numpy(), expected)
        assert np.isfinite(out[row].numpy()).sum() == (k or 50)


def test_top_p_filter_matches_reference():
    logits = torch.randn(5, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ps = [0.05, 0.3, 0.5, 0.9, 1.0]
    out = top_p_filter(logits, torch.tensor(ps, dtype=torch.float64))
    for row, p in enumerate(ps):
        values = logits[row].numpy()
        probs = np.exp(values - values.max())
        probs /= probs.sum()
        # Reference: take tokens in order of probability until their total reaches p.
        keep, total = np.zeros(40, bool), 0.0
        for token in np.argsort(-probs):
            if total >= p and p < 1:
                break
            keep[token] = True
            total += probs[token]
        np.testing.assert_array_equal(out[row].numpy(), np.where(keep, values, -np.inf))
    assert np.isfinite(out[0].numpy()).sum() >= 1


def test_temperature_divides_and_zero_is_left_alone():
    logits = torch.tensor([[1.0, 2.0, 4.0], [1.0, 2.0, 4.0]])
    out = apply_temperature(logits, torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(out, torch.tensor([[2.0, 4.0, 8.0], [1.0, 2.0, 4.0]]))


def test_sample_next_follows_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = [SamplingParams(temperature=0.7, top_k=4, top_p=0.9)]
    g = random.Random(0)
    draws = [int(sample_next(logits, params, [g])[0]) for _ in range(4000)]
    counts = np.bincount(draws, minlength=6) / len(draws)
    # Reference in float64: softmax(logits / T) over the top 4, then the nucleus of mass 0.9.
    z = logits[0].double().numpy() / 0.7
    z[np.argsort(-z)[4:]] = -np.inf
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order, keep, total = np.argsort(-probs), np.zeros(6, bool), 0.0
    for token in order:
        if total >= 0.9:
            break
        keep[token], total = True, total + probs[token]
    expected = np.where(keep, probs, 0.0) / probs[keep].sum()
    np.testing.assert_allclose(counts, expected, atol=0.03)
    assert counts[~keep].sum() == 0
    # Greedy rows ignore generators and take the argmax.
    assert int(sample_next(logits, [SamplingParams(temperature=0)], [None])[0]) == 0


def test_sampling_params_are_checked():
    for bad in (
        {"max_new_tokens": 0},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_k": 0},
        {"stop": ("",)},
    ):
        with pytest.raises(HLMError, match=next(iter(bad))):
            SamplingParams(**bad)


# ----------------------------------------------------------------------------- decoding


def test_greedy_matches_a_no_cache_reference(gen):
    """The KV-cache loop with explicit positions gives the tokens a plain full forward gives."""
    [out] = gen.generate(PROMPTS[0], max_new_tokens=10, temperature=0)
    ids = gen.encode(PROMPTS[0])
    with torch.no_grad():
        for _ in range(10):
            logits = gen.model(torch.tensor([ids])).logits[0, -1]
            logits[gen.pad_id] = -math.inf
            ids.append(int(logits.argmax()))
    reference = ids[len(gen.encode(PROMPTS[0])) :]
    assert gen.eos_id not in reference  # (otherwise the comparison below would be cut short)
    assert out.token_ids == reference
    assert out.finish_reason == "length" and out.completion_tokens == 10


def test_greedy_batched_equals_unbatched(gen):
    batched = gen.generate(PROMPTS, max_new_tokens=12, temperature=0)
    alone = [gen.generate(p, max_new_tokens=12, temperature=0)[0] for p in PROMPTS]
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
    assert [c.text for c in batched] == [c.text for c in alone]
    assert [c.prompt_tokens for c in batched] == [len(gen.encode(p)) for p in PROMPTS]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(gen):
    kwargs = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.95}
    first = gen.generate("The cat", seed=7, n=2, **kwargs)
    again = gen.generate("The cat", seed=7, n=2, **kwargs)
    batched = gen.generate(["Once upon", "The cat"], seed=7, n=2, **kwargs)[2:]
    other = gen.generate("The cat", seed=8, n=2, **kwargs)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] == [c.token_ids for c in batched]
    assert first[0].token_ids != first[1].token_ids  # n choices draw differently
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


def test_stop_sequences_cut_the_text(gen):
    [full] = gen.generate(PROMPTS[3], max_new_tokens=20, temperature=0)
    stops = [full.text[5:8], "never-generated"]
    [cut] = gen.generate(PROMPTS[3], max_new_tokens=20, temperature=0, stop=stops)
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stops[0])]
    assert full.text.startswith(cut.text) and stops[0] not in cut.text
    assert cut.completion_tokens < 20


def test_eos_ends_a_row(gen):
    [full] = gen.generate(PROMPTS[0], max_new_tokens=8, temperature=0)
    j = 3
    eos = full.token_ids[j]
    first = full.token_ids.index(eos)
    old = gen.eos_id
    gen.eos_id = eos  # pretend that token is EOS: the row must stop there, EOS left out
    try:
        [out] = gen.generate(PROMPTS[0], max_new_tokens=8, temperature=0)
    finally:
        gen.eos_id = old
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:first]
    assert out.completion_tokens == first + 1


def test_stream_concatenates_to_generate(gen):
    kwargs = {"max_new_tokens": 20, "temperature": 0.9, "seed": 3, "n": 2, "stop": ["e "]}
    prompts = PROMPTS[:2]
    completions = gen.generate(prompts, **kwargs)
    texts, reasons = ["" for _ in completions], [None for _ in completions]
    steps = 0
    for delta in gen.stream(prompts, **kwargs):
        assert reasons[delta.index] is None  # nothing after a row's last delta
        texts[delta.index] += delta.text
        reasons[delta.index] = delta.finish_reason
        steps += 1
    assert texts == [c.text for c in completions]
    assert reasons == [c.finish_reason for c in completions]
    assert steps > len(completions)  # several deltas, not one at the end


def test_held_back_covers_partial_stop_sequences():
    assert _held_back("hello wor", ("world",)) == 3
    assert _held_back("hello", ("xyz",)) == 0
    assert _held_back("ab", ()) == 0


def test_rows_past_their_deadline_time_out(gen):
    params = SamplingParams(max_new_tokens=5, temperature=0)
    late = Row(gen.encode("x"), params, deadline=time.monotonic() - 1)
    fine = Row(gen.encode("x"), params)
    out = gen.complete_rows([late, fine])
    assert [c.finish_reason for c in out] == ["timeout", "length"]


def test_prompt_longer_than_the_positions_is_refused(gen):
    with pytest.raises(HLMError, match="positions"):
        gen.generate("word " * 200, max_new_tokens=4)
    with pytest.raises(HLMError, match="positions"):
        gen.generate("word", max_new_tokens=gen.max_positions)
    with pytest.raises(HLMError, match="no prompts"):
        gen.generate([], max_new_tokens=4)


def test_row_seed_depends_on_seed_and_choice_only():
    assert row_seed(1, 0) == row_seed(1, 0) != row_seed(1, 1)
    assert row_seed(1, 0) != row_seed(2, 0)


# ----------------------------------------------------------------------------- loading


def test_headless_decoder_that_was_not_finetuned_is_refused(model_dir, tmp_path):
    headless = _variant(model_dir, tmp_path, hlm_objective="headless")
    with pytest.raises(HLMError, match=r"hlm finetune --task clm --model .*variant"):
        Generator.load(headless)
    with pytest.warns(UserWarning, match="raw Eᵀ"):
        gen = Generator.load(headless, allow_raw_head=True)
    assert gen.generate("a", max_new_tokens=2, temperature=0)[0].completion_tokens == 2


def test_finetuned_headless_decoder_loads(model_dir, tmp_path):
    tuned = _variant(model_dir, tmp_path, hlm_objective="headless", hlm_finetuned="clm")
    assert Generator.load(tuned).info["finetuned"] == "clm"


def test_encoder_is_refused(model_dir, tmp_path):
    encoder = _variant(model_dir, tmp_path, hlm_family="encoder", model_type="bert")
    with pytest.raises(HLMError, match="encoder"):
        Generator.load(encoder)


def test_default_model_name(tmp_path):
    assert default_model_name("models:/tiny-gen/3") == "tiny-gen/3"
    assert default_model_name("models:/tiny-gen@prod") == "tiny-gen@prod"
    assert default_model_name(tmp_path / "run-a" / "model") == "run-a"
    assert default_model_name(tmp_path / "run-a" / "checkpoint_00000010") == (
        "run-a/checkpoint_00000010"
    )


def test_huge_top_k_keeps_every_token_instead_of_overflowing():
    """top_k = 2**63 raised in torch.tensor and failed the whole batch (issue 14)."""
    logits = torch.randn(3, 11)
    params = [SamplingParams(temperature=1.0, top_k=k) for k in (2**63, 10**30, 3)]
    gens = [random.Random(i) for i in range(3)]
    drawn = sample_next(logits, params, gens)
    assert drawn.shape == (3,) and int(drawn.max()) < 11
    assert int(drawn[2]) in logits[2].topk(3).indices.tolist()


def test_a_failing_request_fails_alone_and_its_batch_mates_complete(gen):
    """complete_groups: one group whose row cannot be decoded (a token id past the vocabulary
    fails in the embedding) fails alone; the others get exactly the text they get alone."""
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=2**63)
    groups = [
        gen.rows(PROMPTS[0], greedy),
        [Row([gen.vocab_size + 5], greedy)],  # poisoned
        gen.rows(PROMPTS[1], sampled, seed=3, n=2),
        gen.rows(PROMPTS[3], greedy),
    ]
    errors = gen.complete_groups(groups)
    assert errors[1] is not None and [errors[i] for i in (0, 2, 3)] == [None, None, None]
    alone = [
        gen.generate(PROMPTS[0], max_new_tokens=8, temperature=0),
        gen.generate(PROMPTS[1], max_new_tokens=8, temperature=1.0, top_k=2**63, seed=3, n=2),
        gen.generate(PROMPTS[3], max_new_tokens=8, temperature=0),
    ]
    for group, expected in zip([groups[0], groups[2], groups[3]], alone, strict=True):
        assert [row.result.text for row in group] == [c.text for c in expected]


def test_incremental_detokenization_equals_decoding_everything(gen):
    """A row's text is decoded incrementally (byte-level tokenizer): token by token, through
    multi-byte characters split across tokens, it equals decoding all its tokens at once."""
    assert gen._incremental
    ids = gen.encode("Été 🐍 naïve — 東京 ok") * 3
    row = Row([0], SamplingParams())
    for i, token in enumerate(ids):
        row.token_ids.append(token)
        assert gen._row_text(row) == gen.tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
