"""The whole completions API against the session's Serve application (tests/serve_common.py):
echo and logprobs as OpenAI and vLLM return them, token-id prompts, logit_bias, best_of, chat
completions (streamed too), GET /v1/models/{id}, error codes; and lm-eval's
`local-completions` scoring LAMBADA through the endpoint exactly as HFLM scores the folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import requests
from serve_common import API_KEY, AUTH, post

from hlm_ray.generate import Generator
from hlm_ray.paths import data_dir
from hlm_ray.serve.protocol import CHAT_STOPS, chat_prompt
from hlm_ray.serve.schemas import ChatMessage

PROMPT = "The river is a word that"

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.ray]


@pytest.fixture(scope="module")
def library(serve_model_dir) -> Generator:
    return Generator.load(serve_model_dir)


@pytest.fixture(scope="module")
def client(serve_app):
    import openai

    return openai.OpenAI(base_url=f"{serve_app}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def name(serve_model_uri) -> str:
    return serve_model_uri.removeprefix("models:/")


def test_openai_client_echo_with_logprobs(client, name, library):
    """OpenAI's shape: with echo the prompt's tokens come first (the first with None), every
    token has its top-k (the chosen one included), offsets index the echoed text, and the
    numbers equal the library's scoring (one forward pass over the prompt)."""
    out = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    [choice] = out.choices
    lp = choice.logprobs
    ids = library.encode(PROMPT)
    [ref] = library.generate(PROMPT, max_new_tokens=3, temperature=0, logprobs=2,
                             prompt_logprobs=True)  # fmt: skip
    assert choice.text == PROMPT + ref.text
    assert len(lp.tokens) == len(ids) + ref.completion_tokens == len(lp.token_logprobs)
    assert lp.tokens == library.token_strings(ids + [e.token_id for e in ref.logprobs])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [e.logprob for e in ref.prompt_logprobs[1:] + ref.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:],
                                 strict=True):  # fmt: skip
        assert top[token] == pytest.approx(value) and 2 <= len(top) <= 3
        assert all(v <= max(top.values()) for v in top.values())
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        if not token.startswith("bytes:"):
            assert choice.text[offset : offset + len(token)] == token
    assert out.usage.prompt_tokens == len(ids)


def test_scoring_request_as_lm_eval_sends_it(serve_app, library):
    """Token-id prompts, `max_tokens: 0` and 1, `echo`, `logprobs: 1`: the prompt's scores are
    the same either way, and max_tokens=1 adds exactly one entry (lm-eval drops it)."""
    ids = [library.encode(PROMPT), library.encode("Paris is")]
    base = {"prompt": ids, "echo": True, "logprobs": 1, "temperature": 0, "seed": 1234}
    zero = post(serve_app, {**base, "max_tokens": 0})
    one = post(serve_app, {**base, "max_tokens": 1})
    assert zero.status_code == 200 and one.status_code == 200, zero.text + one.text
    for row, c0, c1 in zip(ids, zero.json()["choices"], one.json()["choices"], strict=True):
        assert len(c0["logprobs"]["token_logprobs"]) == len(row)
        assert len(c1["logprobs"]["token_logprobs"]) == len(row) + 1
        assert c1["logprobs"]["token_logprobs"][:-1] == pytest.approx(
            c0["logprobs"]["token_logprobs"], abs=1e-6
        )
        assert c0["text"] == library.tokenizer.decode(row)


