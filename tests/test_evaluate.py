"""hlm_ray.evaluate: LAMBADA as lm-eval scores it, bits per byte, synonyms, anisotropy, tasks."""

import copy
import gzip
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hlm_ray.config import ModelConfig
from hlm_ray.errors import HLMError
from hlm_ray.evaluate import (
    EVAL_TASKS,
    anisotropy,
    bits_per_byte,
    format_results,
    get_task,
    load_lambada,
    score_lambada,
    score_lambada_reference,
    synonym_pairs,
    synonym_similarity,
    write_result,
)
from hlm_ray.evaluate.bpb import default_bpb_texts
from hlm_ray.evaluate.lambada import encode_pair, make_requests
from hlm_ray.models import body, build_model, input_embedding_weight
from hlm_ray.paths import cache_dir, has_shared, shared_file
from hlm_ray.pretrained import Pretrained
from hlm_ray.tokenizer import load_tokenizer, special_tokens_for, train_bpe

needs_data = pytest.mark.skipif(
    not (has_shared("corpus/en") and has_shared("eval/lambada_openai.jsonl")),
    reason="needs the shared data folder (HLM_DATA_DIR)",
)
pytestmark = needs_data


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A 2048-token BPE on 200 KB of WikiText: big enough for ~190 single-token synonym pairs."""
    text = shared_file("corpus/en/wikitext2_raw_test.txt").read_text(encoding="utf-8")[:200_000]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HLM_CACHE_DIR", str(tmp_path_factory.mktemp("tok_cache")))
        folder = train_bpe([text], 2048, special_tokens_for("encoder"))
        return load_tokenizer(folder)


@pytest.fixture(scope="module")
def passages():
    return load_lambada(limit=20)


def tiny(tok, arch="gpt_neox", objective="vanilla", max_positions=256):
    """A random tiny model whose head is sharp enough for position bugs to change the scores."""
    cfg = ModelConfig(
        arch=arch, hidden_size=32, num_layers=2, num_heads=2, max_positions=max_positions
    )
    ids = {role: tok.convert_tokens_to_ids(t) for role, t in special_tokens_for("encoder").items()}
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=len(tok), objective=objective, special_ids=ids)
    with torch.no_grad():
        for p in (
            model.get_input_embeddings().weight,
            getattr(model.get_output_embeddings(), "weight", None),
        ):
            if p is not None:
                p.mul_(20)  # std 0.4: logits with a spread of a few nats
    return model.eval()


# ----------------------------------------------------------------------------- LAMBADA


class Oracle(nn.Module):
    """A fake causal LM that reads the input prefix and puts logit 30 on the token that follows
    it in one of `sequences` (on the token after that one for sequences listed in `wrong`)."""

    def __init__(self, sequences, vocab_size, wrong=()):
        super().__init__()
        self.vocab_size = vocab_size
        self.next_token = {}
        for s, seq in enumerate(sequences):
            for t in range(1, len(seq)):
                nxt = (seq[t] + 1) % vocab_size if s in wrong else seq[t]
                self.next_token[tuple(seq[:t])] = nxt
        self.anchor = nn.Parameter(torch.zeros(()))  # so .to() / .eval() behave

    def forward(self, input_ids, attention_mask=None):
        batch, length = input_ids.shape
        logits = torch.zeros(batch, length, self.vocab_size)
        for b in range(batch):
            row = input_ids[b].tolist()
            n = int(attention_mask[b].sum()) if attention_mask is not None else length
            for t in range(n):
                nxt = self.next_token.get(tuple(row[: t + 1]))
                if nxt is not None:
                    logits[b, t, nxt] = 30.0
        return SimpleNamespace(logits=logits)


def sequences_of(tok, examples):
    return [sum(encode_pair(tok, e["context"], e["continuation"]), []) for e in examples]


def test_oracle_that_knows_every_continuation_scores_accuracy_one(tok, passages):
    model = Oracle(sequences_of(tok, passages), len(tok))
    out = score_lambada(model, tok, passages, batch_size=6, progress=False)
    assert out["lambada/accuracy"] == 1.0
    assert out["lambada/num_examples"] == 20
    assert out["lambada/perplexity"] == pytest.approx(1.0, abs=1e-6)
    assert out["lambada/mean_continuation_tokens"] >= 1


def test_oracle_that_is_always_wrong_scores_zero(tok, passages):
    model = Oracle(sequences_of(tok, passages), len(tok), wrong=range(len(passages)))
    out = score_lambada(model, tok, passages, batch_size=6, progress=False)
    assert out["lambada/accuracy"] == 0.0
    # Each continuation token gets logprob -log(e^30 + V - 1): ppl = exp(mean tokens * that).
    per_token = 30 + math.log1p((len(tok) - 1) * math.exp(-30))
    expected = math.exp(out["lambada/mean_continuation_tokens"] * per_token)
    assert out["lambada/perplexity"] == pytest.approx(expected, rel=1e-5)


def test_batched_results_come_back_in_input_order(tok, passages):
    wrong = range(1, len(passages), 2)
    model = Oracle(sequences_of(tok, passages), len(tok), wrong=wrong)
    out = score_lambada(model, tok, passages, batch_size=7, progress=False, return_per_example=True)
    ref = score_lambada_reference(model, tok, passages, return_per_example=True)
    assert [g for _, g in out["per_example"]] == [i % 2 == 0 for i in range(len(passages))]
    assert out["lambada/accuracy"] == ref["lambada/accuracy"] == 0.5


@pytest.mark.parametrize(("max_positions", "batch_sizes"), [(256, (1, 3, 32)), (24, (4,))])
def test_batched_scorer_matches_the_one_at_a_time_reference(
    tok, passages, max_positions, batch_sizes
):
    model = tiny(tok, max_positions=max_positions).train()
    ref = score_lambada_reference(model, tok, passages, return_per_example=True)
    for batch_size in batch_sizes:
        out = score_lambada(
            model, tok, passages, batch_size=batch_size, progress=False, return_per_example=True
        )
        torch.testing.assert_close(
            torch.tensor([ll for ll, _ in out["per_example"]], dtype=torch.float64),
            torch.tensor([ll for ll, _ in ref["per_example"]], dtype=torch.float64),
            rtol=1e-4,
            atol=1e-4,
        )
        assert [g for _, g in out["per_example"]] == [g for _, g in ref["per_example"]]
        assert out["lambada/perplexity"] == pytest.approx(ref["lambada/perplexity"], rel=1e-4)
        assert out["lambada/accuracy"] == ref["lambada/accuracy"]
    assert model.training  # scoring switched to eval mode and back


def test_left_truncation_keeps_the_continuation(tok, passages):
    full = make_requests(tok, passages)
    cut = make_requests(tok, passages, max_length=24)
    assert any(len(r.tokens) > 25 for r in full)
    for a, b in zip(full, cut, strict=True):
        assert len(b.tokens) == min(len(a.tokens), 25)
        assert b.tokens == a.tokens[-len(b.tokens) :]  # the context lost its start, nothing else
        assert b.num_continuation == a.num_continuation


def test_encoding_is_lm_evals(tok):
    ctx, cont = encode_pair(tok, "He walked to the", "river")
    assert ctx == tok.encode("He walked to the", add_special_tokens=False)
    assert tok.decode(cont) == " river"
    # Trailing whitespace of the context moves into the continuation.
    ctx, cont = encode_pair(tok, "He walked to the ", "river")
    assert ctx == tok.encode("He walked to the", add_special_tokens=False)
    assert tok.decode(ctx + cont) == "He walked to the  river"


class Ramp(nn.Module):
    """A fake causal LM whose logits at input position t are `slope`·(t + 1) on token 0 and 0
    elsewhere: the log-likelihood of any other token there, -log(e^(slope·(t+1)) + V - 1),
    says which position scored it."""

    def __init__(self, vocab_size, slope=1.0):
        super().__init__()
        self.vocab_size, self.slope = vocab_size, slope
        self.anchor = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask=None):
        batch, length = input_ids.shape
        logits = torch.zeros(batch, length, self.vocab_size)
        logits[:, :, 0] = self.slope * torch.arange(1, length + 1, dtype=torch.float32)
        return SimpleNamespace(logits=logits)


def test_exactly_the_continuations_tokens_are_scored(tok, passages):
    """The scored tokens spell the final word, and each is scored at the input position that
    predicts it: one context token more (or a span shifted by one) changes every sum."""
    requests = make_requests(tok, passages)
    for passage, request in zip(passages, requests, strict=True):
        scored = request.tokens[-request.num_continuation :]
        assert tok.decode(scored).strip() == passage["continuation"]
        assert (
            tok.decode(request.tokens[: -request.num_continuation]).strip()
            == passage["context"].strip()
        )
        assert 0 not in scored  # Ramp's favourite token is never a target
    vocab = len(tok)
    expected = []
    for request in requests:
        n, c = len(request.tokens) - 1, request.num_continuation  # input length, scored tokens
        expected.append(sum(-math.log(math.exp(t + 1) + vocab - 1) for t in range(n - c, n)))
    model = Ramp(vocab)
    batched = score_lambada(model, tok, passages, batch_size=7, progress=False,
                            return_per_example=True)  # fmt: skip
    one_by_one = score_lambada_reference(model, tok, passages, return_per_example=True)
    for out in (batched, one_by_one):
        assert [ll for ll, _ in out["per_example"]] == pytest.approx(expected, rel=1e-5)
        assert out["lambada/accuracy"] == 0.0


def test_perplexity_past_the_largest_float_is_inf(tok, passages):
    """A model sure of a wrong token: every continuation token costs thousands of nats, so
    exp(-mean log-likelihood) is past the largest float; the perplexity is inf (no
    OverflowError), the accuracy still 0."""
    model = Ramp(len(tok), slope=1000.0)
    batched = score_lambada(model, tok, passages[:4], batch_size=4, progress=False)
    one_by_one = score_lambada_reference(model, tok, passages[:4])
    for out in (batched, one_by_one):
        assert out["lambada/perplexity"] == math.inf
        assert out["lambada/accuracy"] == 0.0


def test_bf16_model_scores_close_to_fp32(tok, passages):
    model = tiny(tok)
    fp32 = score_lambada(
        model, tok, passages, batch_size=8, progress=False, return_per_example=True
    )
    half = copy.deepcopy(model).to(torch.bfloat16)
    bf16 = score_lambada(half, tok, passages, batch_size=8, progress=False, return_per_example=True)
    lls32 = torch.tensor([ll for ll, _ in fp32["per_example"]])
    lls16 = torch.tensor([ll for ll, _ in bf16["per_example"]])
    torch.testing.assert_close(lls16, lls32, rtol=0.01, atol=0.1)
    assert bf16["lambada/perplexity"] == pytest.approx(fp32["lambada/perplexity"], rel=0.1)


def test_bad_lambada_files_name_the_line_and_field(tmp_path):
    path = tmp_path / "lambada.jsonl"
    good = json.dumps({"context": "a b", "continuation": "c"})
    path.write_text(good + "\n" + json.dumps({"context": "a b"}) + "\n")
    with pytest.raises(HLMError, match=r"line 2: missing or empty field 'continuation'"):
        load_lambada(path)
    path.write_text(good + "\n{not json\n")
    with pytest.raises(HLMError, match="line 2: not valid JSON"):
        load_lambada(path)
    path.write_text(good + "\n" + good + "\n")
    assert load_lambada(path, limit=1) == [{"context": "a b", "continuation": "c"}]
    # A limit reads no further: a bad line after it is never parsed.
    path.write_text(good + "\n{not json\n")
    assert load_lambada(path, limit=1) == [{"context": "a b", "continuation": "c"}]


def test_lambada_falls_back_to_the_hub_then_explains(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HLM_DATA_DIR", str(tmp_path))
    calls = []

    def fake(name, config, split, cache_dir):
        calls.append((name, config, split, cache_dir))
        return [{"text": "the cat sat on the mat"}, {"text": "one two"}]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert load_lambada() == [
        {"context": "the cat sat on the", "continuation": "mat"},
        {"context": "one", "continuation": "two"},
    ]
    # Cached in the project's cache folder like every other hub dataset.
    assert calls == [("EleutherAI/lambada_openai", "default", "test", str(cache_dir("datasets")))]

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(HLMError, match="set HLM_DATA_DIR"):
        load_lambada()


def test_lambada_files_and_limits_that_cannot_be_read_say_so_word_for_word(tmp_path):
    with pytest.raises(HLMError) as err:
        load_lambada(limit=0)
    assert str(err.value) == "limit=0 must be a positive number of passages (or None for all)"
    assert len(load_lambada(limit=1)) == 1
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(HLMError) as err:
        load_lambada(missing)
    assert str(err.value) == (
        f'no LAMBADA file at {missing}; pass a JSON-lines file with {{"context", "continuation"}} '
        "rows"
    )
    path = tmp_path / "lambada.jsonl"
    cases = [
        ('["a list"]\n', f"{path}, line 1: expected a JSON object with "
         '{"context": ..., "continuation": ...}, got [\'a list\']'),
        ('{"context": "a b", "continuation": ""}\n', f"{path}, line 1: missing or empty field "
         '\'continuation\' (each line must be {"context": ..., "continuation": ...})'),
        ("\n\n", f"{path} holds no LAMBADA passages"),
    ]  # fmt: skip
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(HLMError) as err:
            load_lambada(path)
        assert str(err.value) == message


def test_lambada_from_the_hub_takes_its_limit_and_names_itself_when_it_cannot(
    tmp_path, monkeypatch
):
    """No file in the data folder: the hub dataset, cut at `limit`; without the datasets
    package, or offline, one line that says what was looked for and where."""
    import sys

    import datasets

    monkeypatch.setenv("HLM_DATA_DIR", str(tmp_path))
    rows = [{"text": f"passage number {i}"} for i in range(5)]
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: rows)
    assert load_lambada(limit=2) == [
        {"context": "passage number", "continuation": "0"},
        {"context": "passage number", "continuation": "1"},
    ]
    assert len(load_lambada(limit=5)) == len(load_lambada()) == 5

    def offline(*args, **kwargs):
        raise ConnectionError("no network\nat all")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(HLMError) as err:
        load_lambada()
    assert str(err.value) == (
        f"LAMBADA: eval/lambada_openai.jsonl is not in the data folder {tmp_path} (HLM_DATA_DIR), "
        "which does not hold it, and the hub dataset EleutherAI/lambada_openai could not be "
        "loaded (no network); set HLM_DATA_DIR to the folder that holds it or pass a JSON-lines "
        "file"
    )
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(HLMError) as err:
        load_lambada()
    assert str(err.value) == (
        f"LAMBADA: eval/lambada_openai.jsonl is not in {tmp_path}, and EleutherAI/lambada_openai "
        "is a hub dataset: reading it needs the datasets package (pip install datasets); or pass "
        "a local file or folder"
    )


def test_lambada_encodes_the_texts_own_tokens_whatever_the_tokenizer_adds(tok, passages):
    adds_bos = TokenizerLike(tok)
    for passage in passages[:5]:
        pair = (passage["context"], passage["continuation"])
        assert encode_pair(adds_bos, *pair) == encode_pair(tok, *pair)


class Chars:
    """A tokenizer of characters that drops whitespace at the ends (so a continuation of spaces
    encodes to nothing)."""

    eos_token_id, pad_token_id = 0, None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text.strip()]


def test_lambada_continuations_that_cannot_be_scored_are_refused_by_passage():
    with pytest.raises(HLMError) as err:
        make_requests(Chars(), [{"context": "a b", "continuation": "c"},
                                {"context": "a b", "continuation": " "}])  # fmt: skip
    assert str(err.value) == "LAMBADA passage 1: the continuation encodes to no tokens"
    example = [{"context": "ab", "continuation": "xyz"}]  # continuation " xyz": 4 tokens
    [request] = make_requests(Chars(), example, max_length=4)  # as long as the model: scored
    assert request.num_continuation == 4 and len(request.tokens) == 5
    with pytest.raises(HLMError) as err:
        make_requests(Chars(), example, max_length=3)
    assert str(err.value) == (
        "LAMBADA passage 0: its continuation has 4 tokens, more than the model's 3 positions"
    )


class KeepsLastLogits(Ramp):
    """Ramp with Hugging Face's `logits_to_keep`: the logits of the last k positions only;
    records each k it is given."""

    def __init__(self, vocab_size):
        super().__init__(vocab_size)
        self.kept = []

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        self.kept.append(logits_to_keep)
        logits = super().forward(input_ids, attention_mask).logits
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


class Unsignable:
    """A forward whose signature cannot be read (inspect raises): given no logits_to_keep."""

    __signature__ = "not a signature"

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, attention_mask=None):
        return self.model(input_ids, attention_mask)


def test_lambada_asks_only_for_the_logits_it_scores(tok, passages):
    """A model that takes `logits_to_keep` is asked for the positions from the batch's
    earliest scored one on (input width minus that position), and scores as if it returned
    them all; a forward whose signature cannot be read is not asked."""
    from hlm_ray.evaluate.lambada import _takes_logits_to_keep

    model = KeepsLastLogits(len(tok))
    expected = score_lambada_reference(Ramp(len(tok)), tok, passages, return_per_example=True)
    out = score_lambada(model, tok, passages, batch_size=7, progress=False,
                        return_per_example=True)  # fmt: skip
    assert out == pytest.approx(expected, rel=1e-6)
    requests = make_requests(tok, passages)
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens))
    wanted = []
    for start in range(0, len(order), 7):
        batch = [requests[i] for i in order[start : start + 7]]
        width = max(len(r.tokens) - 1 for r in batch)
        wanted.append(width - min(len(r.tokens) - 1 - r.num_continuation for r in batch))
    assert model.kept == wanted and all(0 < k < 200 for k in wanted)
    assert _takes_logits_to_keep(model) and not _takes_logits_to_keep(Ramp(len(tok)))
    plain = Ramp(len(tok))
    plain.forward = Unsignable(Ramp(len(tok)).forward)
    assert not _takes_logits_to_keep(plain)
    out = score_lambada(plain, tok, passages[:3], progress=False, return_per_example=True)
    assert out["per_example"] == pytest.approx(expected["per_example"][:3], rel=1e-6)


def test_lambada_scoring_says_what_is_wrong_shows_progress_and_adds_rows_on_request(
    tok, passages, capsys
):
    model = Ramp(len(tok))
    for kwargs, message in [
        (dict(examples=passages, batch_size=0), "batch_size=0 must be at least 1"),
        (dict(examples=[]), "no LAMBADA passages to score"),
    ]:
        with pytest.raises(HLMError) as err:
            score_lambada(model, tok, progress=False, **kwargs)
        assert str(err.value) == message
    out = score_lambada(model, tok, passages[:5], batch_size=2)
    err = capsys.readouterr().err
    assert err.lstrip("\r").startswith("lambada: ") and "3/3" in err
    assert "batch/s" in err or "s/batch" in err
    assert "per_example" not in out
    assert "per_example" not in score_lambada_reference(model, tok, passages[:5])
    no_pad = TokenizerLike(tok, pad=False)
    again = score_lambada(model, no_pad, passages[:5], batch_size=2, progress=False)
    assert again == out and capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- bits per byte


def hand_bpb(model, tok, texts, window):
    """Every token scored on its own forward pass over the tokens of its window before it."""
    nats, nbytes = 0.0, 0
    with torch.no_grad():
        for text in texts:
            stream = [tok.eos_token_id, *tok.encode(text, add_special_tokens=False)]
            for k in range(1, len(stream)):
                context = stream[((k - 1) // window) * window : k]
                logits = model(input_ids=torch.tensor([context])).logits[0, -1].double()
                nats -= logits.log_softmax(-1)[stream[k]].item()
            nbytes += len(text.encode("utf-8"))
    return nats / math.log(2) / nbytes


@pytest.mark.parametrize("seq_len", [None, 5])
def test_bits_per_byte_equals_a_hand_computation(tok, seq_len):
    model = tiny(tok, max_positions=64)
    texts = ["The river bank was quiet that night.", "Café 東京, naïve façade!", "Ok."]
    out = bits_per_byte(model, tok, texts, batch_size=2, seq_len=seq_len, progress=False)
    assert out["bpb"] == pytest.approx(hand_bpb(model, tok, texts, seq_len or 64), rel=1e-4)
    assert out["bytes"] == sum(len(t.encode()) for t in texts)
    assert out["tokens"] == sum(len(tok.encode(t, add_special_tokens=False)) for t in texts)
    assert out["documents"] == 3
    assert out["nats_per_token"] == pytest.approx(
        out["bpb"] * math.log(2) * out["bytes"] / out["tokens"]
    )


def test_bits_per_byte_refuses_an_encoder(tok):
    model = tiny(tok, arch="bert")
    with pytest.raises(HLMError) as err:
        bits_per_byte(model, tok, ["some text"], progress=False)
    name = type(model).__name__
    assert str(err.value) == f"bits per byte needs a decoder with a head; {name} is an encoder"


class TokenizerLike:
    """`tok` seen through a tokenizer that adds a BOS token unless told not to (as Llama's
    does), and perhaps has no pad token: the text's own tokens are what is scored."""

    def __init__(self, tok, pad=True):
        self.tok, self.eos_token_id = tok, tok.eos_token_id
        self.pad_token_id = tok.pad_token_id if pad else None

    def encode(self, text, add_special_tokens=True):
        ids = self.tok.encode(text, add_special_tokens=False)
        return [self.tok.bos_token_id or 0, *ids] if add_special_tokens else ids


