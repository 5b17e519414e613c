"""`hlm serve --engine vllm`: vLLM through Ray Serve LLM, over real HTTP, behind the session's
proxy and its guard (`serve_common`). One application for the module: a raw headless decoder
(the session's tiny decoder marked headless, its token counts with it) served through its prior
readout, which is the harder path (the readout folded into vLLM's logit layer); a decoder with
a trained head is the same application without the fold. Plain-function tests of the served
folder, the key check and the flags are in test_serve_vllm_parts.py."""

from __future__ import annotations

import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from serve_common import API_KEY, AUTH, fuzz_bodies, header_flood, headless_copy, post

pytest.importorskip("vllm", reason="the vLLM engine is an optional install (make setup-vllm)")

PROMPTS = [f"{word} is a word that" for word in ("cat", "house", "river", "Paris", "green")]
ROUTE = "/vllm"
NAME = "tiny-headless"


@pytest.fixture(scope="module")
def headless_dir(serve_model_dir, tmp_path_factory) -> str:
    return str(
        headless_copy(serve_model_dir, tmp_path_factory.mktemp("vllm") / "headless" / "model")
    )


@pytest.fixture(scope="module")
def library(headless_dir):
    from hlm_ray.generate import Generator

    return Generator.load(headless_dir)  # its default readout: prior


@pytest.fixture(scope="module")
def vllm_server(serve_app, headless_dir):
    """The vLLM application at `{serve_app}/vllm`, checked every second by Serve (the engine
    test kills its engine); deleted after the module."""
    from ray import serve

    from hlm_ray.serve.vllm.app import VllmArgs, make_app

    args = VllmArgs(model=headless_dir, name=NAME, api_key=API_KEY)
    app = make_app(args, health_check_period_s=1.0)
    serve.run(app, name="hlm-vllm", route_prefix=ROUTE)
    try:
        yield f"{serve_app}{ROUTE}"
    finally:
        serve.delete("hlm-vllm")