def test_logit_bias_best_of_and_text_prompts(serve_app, library):
    biased = post(serve_app, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                              "logit_bias": {"7": 100}, "best_of": 1}).json()  # fmt: skip
    assert biased["choices"][0]["text"] == library.tokenizer.decode([7, 7, 7])
    r = post(serve_app, {"prompt": PROMPT, "max_tokens": 2, "n": 2, "best_of": 2, "seed": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_chat_completion_and_its_stream(client, name, library):
    """The documented template, the reply cut at the next turn; the stream is OpenAI's
    `chat.completion.chunk`s (role first, then content) and concatenates to the reply."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = client.chat.completions.create(model=name, messages=messages, max_tokens=12,
                                         temperature=0)  # fmt: skip
    prompt = chat_prompt([ChatMessage(**m) for m in messages])
    assert prompt == "System: Be brief.\nUser: Hi!\nAssistant:"
    [ref] = library.generate(prompt, max_new_tokens=12, temperature=0, stop=list(CHAT_STOPS))
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text.removeprefix(" ")
    assert out.choices[0].finish_reason == ref.finish_reason
    chunks = list(client.chat.completions.create(
        model=name, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_model_card_and_error_codes(serve_app, name, client):
    import openai

    card = requests.get(f"{serve_app}/v1/models/{name}", headers=AUTH, timeout=30)
    assert card.status_code == 200 and card.json()["id"] == name
    assert "Assistant:" in card.json()["chat_template"]
    assert client.models.retrieve(name).id == name
    cases = [
        ("GET", "/v1/models/gpt-4", None, 404, "model_not_found"),
        ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model_not_found"),
        ("POST", "/v1/chat/completions", {"messages": [], "model": name}, 422, "invalid_value"),
        ("POST", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "unsupported_parameter"),
        ("GET", "/v1/nothing", None, 404, "unknown_url"),
        ("GET", "/v1/chat/completions", None, 405, "method_not_allowed"),
    ]
    for method, path, body, status, code in cases:
        r = requests.request(method, f"{serve_app}{path}", json=body, headers=AUTH, timeout=30)
        assert r.status_code == status, (path, r.text)
        assert r.json()["error"]["code"] == code, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


# ----------------------------------------------------------------------------- lm-eval


def lambada_task_dir(root: Path, data_file: Path, name: str = "lambada_hlm") -> Path:
    """An offline LAMBADA task for lm-eval (`include_path`): lambada_openai's prompt and
    metrics over the shared JSONL (fields `context`, `continuation`)."""
    folder = root / "lm_eval_tasks"
    folder.mkdir(parents=True, exist_ok=True)
    spec = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "output_type": "loglikelihood",
        "test_split": "test",
        "doc_to_text": "{{context}}",
        "doc_to_target": "{{' ' + continuation}}",
        "metric_list": [
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0},
    }
    (folder / f"{name}.yaml").write_text(json.dumps(spec, indent=1))  # JSON is YAML
    return folder


@pytest.mark.slow
def test_lm_eval_local_completions_scores_like_hflm(serve_app, serve_model_dir, name, tmp_path,
                                                    monkeypatch):  # fmt: skip
    """lm-eval's `local-completions` through the endpoint (token-id prompts, echo, logprobs)
    gives HFLM's LAMBADA perplexity and accuracy on the folder. Windows match: HFLM with
    max_length=126 scores the last 127 tokens, as local-completions does with max_length=128
    (it keeps max_length - 1 tokens, plus the one token it asks for: the model's 128)."""
    pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api] (tenacity)")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = TaskManager(include_path=str(lambada_task_dir(
        tmp_path, data_dir() / "eval" / "lambada_openai.jsonl")))  # fmt: skip
    common = {"tasks": ["lambada_hlm"], "task_manager": tasks, "limit": 20, "batch_size": 1}
    hf = simple_evaluate(model="hf", model_args={"pretrained": serve_model_dir,
                         "max_length": 126, "device": "cpu"}, **common)  # fmt: skip
    api = simple_evaluate(
        model="local-completions",
        model_args={
            "model": name,
            "base_url": f"{serve_app}/v1/completions",
            "tokenizer": serve_model_dir,
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "max_length": 128,
        },  # fmt: skip
        **common,
    )
    hf_res, api_res = hf["results"]["lambada_hlm"], api["results"]["lambada_hlm"]
    print(f"perplexity HFLM {hf_res['perplexity,none']:.4f} endpoint "
          f"{api_res['perplexity,none']:.4f}")  # fmt: skip
    assert math.isfinite(hf_res["perplexity,none"]) and hf_res["perplexity,none"] > 1
    assert api_res["perplexity,none"] == pytest.approx(hf_res["perplexity,none"], rel=1e-3)
    assert api_res["acc,none"] == hf_res["acc,none"]
