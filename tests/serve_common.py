"""What the serving tests share: one tiny decoder registered in MLflow and one Serve application
serving it over real HTTP for the whole session (`tests/conftest.py` registers these fixtures),
so test_serve.py and test_serve_api.py start Serve once between them."""

from __future__ import annotations

import json
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from hlm_ray.tracking.server import free_port

MODEL_NAME = "hlm-test-generator"
API_KEY = "test-key-0123456789"
# The replicas read the key from this variable of their environment (`api_key_env`), as a
# cluster's pods read HLM_API_KEY from a Secret (deploy/serve.yaml): never from the args.
API_KEY_ENV = "HLM_TEST_API_KEY"
# Serve checks a replica's health every 10 s and replaces it after 3 failures in a row: every
# second here, so that the replica whose decode process is killed is replaced in seconds.
HEALTH_CHECK_PERIOD_S = 1.0
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY_TIMEOUT_S = 8.0  # the proxy's guard: a body not received within this is answered 408
# The connection guard: unfinished headers answered 408 after HEADER_TIMEOUT_S; one address
# holds PER_CLIENT connections at most (above the stalled-clients test's 516).
HEADER_TIMEOUT_S = 4.0
PER_CLIENT = 600


def headless_copy(model_dir, folder: Path) -> Path:
    """A copy of the decoder folder `model_dir` at `folder`, marked as a headless decoder that
    was never fine-tuned (its token counts come with it): served through its prior readout."""
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hlm_objective": "headless"}))
    return folder


def header_flood(server: str, keyed_request) -> None:
    """Issue 44's flood at the session's proxy, bounded: 700 connections from 127.0.0.2 that
    never finish their headers. The proxy holds PER_CLIENT of them and answers the rest 503 at
    once; 16 `keyed_request()`s (status codes) from 127.0.0.1 meanwhile are all answered 200; the
    held ones are answered 408 once HEADER_TIMEOUT_S has passed. Whichever engine serves behind
    the proxy, the proxy's guard is the same."""
    port = int(server.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
    flood = []
    for _ in range(700):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30,
                                        source_address=("127.0.0.2", 0))  # fmt: skip
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        flood.append(sock)
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: keyed_request(), range(16)))
        assert codes == [200] * 16, codes
        answers = []
        for sock in flood:
            sock.settimeout(HEADER_TIMEOUT_S + 20)
            answers.append(sock.recv(4096).split(b"\r\n", 1)[0])
        refused = answers.count(b"HTTP/1.1 503 Service Unavailable")
        timed_out = answers.count(b"HTTP/1.1 408 Request Timeout")
        assert (refused, timed_out) == (700 - PER_CLIENT, PER_CLIENT), set(answers)
        assert time.monotonic() - started >= HEADER_TIMEOUT_S - 0.5
    finally:
        for sock in flood:
            sock.close()


def fuzz_bodies(seed: int, count: int) -> list[bytes]:
    """Random and hand-made request bodies: wrong types, out-of-range and huge numbers,
    unicode edge cases, huge bodies, deep nesting."""
    import random

    rng = random.Random(seed)
    fields = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
              "stream", "model", "user", "echo", "logprobs", "stream_options", "zzz"]  # fmt: skip
    weird = [None, True, False, 0, -1, 1, 2, 3.5, -0.0, 1e308, -1e308, 2**31, 2**63, 2**64,
             10**40, "", "x", "\u0000", "\ud7ff\ue000", "\U0010ffff", "é" * 50, "🐍" * 30,
             "\u202e\u200b", [], [1], ["a", 2], {}, {"a": 1}, "1" * 5000]  # fmt: skip
    bodies = [
        b"",
        b"null",
        b"[]",
        b"{",
        b'{"prompt": "x"',
        b"\xff\xfe\x00",
        b'{"prompt": "\\ud800"}',
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "x", "max_tokens": 1e999}',
        b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"prompt": "x", "stop": ' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}",
        json.dumps({"prompt": "word " * 200_000}).encode(),  # 1 MB: 413
        json.dumps({"prompt": ["x"] * 200_000}).encode(),
        json.dumps({"prompt": "x", "max_tokens": 2, "stop": ["\U0001f40d"]}).encode(),
        json.dumps({"prompt": "\U0001f40d\u0301\u200d" * 40, "max_tokens": 2}).encode(),
    ]
    while len(bodies) < count:
        body = {"prompt": rng.choice(["hi", "\u00e9t\u00e9", "🐍 snake", "a b c"]),
                "max_tokens": rng.randint(1, 3)}  # fmt: skip
        for name in rng.sample(fields, rng.randint(0, 4)):
            body[name] = rng.choice(weird)
        text = json.dumps(body)
        if rng.random() < 0.1:  # a byte flipped
            i = rng.randrange(len(text))
            text = text[:i] + chr(rng.randrange(32, 127)) + text[i + 1 :]
        bodies.append(text.encode())
    return bodies


def post(server: str, body, path: str = "/v1/completions", **kwargs) -> requests.Response:
    kwargs["headers"] = {**AUTH, **kwargs.get("headers", {})}
    if isinstance(body, bytes | str):
        return requests.post(f"{server}{path}", data=body, timeout=60, **kwargs)
    return requests.post(f"{server}{path}", json=body, timeout=60, **kwargs)


@pytest.fixture(scope="session")
def serve_model_dir(tmp_path_factory) -> str:
    """The tiny decoder of `tiny_decoder_dir`, built once for the session's server."""
    from conftest import make_tiny_decoder

    return make_tiny_decoder(tmp_path_factory.mktemp("serve_decoder"))


@pytest.fixture(scope="session")
def serve_model_uri(serve_model_dir) -> str:
    """The tiny decoder registered in the session's MLflow store."""
    from hlm_ray.tracking import register_model

    name, version = register_model(serve_model_dir, MODEL_NAME)
    return f"models:/{name}/{version}"


@pytest.fixture(scope="session")
def serve_app(ray_cluster, serve_model_uri):
    """The application under test at http://127.0.0.1:<port>, serving `models:/...`."""
    from ray import serve

    from hlm_ray.serve.app import CompletionServer, check_model
    from hlm_ray.serve.guard import guard_controller_options
    from hlm_ray.serve.schemas import AppArgs

    port = free_port()
    serve.start(
        http_options={"host": "127.0.0.1", "port": port},
        controller_options=guard_controller_options(
            body_timeout_s=BODY_TIMEOUT_S,
            header_timeout_s=HEADER_TIMEOUT_S,
            per_client=PER_CLIENT,
            api_key=API_KEY,  # the proxy's /-/routes
        ),
    )
    args = AppArgs(
        model=serve_model_uri,
        max_batch_size=16,
        batch_wait_timeout_s=0.05,
        max_n=3,
        api_key_env=API_KEY_ENV,
        # Through the replica's decode process (the default, said here because the tests
        # depend on it); the overload test's app (test_serve.py) decodes on the replica's
        # thread (`--no-decode-process`).
        decode_process=True,
    )
    assert args.api_key is None  # the key comes from the replica's environment only
    check_model(args)
    # make_app's deployment, plus the key in the replica's environment and frequent checks.
    # No logical CPU: the app stays up until the session ends, and with 0.5 of the cluster's 2
    # CPUs held the sweep tests after it ran their 1-CPU trials one at a time (the replica is
    # idle between the serving tests; what `num_cpus` does is test_serve.py's overload app's).
    deployment = CompletionServer.options(
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": {API_KEY_ENV: API_KEY}}},
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    )
    try:
        serve.run(deployment.bind(args), name="hlm-test", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