@pytest.mark.ray
def test_completions_and_chat_through_the_openai_client_with_the_key(vllm_server, library):
    import openai

    client = openai.OpenAI(base_url=f"{vllm_server}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    [want] = library.generate(PROMPTS[0], max_new_tokens=8, temperature=0)
    plain = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert plain.choices[0].text == want.text
    stream = client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.text
    messages = [{"role": "user", "content": "What is a cat?"}]
    # The in-house chat layout (hlm_ray.serve.protocol.chat_prompt), in the served folder's
    # tokenizer as a template: the same prompt, so the same greedy reply's first tokens.
    [reply] = library.generate("User: What is a cat?\nAssistant:", max_new_tokens=6, temperature=0)
    chat = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.content == reply.text
    streamed = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == reply.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.ray
def test_every_route_needs_the_key(vllm_server):
    wrong = ["Bearer wrong", API_KEY, "Bearer ", f"Bearer {API_KEY[1:]}", f"Bearer {API_KEY}x"]
    paths = ["/v1/models", f"/v1/models/{NAME}", "/docs", "/openapi.json", "/tokenize",
             "/detokenize", "/v1/score", "/v1/embeddings", "/nothing"]  # fmt: skip
    for headers in [{}] + [{"Authorization": h} for h in wrong]:
        for method, path in [("GET", p) for p in paths] + [("POST", "/v1/completions"),
                                                             ("POST", "/v1/chat/completions")]:  # fmt: skip
            r = requests.request(method, f"{vllm_server}{path}", headers=headers, timeout=30)
            assert r.status_code == 401, (headers, method, path, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(f"{vllm_server}/v1/models", headers=AUTH, timeout=30).status_code == 200


@pytest.mark.ray
def test_the_prior_readout_gives_the_librarys_text_and_float32_logprobs(vllm_server, library):
    """Greedy text, the top logprobs of every generated token (after the readout) and the
    prompt's logprobs (echo: how a client scores text) are `hlm generate`'s with the prior
    readout, to 1e-4 in float32."""
    assert library.info["readout"] == "prior"
    body = {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "logprobs": 3,
            "echo": True}  # fmt: skip
    r = post(vllm_server, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    [want] = library.generate(
        PROMPTS[1], max_new_tokens=6, temperature=0, logprobs=3, prompt_logprobs=True
    )
    assert choice["text"] == PROMPTS[1] + want.text
    got = choice["logprobs"]["token_logprobs"][1:]
    expected = [e.logprob for e in want.prompt_logprobs[1:] + want.logprobs]
    assert got == pytest.approx(expected, abs=1e-4)
    # The generated tokens' top 3, ranked and valued as the library ranks them.
    tops = choice["logprobs"]["top_logprobs"][-len(want.logprobs) :]
    for top, entry in zip(tops, want.logprobs, strict=True):
        values = sorted(top.values(), reverse=True)[:3]
        assert values == pytest.approx([v for _, v in entry.top[:3]], abs=1e-4)


@pytest.mark.ray
def test_scoring_a_text_through_the_endpoint_gives_hlm_evals_nats(vllm_server, headless_dir):
    """`hlm eval --task bpb --readout prior` scores a text as one window after an end-of-text
    token; the endpoint's echoed log-probabilities of the same ids sum to the same nats."""
    from hlm_ray.evaluate.bpb import bits_per_byte
    from hlm_ray.pretrained import load_pretrained

    text = "The river runs past the old house, and the cat watches it from the green bank."
    pre = load_pretrained(headless_dir, kind="causal_lm", readout="prior")
    result = bits_per_byte(pre.model, pre.tokenizer, [text], progress=False)
    nats = result["nats_per_token"] * result["tokens"]
    ids = [pre.tokenizer.eos_token_id, *pre.tokenizer.encode(text, add_special_tokens=False)]
    r = post(vllm_server, {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0,
                           "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    scored = r.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)]
    assert -sum(scored) == pytest.approx(nats, rel=1e-5)


@pytest.mark.ray
def test_fuzz_never_gets_a_5xx_and_the_engine_stays_up(vllm_server):
    session = requests.Session()

    def send(body: bytes) -> int:
        headers = {**AUTH, "content-type": "application/json"}
        url = f"{vllm_server}/v1/completions"
        return session.post(url, data=body, headers=headers, timeout=60).status_code

    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(send, fuzz_bodies(seed=60, count=300)))
    counts = Counter(codes)
    assert not [c for c in codes if c >= 500], counts
    assert counts[200] > 20 and sum(n for c, n in counts.items() if 400 <= c < 500) > 20
    assert post(vllm_server, {"prompt": "still fine?", "max_tokens": 2}).status_code == 200


@pytest.mark.ray
def test_a_header_flood_leaves_keyed_requests_to_vllm_answered(vllm_server):
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    header_flood(vllm_server, lambda: post(vllm_server, body).status_code)


@pytest.mark.ray
def test_bad_input_gets_a_4xx(vllm_server):
    bad = [
        b"\xff\xfe not json",
        {"prompt": "x", "model": "gpt-4"},
        {"prompt": "x", "max_tokens": 10**30},
        {"prompt": [1, 2, 99999]},
        {"prompt": "word " * 200, "max_tokens": 16},
        {"prompt": "x", "temperature": -1},
        {"prompt": "x" * (1 << 20)},  # the proxy's guard: 413
    ]
    for body in bad:
        r = post(vllm_server, body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (
            body if isinstance(body, bytes) else str(body)[:80],
            r.text[:300],
        )
        assert "error" in r.json()


def _engine_core_pids() -> list[int]:
    import psutil

    return [
        p.pid
        for p in psutil.process_iter(["name", "cmdline"])
        if "EngineCore" in (p.info["name"] or "")
        or "EngineCore" in " ".join(p.info["cmdline"] or [])
    ]


@pytest.mark.ray
def test_an_engine_killed_mid_stream_ends_the_stream_and_the_replica_comes_back(vllm_server):
    """SIGKILL to vLLM's engine process while a completion streams: the client's stream ends
    (an error event or a closed connection, never a hang), Serve's health check finds the
    engine dead, a new replica starts its own engine, and the next request is served."""
    import os

    [engine] = _engine_core_pids()
    body = {"prompt": PROMPTS[2], "max_tokens": 100, "temperature": 1, "stream": True,
            "seed": 1}  # fmt: skip
    headers = {**AUTH, "content-type": "application/json"}
    chunks, ended = [], None
    with requests.post(f"{vllm_server}/v1/completions", json=body, headers=headers,
                       stream=True, timeout=60) as r:  # fmt: skip
        assert r.status_code == 200
        try:
            for i, line in enumerate(r.iter_lines()):
                chunks.append(line)
                if i == 2:
                    os.kill(engine, signal.SIGKILL)
            ended = "closed"
        except requests.exceptions.RequestException as err:
            ended = type(err).__name__
    assert ended is not None
    assert b"data: [DONE]" not in chunks[-1:] or any(b"error" in c for c in chunks), chunks[-3:]
    deadline, status = time.monotonic() + 300, None
    while time.monotonic() < deadline:
        try:
            r = requests.post(f"{vllm_server}/v1/completions", headers=AUTH, timeout=30,
                              json={"prompt": "back?", "max_tokens": 2})  # fmt: skip
            status = r.status_code
        except requests.exceptions.RequestException as err:
            status = type(err).__name__
        if status == 200:
            break
        time.sleep(2)
    assert status == 200, status
    assert _engine_core_pids() and engine not in _engine_core_pids()
