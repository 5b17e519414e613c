"""The generation library: logit filters against plain references, the KV-cache loop against a
no-cache reference, batching, seeds, stop sequences, streaming, and which models may generate."""

from __future__ import annotations

import copy
import json
import math
import random
import shutil
import time
import warnings

import numpy as np
import pytest
import torch

from hlm_ray.detokenize import IncrementalText, _byte_decoder
from hlm_ray.errors import HLMError
from hlm_ray.generate import (
    Generator,
    Row,
    SamplingParams,
    apply_temperature,
    default_model_name,
    row_seed,
    sample_next,
    top_k_filter,
    top_p_filter,
)
from hlm_ray.generate.loading import check_generation_ready
from hlm_ray.generate.stops import held_back
from hlm_ray.paths import data_dir
from hlm_ray.pretrained import model_info

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
        {"max_new_tokens": -1},
        {"logprobs": -1},
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


def test_underflowing_temperatures_and_top_p_are_greedy_not_hot_or_empty(gen):
    """1e-300 is 0 in float32 and was then sampled at temperature 1; 1e-39 made the logits
    inf (NaN probabilities) and top_p 1e-46 (0 in float32) dropped every token: both ended at
    once with an empty completion. Tiny values decode as greedy does."""
    [greedy] = gen.generate(PROMPTS[0], max_new_tokens=8, temperature=0)
    for settings in ({"temperature": 1e-300}, {"temperature": 1e-39}, {"top_p": 1e-46}):
        for seed in (1, 2, 3):
            [out] = gen.generate(PROMPTS[0], max_new_tokens=8, seed=seed, **settings)
            assert out.token_ids == greedy.token_ids, (settings, seed)