class NoConfigLM(nn.Module):
    """A causal LM without a Hugging Face config (no positions to read): a bigram table."""

    def __init__(self, vocab_size):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(vocab_size, vocab_size)

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.table(input_ids))


LONG_TEXT = " ".join(["The river bank was quiet that night, and the boats slept."] * 12)


def test_bits_per_byte_windows_default_to_the_models_positions(tok):
    """No seq_len: the window is the model's positions (a text of ~150 tokens on a 64-position
    model is cut, not fed whole); a seq_len equal to them is allowed, one past them is not; a
    model without a config (no positions) scores in windows of 1,024."""
    model = tiny(tok, max_positions=64)
    assert len(tok.encode(LONG_TEXT, add_special_tokens=False)) > 2 * 64
    out = bits_per_byte(model, tok, [LONG_TEXT, "Ok."], progress=False)
    assert out["bpb"] == pytest.approx(hand_bpb(model, tok, [LONG_TEXT, "Ok."], 64), rel=1e-4)
    at_limit = bits_per_byte(model, tok, [LONG_TEXT], seq_len=64, progress=False)
    assert at_limit["bpb"] == pytest.approx(hand_bpb(model, tok, [LONG_TEXT], 64), rel=1e-4)
    with pytest.raises(HLMError) as err:
        bits_per_byte(model, tok, [LONG_TEXT], seq_len=65, progress=False)
    assert str(err.value) == "seq_len=65 exceeds the model's 64 positions"
    bigram = NoConfigLM(len(tok))
    out = bits_per_byte(bigram, tok, [LONG_TEXT], progress=False)
    assert out["bpb"] == pytest.approx(hand_bpb(bigram, tok, [LONG_TEXT], 1024), rel=1e-4)


