"""The completions server over real HTTP on localhost: one Serve application for the module
(a tiny decoder registered in MLflow and served as `models:/...`), plus a small one with a
queue limit of 1 for the overload test. Library-level generation is tested in test_generate.py."""

from __future__ import annotations

import argparse
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from hlm_ray.errors import HLMError
from hlm_ray.generate import Generator
from hlm_ray.serve.app import build_app, make_app
from hlm_ray.serve.schemas import AppArgs

MODEL_NAME = "hlm-test-generator"
PROMPTS = [f"{word} is a word that" for word in ("cat", "house", "river", "Paris", "green")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_decoder_dir) -> str:
    return tiny_decoder_dir


@pytest.fixture(scope="module")
def model_uri(model_dir) -> str:
    """The tiny decoder registered in the session's MLflow store."""
    from hlm_ray.tracking import register_model

    name, version = register_model(model_dir, MODEL_NAME)
    return f"models:/{name}/{version}"


@pytest.fixture(scope="module")
def library(model_dir) -> Generator:
    return Generator.load(model_dir)


@pytest.fixture(scope="module")
def server(ray_cluster, model_uri):
    """The application under test at http://127.0.0.1:<port>, serving `models:/...`."""
    from ray import serve

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = AppArgs(model=model_uri, max_batch_size=16, batch_wait_timeout_s=0.05, max_n=3)
    try:
        serve.run(make_app(args, num_cpus=0.5), name="hlm-test", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def _post(server: str, body, **kwargs) -> requests.Response:
    if isinstance(body, bytes | str):
        return requests.post(f"{server}/v1/completions", data=body, timeout=60, **kwargs)
    return requests.post(f"{server}/v1/completions", json=body, timeout=60, **kwargs)


def _served_name(model_uri: str) -> str:
    return model_uri.removeprefix("models:/")


# ----------------------------------------------------------------------------- no Ray needed


def test_app_fails_fast_when_the_model_does_not_resolve(tmp_path):
    with pytest.raises(HLMError, match="does not exist"):
        build_app(AppArgs(model=str(tmp_path / "missing")))
    with pytest.raises(HLMError, match="hlm-no-such-model"):
        build_app({"model": "models:/hlm-no-such-model/1"})


def test_serve_builds_typed_args_from_a_config_dict(model_dir):
    """Serve turns a config file's `args:` into AppArgs through build_app's annotation."""
    from pydantic import ValidationError
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    app = call_user_app_builder_with_args_if_necessary(build_app, {"model": model_dir})
    assert type(app).__name__ == "Application"
    with pytest.raises(ValidationError, match="max_batch"):
        call_user_app_builder_with_args_if_necessary(
            build_app, {"model": model_dir, "max_batch": 4}
        )


def test_cli_parser_and_early_errors(model_dir, monkeypatch):
    from hlm_ray.serve.cli import add_parser, run

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local run checks its port first

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", "models:/x/1"])
    assert (args.host, args.port, args.replicas, args.allow_raw_head) == (
        "127.0.0.1",
        8000,
        1,
        False,
    )
    missing = parser.parse_args(["serve", "--model", "/no/such/run"])
    with pytest.raises(HLMError, match="does not exist"):
        run(missing)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        taken = parser.parse_args(["serve", "--model", model_dir, "--port", port])
        with pytest.raises(HLMError, match="another --port"):
            run(taken)


# ----------------------------------------------------------------------------- over HTTP


@pytest.mark.ray
def test_completion_over_http(server, model_uri):
    r = _post(server, {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    name = _served_name(model_uri)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == name and r.headers["x-hlm-model"] == name
    assert body["system_fingerprint"] == model_uri
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    _assert_logged(body["id"])


def _assert_logged(request_id: str) -> None:
    """One log line per request in the replica's log, with latency and token counts."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    for _ in range(50):
        lines = [
            line
            for f in logs.glob("replica_hlm-test_*.log")
            for line in f.read_text(errors="replace").splitlines()
            if request_id in line
        ]
        if lines:
            break
        time.sleep(0.1)
    assert len(lines) == 1, lines
    assert "status=200" in lines[0] and "latency_ms=" in lines[0]
    assert "prompt_tokens=" in lines[0] and "completion_tokens=" in lines[0]


@pytest.mark.ray
def test_models_and_healthz(server, model_uri, model_dir):
    [card] = requests.get(f"{server}/v1/models", timeout=30).json()["data"]
    assert card["id"] == _served_name(model_uri)
    assert card["source"] == card["mlflow_uri"] == model_uri
    assert card["objective"] == "vanilla" and card["max_positions"] == 128
    health = requests.get(f"{server}/healthz", timeout=30).json()
    assert health["status"] == "ok" and health["model"] == card["id"]


@pytest.mark.ray
def test_greedy_output_equals_the_library(server, library, model_uri):
    from_registry = Generator.load(model_uri)  # the registered copy decodes the same
    expected = [c.text for c in library.generate(PROMPTS[:3], max_new_tokens=12, temperature=0)]
    assert [
        c.text for c in from_registry.generate(PROMPTS[:3], max_new_tokens=12, temperature=0)
    ] == expected
    r = _post(server, {"prompt": PROMPTS[:3], "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == expected


@pytest.mark.ray
def test_seeded_sampling_is_reproducible(server, library):
    body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 1.0, "seed": 11, "n": 2}
    first = [c["text"] for c in _post(server, body).json()["choices"]]
    again = [c["text"] for c in _post(server, body).json()["choices"]]
    other = [c["text"] for c in _post(server, {**body, "seed": 12}).json()["choices"]]
    assert first == again and first != other and first[0] != first[1]
    lib = library.generate(PROMPTS[1], max_new_tokens=12, temperature=1.0, seed=11, n=2)
    assert first == [c.text for c in lib]


@pytest.mark.ray
def test_openai_client_plain_and_streaming(server, model_uri):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    name = _served_name(model_uri)
    plain = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=10, temperature=0)
    assert plain.model == name and plain.usage.completion_tokens <= 10
    chunks = list(
        client.completions.create(
            model=name,
            prompt=PROMPTS[2],
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert len([c for c in chunks if c.choices]) > 1  # streamed, not one piece
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        plain.choices[0].finish_reason
    )
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert [m.id for m in client.models.list()] == [name]
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=name, prompt="x", max_tokens=-1)


@pytest.mark.ray
def test_sse_stream_over_http(server):
    r = _post(server, {"prompt": PROMPTS[3], "max_tokens": 6, "stream": True}, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.ray
def test_concurrent_requests_are_batched(server, library):
    before = requests.get(f"{server}/healthz", timeout=30).json()
    prompts = [f"{PROMPTS[i % 5]} {i}" for i in range(32)]

    def ask(prompt: str) -> requests.Response:
        return _post(server, {"prompt": prompt, "max_tokens": 8, "temperature": 0})

    with ThreadPoolExecutor(32) as pool:
        responses = list(pool.map(ask, prompts))
    assert [r.status_code for r in responses] == [200] * 32
    after = requests.get(f"{server}/healthz", timeout=30).json()
    assert after["batches"] - before["batches"] < 32  # some requests shared a batch
    assert after["max_batch_requests"] > 1
    # Batching with other requests does not change a greedy answer.
    expected = [c.text for c in library.generate(prompts, max_new_tokens=8, temperature=0)]
    assert [r.json()["choices"][0]["text"] for r in responses] == expected


BAD_REQUESTS = [
    # (body, status, the field the message names)
    (b'{"prompt": "x", ', 400, "JSON"),
    (b"[1, 2]", 422, "body"),
    ({}, 422, "prompt"),
    ({"prompt": 5}, 422, "prompt"),
    ({"prompt": "x", "max_tokens": "10"}, 422, "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, 422, "stream"),
    ({"prompt": "x", "max_token": 5}, 422, "max_token"),
    ({"prompt": "x", "max_tokens": -1}, 422, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": 2.5}, 422, "temperature"),
    ({"prompt": "x", "top_p": 0}, 422, "top_p"),
    ({"prompt": "x", "n": 0}, 422, "n"),
    ({"prompt": "x", "n": 50}, 400, "n"),
    ({"prompt": []}, 422, "prompt"),
    ({"prompt": ["ok", "word " * 200]}, 400, "prompt[1]"),
    ({"prompt": "word " * 120, "max_tokens": 16}, 400, "positions"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 422, "stop"),
    ({"prompt": "x", "echo": True}, 422, "echo"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x" * (1 << 20)}, 413, "limit"),
]


@pytest.mark.ray
@pytest.mark.parametrize(("body", "status", "named"), BAD_REQUESTS)
def test_bad_input_gets_a_4xx_naming_the_field(server, body, status, named):
    r = _post(server, body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert named in error["message"], error
    assert error["type"] == "invalid_request_error"


@pytest.mark.ray
def test_still_serving_after_bad_input(server):
    assert _post(server, b"\xff\xfe not json").status_code == 400
    r = _post(server, {"prompt": "still there?", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.ray
def test_overload_gets_503_and_the_server_recovers(server, model_uri):
    """Beyond max_ongoing_requests=1 + max_queued_requests=1, Serve answers 503."""
    from ray import serve

    args = AppArgs(model=model_uri)
    app = make_app(args, num_cpus=0.5, max_ongoing_requests=1, max_queued_requests=1)
    serve.run(app, name="hlm-overload", route_prefix="/slow")
    slow = f"{server}/slow"
    try:
        with ThreadPoolExecutor(8) as pool:
            codes = list(
                pool.map(
                    lambda _: _post(slow, {"prompt": "x", "max_tokens": 120}).status_code,
                    range(8),
                )
            )
        assert 503 in codes and 200 in codes, codes
        assert set(codes) <= {200, 503}, codes
        assert _post(slow, {"prompt": "x", "max_tokens": 4}).status_code == 200
    finally:
        serve.delete("hlm-overload")