def test_underflowing_sampling_settings_take_the_argmax_row_by_row():
    """The same as plain functions (`test_sampling.py` has the rest of `hlm_ray.sampling`):
    each cold row takes its argmax, a warm row beside it still samples."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [2.0, 2.0, 2.0]])
    rows = [SamplingParams(temperature=1e-300), SamplingParams(temperature=5e-324)]
    rows.append(SamplingParams(temperature=1.0))  # uniform: every token drawn sometimes
    warm = set()
    for seed in range(40):
        draws = [random.Random(seed), random.Random(seed + 1), random.Random(seed + 2)]
        cold_1, cold_2, drawn = sample_next(logits, rows, draws).tolist()
        assert cold_1 == cold_2 == 1
        warm.add(drawn)
    assert warm == {0, 1, 2}
    row = [SamplingParams(top_p=1e-46)]
    assert top_p_filter(logits[:1], torch.tensor([1e-46])).isfinite().tolist() == [
        [False, True, False]
    ]
    assert {int(sample_next(logits[:1], row, [random.Random(s)])[0]) for s in range(20)} == {1}
    cold = [SamplingParams(temperature=1e-39)]  # logits / 1e-39: inf, not NaN probabilities
    assert int(sample_next(logits[:1], cold, [random.Random(0)])[0]) == 1


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
    assert held_back("hello wor", ("world",)) == 3
    assert held_back("hello", ("xyz",)) == 0
    assert held_back("ab", ()) == 0


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


def test_headless_decoder_that_was_not_finetuned_generates_through_its_prior_readout(
    model_dir, tmp_path
):
    """With the token counts its run saved: the prior readout, no warning. Without them:
    refused (saying how to get them, or a head), unless its raw Eᵀ is asked for."""
    from hlm_ray.readout import READOUT_FILE
    from hlm_ray.unigram import COUNTS_FILE

    headless = _variant(model_dir, tmp_path, hlm_objective="headless")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        gen = Generator.load(headless)
    assert gen.info["readout"] == "prior"
    assert type(gen.model.get_output_embeddings()).__name__ == "ReadoutHead"
    assert gen.generate("a", max_new_tokens=2, temperature=0)[0].completion_tokens == 2
    for name in (COUNTS_FILE, READOUT_FILE):
        (tmp_path / "variant" / "model" / name).unlink()
    with pytest.raises(HLMError, match=r"hlm data count --model .*hlm finetune --task clm"):
        Generator.load(headless)
    with pytest.raises(HLMError, match="no token counts"):
        check_generation_ready(model_info(headless), headless, readout="prior", folder=headless)
    with pytest.raises(HLMError, match="readouts are tied, prior"):
        check_generation_ready(model_info(headless), headless, readout="head", folder=headless)
    with pytest.warns(UserWarning, match="raw Eᵀ"):
        gen = Generator.load(headless, allow_raw_head=True)
    assert gen.info["readout"] == "tied"
    assert gen.generate("a", max_new_tokens=2, temperature=0)[0].completion_tokens == 2
    with pytest.warns(UserWarning, match="raw Eᵀ"):
        assert Generator.load(headless, readout="tied").info["readout"] == "tied"


def test_finetuned_headless_decoder_loads(model_dir, tmp_path):
    tuned = _variant(model_dir, tmp_path, hlm_objective="headless", hlm_finetuned="clm")
    assert Generator.load(tuned).info["finetuned"] == "clm"


@pytest.mark.parametrize("objective", ["vanilla", "headless"])
def test_a_generator_without_weights_tokenizes_and_formats_like_the_full_one(
    model_dir, tmp_path, objective
):
    """What a serving replica with a decode process loads (`weights=False`): the same names,
    limits, ids and token strings, the model on the meta device (no memory for weights)."""
    ref = model_dir
    if objective == "headless":  # served with its raw Eᵀ head
        ref = _variant(model_dir, tmp_path, hlm_objective="headless")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the raw-head warning
        full = Generator.load(ref, allow_raw_head=True)
        light = Generator.load(ref, allow_raw_head=True, weights=False)
    assert all(p.is_meta for p in light.model.parameters())
    assert type(light.model) is type(full.model)
    for attr in ("name", "info", "max_positions", "vocab_size", "eos_id", "pad_id"):
        assert getattr(light, attr) == getattr(full, attr), attr
    text = "Once upon a time, the café was 20% full"
    assert light.encode(text) == full.encode(text)
    ids = full.encode(text)
    assert light.token_strings(ids) == full.token_strings(ids)
    assert light.text_offsets(ids) == full.text_offsets(ids)


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


def _real_text() -> str:
    """Real text with non-ASCII: French, Chinese, Hindi and Arabic XNLI sentences."""
    lines = []
    for lang in ("fr", "zh", "hi", "ar"):
        path = data_dir() / "eval" / "xnli" / f"dev-{lang}.tsv"
        lines += path.read_text(encoding="utf-8").splitlines()[1:4]
    return "\n".join(lines) + " Été 🐍 naïve — 東京 ok"


def test_incremental_detokenization_equals_decoding_everything(gen):
    """Text is decoded incrementally (only the tokens since the last whole character, with the
    piece before them as context): token by token, through multi-byte characters split across
    tokens, the pieces concatenate to decoding all the tokens at once, on real multilingual
    text and on ids that end inside a character."""
    text = _real_text()
    ids = gen.encode(text)
    assert len(ids) > 300 and any(s.startswith("bytes:") for s in gen.token_strings(ids))
    split = next(i for i, s in enumerate(gen.token_strings(ids)) if s.startswith("bytes:"))
    for case in (ids, ids[:-1], ids[: split + 1]):  # the last ends inside a character
        inc = IncrementalText(gen._decode)
        pieces = [inc.push(token) for token in case]
        pieces.append(inc.flush())
        full = gen.tokenizer.decode(case, skip_special_tokens=True)
        assert "".join(pieces) == inc.text == full
        assert all("\ufffd" not in piece for piece in pieces[:-1])
    assert "".join(d.text for d in gen.stream(text[-30:], max_new_tokens=60, temperature=0)) == (
        gen.generate(text[-30:], max_new_tokens=60, temperature=0)[0].text
    )


def test_token_strings_and_offsets(gen):
    """logprobs.tokens: each token's bytes as text, `bytes:\\x..` for part of a character;
    text_offset: where each token starts in the decoded text."""
    from tokenizers import pre_tokenizers

    assert set(_byte_decoder()) == set(pre_tokenizers.ByteLevel.alphabet())  # GPT-2's table
    text = "The cat. Été 🐍"
    ids = gen.encode(text)
    strings = gen.token_strings(ids)
    raw = b"".join(
        bytes.fromhex(s[6:].replace("\\x", "")) if s.startswith("bytes:") else s.encode()
        for s in strings
    )
    assert raw.decode() == text
    offsets, decoded = gen.text_offsets(ids)
    assert decoded == text and offsets[0] == 0 and offsets == sorted(offsets)
    for i, start in enumerate(offsets):  # a token starts where the text of those before ends
        before = gen.tokenizer.decode(ids[:i]).rstrip("\ufffd")
        assert start == len(before)
    assert gen.token_strings([gen.eos_id]) == [gen.tokenizer.eos_token]


def _reference_logprobs(gen, ids: list[int]) -> torch.Tensor:
    """(T-1,) log-probability of each token after the first, from one no-cache float64 pass."""
    model64 = copy.deepcopy(gen.model).double()
    with torch.no_grad():
        logits_TV = model64(torch.tensor([ids])).logits[0]
    logprobs_TV = logits_TV.log_softmax(-1)
    return logprobs_TV[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0], logprobs_TV


def test_logprobs_of_prompt_and_completion_match_a_full_forward_pass(gen):
    """Echo scoring: prompt token logprobs (None for the first) and generated ones equal a
    float64 log-softmax over the whole vocabulary of one no-cache pass; alternatives are the
    top-k of that distribution; batched and padded rows score as they do alone."""
    prompts = [PROMPTS[0], PROMPTS[3], "Once"]
    outs = gen.generate(prompts, max_new_tokens=4, temperature=0, logprobs=3, prompt_logprobs=True)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = gen.encode(prompt) + out.token_ids
        expected, table_TV = _reference_logprobs(gen, ids)
        assert out.prompt_logprobs[0] is None
        entries = out.prompt_logprobs[1:] + out.logprobs
        assert [e.token_id for e in entries] == ids[1:]
        got = torch.tensor([e.logprob for e in entries], dtype=torch.float64)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for t, entry in enumerate(entries):
            top = table_TV[t].topk(3)
            assert [i for i, _ in entry.top] == top.indices.tolist()
            torch.testing.assert_close(
                torch.tensor([v for _, v in entry.top], dtype=torch.float64), top.values,
                atol=1e-5, rtol=1e-5,
            )  # fmt: skip
        # Greedy: the chosen token is the most likely one.
        assert all(e.token_id == e.top[0][0] for e in out.logprobs)
    alone = gen.generate(prompts[1], max_new_tokens=4, temperature=0, logprobs=3,
                         prompt_logprobs=True)[0]  # fmt: skip
    assert [e and e.logprob for e in alone.prompt_logprobs] == pytest.approx(
        [e and e.logprob for e in outs[1].prompt_logprobs], abs=1e-5
    )


def test_scoring_only_and_logit_bias(gen):
    """max_new_tokens=0 scores the prompt and generates nothing; logit_bias steers sampling but
    not the log-probabilities; bad ids and biases are refused with the reason."""
    [scored] = gen.generate(PROMPTS[0], max_new_tokens=0, prompt_logprobs=True, logprobs=0)
    assert (scored.text, scored.token_ids, scored.finish_reason) == ("", [], "length")
    assert len(scored.prompt_logprobs) == len(gen.encode(PROMPTS[0])) and scored.logprobs == []
    [plain] = gen.generate(PROMPTS[0], max_new_tokens=3, temperature=0, logprobs=0)
    [biased] = gen.generate(PROMPTS[0], max_new_tokens=3, temperature=0, logprobs=0,
                            logit_bias={7: 100.0})  # fmt: skip
    assert biased.token_ids == [7, 7, 7] and plain.token_ids != [7, 7, 7]
    assert biased.logprobs[0].logprob < plain.logprobs[0].logprob  # un-biased logprobs
    with pytest.raises(HLMError, match="vocabulary"):
        gen.generate("x", logit_bias={10**6: 1.0})
    with pytest.raises(HLMError, match="logit_bias"):
        gen.generate("x", logit_bias={1: 1000.0})
    with pytest.raises(HLMError, match="vocabulary"):
        gen.generate([[1, 2, 10**6]])
    ids = gen.encode(PROMPTS[3])  # a token-id prompt decodes as its text does
    assert gen.generate([ids], max_new_tokens=5, temperature=0)[0].text == (
        gen.generate(PROMPTS[3], max_new_tokens=5, temperature=0)[0].text
    )


def test_encode_through_the_rust_tokenizer_equals_the_tokenizer_call(gen):
    """`Generator.encode` calls the fast tokenizer's backend directly (no Python wrapping):
    the same ids as `tokenizer(text)` on plain, accented, CJK, emoji and whitespace text."""
    texts = ["The cat sat.", "  leading spaces\tand tabs\n", "déjà vu, naïve café",
             "東京は日本の首都です", "emoji 🙂👍🏽 mixed", "x" * 500]  # fmt: skip
    for text in texts:
        assert gen.encode(text) == gen.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert gen.encode("") == [gen.eos_id]