def test_bits_per_byte_scores_the_texts_own_tokens_whatever_the_tokenizer_adds(tok):
    """A tokenizer that adds a BOS of its own, or has no pad token: the same score, batched
    or one window at a time."""
    model = tiny(tok, max_positions=64)
    texts = ["The river bank was quiet that night.", "Ok.", LONG_TEXT]
    expected = bits_per_byte(model, tok, texts, batch_size=2, progress=False)
    for tokenizer in (TokenizerLike(tok), TokenizerLike(tok, pad=False)):
        for batch_size in (1, 2):
            out = bits_per_byte(model, tokenizer, texts, batch_size=batch_size, progress=False)
            assert out == pytest.approx(expected, rel=1e-5), (tokenizer.pad_token_id, batch_size)


def test_bits_per_byte_says_what_is_wrong_with_its_input(tok):
    model = tiny(tok, max_positions=64)
    cases = [
        (dict(texts=["x"], batch_size=0), "batch_size=0 must be at least 1"),
        (dict(texts=["", ""]), "bits per byte needs at least one non-empty text"),
    ]
    for kwargs, message in cases:
        with pytest.raises(HLMError) as err:
            bits_per_byte(model, tok, progress=False, **kwargs)
        assert str(err.value) == message
    no_eos = SimpleNamespace(eos_token_id=None, pad_token_id=0)
    with pytest.raises(HLMError) as err:
        bits_per_byte(model, no_eos, ["x"], progress=False)
    assert str(err.value) == "bits per byte needs a tokenizer with an end-of-text (eos) token"


def test_bits_per_byte_shows_its_progress_unless_told_not_to(tok, capsys):
    model = tiny(tok, max_positions=64)
    bits_per_byte(model, tok, ["One.", "Two.", "Three."], batch_size=2)
    err = capsys.readouterr().err
    assert err.lstrip("\r").startswith("bits per byte: ") and "2/2" in err
    assert "batch/s" in err or "s/batch" in err
    bits_per_byte(model, tok, ["One.", "Two.", "Three."], batch_size=2, progress=False)
    assert capsys.readouterr().err == ""


def test_bits_per_byte_default_texts_are_the_lambada_passages():
    examples = load_lambada(limit=3)
    texts = default_bpb_texts(limit=3)
    assert texts == [f"{e['context']} {e['continuation']}" for e in examples]
    assert len(default_bpb_texts(limit=None)) == len(load_lambada(limit=None)) > 3


@pytest.mark.parametrize(
    "class_name, family, decoder",
    [
        ("GPTNeoXForCausalLM", None, True),  # no hlm_family: the class name says
        ("GPT2LMHeadModel", None, True),
        ("BertForMaskedLM", None, False),
        ("GPTNeoXForCausalLM", "encoder", False),  # hlm_family wins over the class name
        ("BertForMaskedLM", "decoder", True),
    ],
)
def test_bits_per_byte_knows_a_decoder_by_its_family_else_its_class(class_name, family, decoder):
    from hlm_ray.evaluate.bpb import require_decoder

    config = SimpleNamespace() if family is None else SimpleNamespace(hlm_family=family)
    model = type(class_name, (), {"config": config})()
    if decoder:
        require_decoder(model, "this task")
    else:
        with pytest.raises(HLMError) as err:
            require_decoder(model, "this task")
        assert (
            str(err.value) == f"this task needs a decoder with a head; {class_name} is an encoder"
        )
    require_decoder(object(), "this task")  # no config at all: nothing to tell it by


# ----------------------------------------------------------------------------- synonyms


def write_pairs(path: Path, rows):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("word1\tword2\tpos\tsynset_offset\n")
        for a, b in rows:
            f.write(f"{a}\t{b}\tn\t00000001\n")
    return path


def test_synonym_pairs_keep_distinct_single_tokens_once(tok, tmp_path):
    the, and_ = (tok.encode(" " + w, add_special_tokens=False) for w in ("the", "and"))
    assert len(the) == len(and_) == 1
    assert len(tok.encode(" xqzvkjw", add_special_tokens=False)) > 1
    rows = [("the", "and"), ("and", "the"), ("the", "the"), ("the", "xqzvkjw")]
    pairs, words = synonym_pairs(tok, write_pairs(tmp_path / "p.tsv.gz", rows))
    assert pairs == [tuple(sorted((the[0], and_[0])))]
    assert words == ["and", "the"]


def test_synonym_file_missing_says_where(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("HLM_DATA_DIR", str(tmp_path))
    with pytest.raises(HLMError, match="HLM_DATA_DIR.*no hub fallback.*word1 and word2"):
        synonym_pairs(tok)


def test_too_few_pairs_is_an_error(tok, tmp_path):
    path = write_pairs(tmp_path / "p.tsv.gz", [("the", "and"), ("of", "in")])
    with pytest.raises(HLMError, match="only 2 WordNet synonym pairs"):
        synonym_similarity(tiny(tok), tok, path=path)


def direct_synonym_cosines(model, tok) -> tuple[float, float, float]:
    """In float64, straight from the pairs: the synonyms' mean cosine, and the mean and the
    standard deviation of the cosine over every pair of distinct words they use."""
    pairs, _ = synonym_pairs(tok)
    emb_VD = input_embedding_weight(model).detach().double()
    mean = sum(
        torch.nn.functional.cosine_similarity(emb_VD[a], emb_VD[b], dim=0).item() for a, b in pairs
    ) / len(pairs)
    words = sorted({i for pair in pairs for i in pair})
    unit_WD = torch.nn.functional.normalize(emb_VD[words], dim=-1)
    cos_WW = unit_WD @ unit_WD.T
    others = cos_WW[~torch.eye(len(words), dtype=torch.bool)]
    return mean, others.mean().item(), others.std().item()


def test_synonym_similarity_runs_and_plots(tok, tmp_path):
    model = tiny(tok)
    out = synonym_similarity(model, tok, num_random=2000, plot_path=tmp_path / "syn.png")
    assert out["synonyms/num_pairs"] == len(synonym_pairs(tok)[0]) >= 100
    mean, random_mean, random_sd = direct_synonym_cosines(model, tok)
    assert out["synonyms/mean_cos"] == pytest.approx(mean, abs=1e-6)
    # 2000 random pairs of those words: their mean within 5 standard errors of the exact one.
    assert abs(out["synonyms/random_mean_cos"] - random_mean) < 5 * random_sd / 2000**0.5
    assert out["synonyms/gap"] == pytest.approx(
        out["synonyms/mean_cos"] - out["synonyms/random_mean_cos"]
    )
    assert (tmp_path / "syn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_synonyms_with_identical_embeddings_score_one(tok):
    model = tiny(tok)
    pairs, _ = synonym_pairs(tok)
    parent = {}  # union-find: every word of a synonym chain gets the same vector

    def root(i):
        while parent.setdefault(i, i) != i:
            i = parent[i]
        return i

    for a, b in pairs:
        parent[root(a)] = root(b)
    weight = input_embedding_weight(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        vectors = {}
        for i in parent:
            r = root(i)
            if r not in vectors:
                vectors[r] = torch.randn(weight.shape[1], generator=gen)
            weight[i] = vectors[r]
    out = synonym_similarity(model, tok)
    assert out["synonyms/mean_cos"] == pytest.approx(1.0, abs=1e-5)
    assert out["synonyms/random_mean_cos"] < 0.5


# ----------------------------------------------------------------------------- anisotropy


def exact_anisotropy(model, tok, texts):
    """Mean cosine over all pairs i != j of the unpadded tokens, per layer (one text a pass)."""
    per_layer = None
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
            states = body(model)(input_ids=ids, output_hidden_states=True).hidden_states
            rows = [s[0] for s in states]
            per_layer = (
                rows
                if per_layer is None
                else [torch.cat(p) for p in zip(per_layer, rows, strict=True)]
            )
    out = []
    for states_ND in per_layer:
        unit = torch.nn.functional.normalize(states_ND.double(), dim=-1)
        n = unit.shape[0]
        out.append(((unit.sum(0).square().sum() - n) / (n * (n - 1))).item())
    return out


@pytest.mark.parametrize(
    ("arch", "objective"),
    [
        ("gpt_neox", "vanilla"),
        ("gpt2", "headless"),
        ("bert", "headless"),
        ("distilbert", "vanilla"),
    ],
)
def test_anisotropy_matches_the_all_pairs_mean(tok, arch, objective, tmp_path):
    model = tiny(tok, arch=arch, objective=objective, max_positions=64)
    texts = [
        "The river bank was quiet that night, and the boats were still.",
        "A short one.",
        "Then three more words",
    ]
    out = anisotropy(
        model, tok, texts, num_pairs=40_000, batch_size=2, plot_path=tmp_path / "a.png"
    )
    exact = exact_anisotropy(model, tok, texts)
    assert [k for k in out if "/layer_" in k] == [f"anisotropy/layer_{i}" for i in range(3)]
    for layer, value in enumerate(exact):
        assert -1 <= out[f"anisotropy/layer_{layer}"] <= 1
        assert out[f"anisotropy/layer_{layer}"] == pytest.approx(value, abs=0.01)
    assert out["anisotropy/mean"] == pytest.approx(sum(exact) / 3, abs=0.01)
    assert (tmp_path / "a.png").is_file()


@pytest.mark.parametrize("arch", ["gpt_neox", "bert"])
def test_anisotropy_is_one_when_every_token_looks_the_same(tok, arch):
    model = tiny(tok, arch=arch, objective="headless")
    with torch.no_grad():
        weight = input_embedding_weight(model)
        weight.copy_(torch.randn(weight.shape[1]).expand_as(weight))
        for name, param in body(model).embeddings.named_parameters() if arch == "bert" else []:
            if "position" in name or "token_type" in name:
                param.zero_()
    texts = [p["context"] for p in load_lambada(limit=3)]
    out = anisotropy(model, tok, texts, num_pairs=2000)
    for key, value in out.items():
        if key.startswith("anisotropy/layer_"):
            assert value == pytest.approx(1.0, abs=1e-5), key


# ----------------------------------------------------------------------------- tasks


def pretrained(model, tok, family, objective, tmp_path, finetuned=None):
    return Pretrained(
        model=model,
        tokenizer=tok,
        family=family,
        objective=objective,
        finetuned=finetuned,
        path=tmp_path,
        run_config=None,
        source="tiny-" + objective,
    )


def test_tasks_run_write_and_format(tok, tmp_path):
    pre = pretrained(tiny(tok, objective="headless"), tok, "decoder", "headless", tmp_path)
    results = [
        get_task(name)(
            pre, output_dir=tmp_path, limit=4, batch_size=4, device="cpu", progress=False
        )
        for name in ("lambada", "bpb")
    ]
    for result in results:
        assert result["note"] == "raw Eᵀ head: headless decoder not fine-tuned"
        assert result["model"] == "tiny-headless" and result["seconds"] >= 0
        saved = json.loads(write_result(result, tmp_path).read_text())
        assert saved["metrics"] == result["metrics"]
    assert results[0]["metrics"]["lambada/num_examples"] == 4
    table = format_results(results)
    assert "| model | task | lambada/accuracy |" in table
    assert "| tiny-headless [1] | bpb |" in table
    assert "[1] raw Eᵀ head" in table


def test_embedding_tasks_write_their_figures(tok, tmp_path):
    model = tiny(tok)
    pre = pretrained(model, tok, "decoder", "headless", tmp_path, finetuned="clm")
    for name in ("synonyms", "anisotropy", "lambada"):
        result = get_task(name)(
            pre, output_dir=tmp_path, limit=2, batch_size=2, device="cpu", progress=False
        )
        assert "note" not in result  # fine-tuned: a real head
        assert all(Path(f).is_file() for f in result["figures"])
        assert len(result["figures"]) == (name != "lambada")
        if name == "synonyms":  # `hlm eval --task synonyms`: the pairs' own mean cosine
            mean, _, _ = direct_synonym_cosines(model, tok)
            assert result["metrics"]["synonyms/mean_cos"] == pytest.approx(mean, abs=1e-6)


def test_decoder_tasks_refuse_an_encoder(tok, tmp_path):
    pre = pretrained(
        tiny(tok, arch="bert", objective="headless"), tok, "encoder", "headless", tmp_path
    )
    with pytest.raises(HLMError, match="lambada needs a decoder"):
        EVAL_TASKS["lambada"](
            pre, output_dir=tmp_path, limit=2, batch_size=2, device="cpu", progress=False
        )


def test_unknown_task_lists_the_tasks():
    with pytest.raises(HLMError, match="lambada, bpb, synonyms, anisotropy"):
        get_task("hellaswag")


# ----------------------------------------------------------------------------- context length


def test_trained_context_length_reads_the_run_config_else_the_positions(tok, tmp_path, caplog):
    from hlm_ray.config import Config, apply_overrides
    from hlm_ray.evaluate.common import trained_context_length

    model = tiny(tok, max_positions=256)
    model.save_pretrained(tmp_path / "run" / "model")
    tok.save_pretrained(tmp_path / "run" / "model")
    # No config.yaml beside it: not trained by hlm, so the model's own positions, logged.
    with caplog.at_level("WARNING", logger="hlm_ray.evaluate.common"):
        assert trained_context_length(tmp_path / "run" / "model") == 256
    assert "using its 256 positions" in caplog.text
    cfg = apply_overrides(Config(), {"data.seq_len": 24, "model.max_positions": 256})
    cfg.save(tmp_path / "run" / "config.yaml")
    assert trained_context_length(tmp_path / "run") == 24  # a run folder resolves to its model
    assert trained_context_length(tmp_path / "run" / "model") == 24


def test_decoder_tasks_score_at_the_trained_length_and_record_it(tok, tmp_path, passages):
    from hlm_ray.config import Config, apply_overrides

    model = tiny(tok, max_positions=256)
    run_cfg = apply_overrides(Config(), {"data.seq_len": 16, "model.max_positions": 256})
    pre = pretrained(model, tok, "decoder", "vanilla", tmp_path)
    pre.run_config = run_cfg
    lam = get_task("lambada")(
        pre, output_dir=tmp_path, limit=20, batch_size=4, device="cpu", progress=False
    )
    assert lam["metrics"]["eval/context_length"] == 16
    assert lam["context_length_source"] == "data.seq_len of its training run"
    # Hand reference: every passage's input is its last 16 tokens (lm-eval's rule at 16).
    ref = score_lambada_reference(model, tok, passages, max_length=16)
    full = score_lambada_reference(model, tok, passages)  # at the model's 256 positions
    assert lam["metrics"]["lambada/perplexity"] == pytest.approx(ref["lambada/perplexity"], 1e-4)
    assert ref["lambada/perplexity"] != pytest.approx(full["lambada/perplexity"], rel=1e-3)
    texts = [p["context"] + " " + p["continuation"] for p in passages[:4]]
    bpb = get_task("bpb")(
        pre, output_dir=tmp_path, limit=4, batch_size=4, device="cpu", progress=False
    )
    assert bpb["metrics"]["eval/context_length"] == 16
    assert bpb["metrics"]["bpb/bits_per_byte"] == pytest.approx(
        hand_bpb(model, tok, texts, 16), rel=1e-4
    )


def test_the_task_names_checked_before_torch_are_the_tasks():
    """`hlm eval` checks --task against `harness.TASKS` before it imports torch."""
    from hlm_ray.evaluate.harness import TASKS

    assert tuple(EVAL_TASKS) == TASKS
