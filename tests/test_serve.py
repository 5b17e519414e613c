"""The completions server over real HTTP on localhost: one Serve application for the module
(a tiny decoder registered in MLflow and served as `models:/...`), plus a small one with a
queue limit of 1 for the overload test. Library-level generation is tested in test_generate.py."""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from serve_common import (
    API_KEY,
    AUTH,
    BODY_TIMEOUT_S,
    free_port,
    fuzz_bodies,
    header_flood,
    headless_copy,
    post,
)

from hlm_ray.bench.serve import nice_of, processes
from hlm_ray.errors import HLMError
from hlm_ray.generate import Generator
from hlm_ray.serve.app import build_app, make_app
from hlm_ray.serve.schemas import AppArgs

PROMPTS = [f"{word} is a word that" for word in ("cat", "house", "river", "Paris", "green")]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(serve_model_dir) -> str:
    return serve_model_dir


@pytest.fixture(scope="module")
def model_uri(serve_model_uri) -> str:
    return serve_model_uri


@pytest.fixture(scope="module")
def library(model_dir) -> Generator:
    return Generator.load(model_dir)


@pytest.fixture(scope="module")
def server(serve_app) -> str:
    """The session's application (tests/serve_common.py) at http://127.0.0.1:<port>."""
    return serve_app


def _post(server: str, body, **kwargs) -> requests.Response:
    return post(server, body, **kwargs)


def _get(server: str, path: str, **kwargs) -> requests.Response:
    return requests.get(f"{server}{path}", headers=AUTH, timeout=30, **kwargs)


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
    """`hlm serve`'s defaults (decode process; direct ingress where it starts Ray, decided at
    run time) and every bad combination refused before Ray starts, naming its flag."""
    from hlm_ray.serve.cli import add_parser, app_args, run

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local run checks its ports first

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", "models:/x/1"])
    assert (args.host, args.port, args.replicas, args.allow_raw_head) == (
        "127.0.0.1",
        8000,
        1,
        False,
    )
    assert (args.decode_process, args.direct_ingress, args.proxy_port) == (True, None, None)
    assert app_args(args).decode_process and app_args(args).batch_wait_timeout_s == 0.02
    plain = parser.parse_args(["serve", "--model", "m", "--no-decode-process"])
    assert app_args(plain).decode_process is False
    missing = parser.parse_args(["serve", "--model", "/no/such/run"])
    with pytest.raises(HLMError, match="does not exist"):
        run(missing)
    with pytest.raises(HLMError, match="--batch-wait-timeout-s"):
        run(parser.parse_args(["serve", "--model", model_dir, "--batch-wait-timeout-s", "-1"]))
    from hlm_ray.serve.cli import connection_limits
    from hlm_ray.serve.guard import guard_env

    limits = connection_limits(parser.parse_args(
        ["serve", "--model", "m", "--header-timeout-s", "3", "--max-connections", "7",
         "--max-connections-per-client", "0"]))  # fmt: skip
    assert limits == {"header_timeout_s": 3.0, "max_connections": 7, "per_client": 0}
    env = guard_env(**limits)  # what the proxies and replicas read
    assert (env["HLM_SERVE_HEADER_TIMEOUT_S"], env["HLM_SERVE_MAX_CONNECTIONS"],
            env["HLM_SERVE_MAX_CONNECTIONS_PER_CLIENT"]) == ("3", "7", "0")  # fmt: skip
    for flag, value in (("--header-timeout-s", "inf"), ("--header-timeout-s", "0"),
                        ("--max-connections", "0"), ("--max-connections-per-client", "-1")):  # fmt: skip
        with pytest.raises(HLMError, match=f"{flag}={value}"):
            run(parser.parse_args(["serve", "--model", model_dir, flag, value]))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        serve = ["serve", "--model", model_dir]
        for flags in ([], ["--no-direct-ingress"]):  # the replica's port, or the proxy's
            with pytest.raises(HLMError, match="another --port"):
                run(parser.parse_args([*serve, "--port", port, *flags]))
        free = ["--port", str(free_port())]
        with pytest.raises(HLMError, match="another --proxy-port"):
            run(parser.parse_args([*serve, *free, "--proxy-port", port]))
    with pytest.raises(HLMError, match="--proxy-port needs direct ingress"):
        run(parser.parse_args([*serve, *free, "--proxy-port", "9000", "--no-direct-ingress"]))
    with pytest.raises(HLMError, match="one of the replicas' ports"):
        run(parser.parse_args([*serve, "--port", "9000", "--replicas", "2", "--proxy-port", "9001"]))  # fmt: skip
    on_cluster = [*serve, *free, "--address", "auto"]
    with pytest.raises(HLMError, match="needs a Ray that starts here"):
        run(parser.parse_args([*on_cluster, "--direct-ingress"]))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "--port=70000 is not a TCP port; use 1-65535"),  # OverflowError
        (["--port", "-1"], "--port=-1 is not a TCP port; use 1-65535"),
        (["--port", "65535", "--replicas", "2"], "needs ports up to 65536 (one per replica)"),
        (["--proxy-port", "0"], "--proxy-port=0 is not a TCP port"),
        (["--replicas", "0"], "--replicas=0 is not allowed; use 1 or more"),  # Serve's pydantic
        (["--replicas", "-1"], "--replicas=-1 is not allowed; use 1 or more"),
        (["--num-cpus", "-1"], "--num-cpus=-1 is not allowed; use a number >= 0"),
        (["--num-gpus", "nan"], "--num-gpus=nan is not allowed"),
        (["--max-ongoing-requests", "0"], "--max-ongoing-requests=0 is not allowed"),
        (
            ["--max-queued-requests", "0"],
            "--max-queued-requests=0 is not allowed; use 1 or more, or -1",
        ),
        (
            ["--host", "8.8.8.8"],
            "--host 8.8.8.8 is not an address of this machine",
        ),  # blamed the port
        (["--api-key", ""], "--api-key is empty"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag_before_the_model_or_ray(
    flags, message, capsys, monkeypatch
):
    """Each was a traceback (OverflowError, Serve's pydantic ValueError) or blamed another
    flag; the model does not exist either: the flag is what is named, before anything starts."""
    from hlm_ray.cli import main

    monkeypatch.delenv("HLM_API_KEY", raising=False)
    assert main(["serve", "--model", "/no/such/run", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_ray_address_local_is_a_ray_started_here_with_direct_ingress(monkeypatch):
    """`RAY_ADDRESS=local` (start a Ray here, never join another on the machine) was taken for
    a cluster: the server went through Serve's proxy, without direct ingress."""
    from hlm_ray.serve.cli import add_arguments, plan_ports
    from hlm_ray.tracking.server import free_port

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert plan_ports(parser.parse_args(["--model", "m", "--port", str(free_port())])).direct


def test_an_api_key_variable_set_but_empty_is_refused(capsys, monkeypatch):
    """`HLM_API_KEY=$(cat missing-file)` started an open server whose banner said only "no API
    key"; unset, the server is open as documented (here: the missing model is the error)."""
    from hlm_ray.cli import main

    monkeypatch.setenv("HLM_API_KEY", "")
    assert main(["serve", "--model", "/no/such/run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: HLM_API_KEY is set but empty") and "unset HLM_API_KEY" in err
    monkeypatch.delenv("HLM_API_KEY")
    assert main(["serve", "--model", "/no/such/run"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_second_ctrl_c_during_the_shutdown_says_so_and_lets_it_finish(capsys):
    """A second Ctrl-C while Serve and Ray shut down was a 35-line traceback that broke the
    shutdown off; now it is one line and the shutdown completes (a third exits at once)."""
    import signal

    from hlm_ray.serve.running import shut_down

    done = []

    def slow_stop():
        os.kill(os.getpid(), signal.SIGINT)  # the impatient user
        time.sleep(0.2)
        done.append(True)

    shut_down(slow_stop)
    assert done == [True]
    assert capsys.readouterr().err == "still shutting down (Ctrl-C again to exit at once)\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back


def test_replicas_run_at_niceness_0_unless_told_otherwise(model_dir):
    """Ray starts its workers at niceness 15; a replica (and the decode process it spawns,
    which inherits it) asks for 0 through its runtime_env, in `hlm serve`, `make_app` and the
    deployment a config file builds; `--niceness 15` gives Ray's default back."""
    from hlm_ray.serve.cli import add_arguments

    def env_of(app) -> dict:
        return app._bound_deployment.ray_actor_options["runtime_env"]["env_vars"]

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--model", "m"]).niceness == 0
    assert parser.parse_args(["--model", "m", "--niceness", "15"]).niceness == 15
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--niceness", "-5"])  # raising priority: refused
    args = AppArgs(model=model_dir)
    assert env_of(make_app(args)) == {"RAY_worker_niceness": "0"}
    assert env_of(build_app(args)) == {"RAY_worker_niceness": "0"}
    app = make_app(args, niceness=15, num_cpus=0.5)
    assert env_of(app) == {"RAY_worker_niceness": "15"}
    assert app._bound_deployment.ray_actor_options["num_cpus"] == 0.5
    assert env_of(make_app(args)) == {"RAY_worker_niceness": "0"}  # the default is untouched


def test_the_callers_signal_handlers_outlive_ray_init():
    """`ray.init` puts Ray's SIGTERM handler in place; while Serve was still starting, a SIGTERM
    then ended `hlm serve` at once and left Ray's agents running. `start` keeps the caller's
    handlers around it (a real SIGTERM during start-up: "shutting down", nothing left; the
    walkthrough test sends one)."""
    import signal

    from hlm_ray.serve.launch import callers_signal_handlers

    def ours(signum, frame):
        raise KeyboardInterrupt

    sigs = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.getsignal(sig) for sig in sigs}
    try:
        for sig in sigs:
            signal.signal(sig, ours)
        with callers_signal_handlers():
            signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as ray.init does
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        assert all(signal.getsignal(sig) is ours for sig in sigs)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_where_hlm_serve_answers(monkeypatch):
    """Direct ingress by default where `hlm serve` starts Ray (the replicas on --port and the
    next ports, the proxy after them), the proxy on --port on a cluster or when turned off;
    the startup line says which URL does what."""
    from hlm_ray.serve.cli import add_arguments, plan_ports
    from hlm_ray.serve.launch import direct_ingress_env

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    port = free_port()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ports = plan_ports(parser.parse_args(["--model", "m", "--port", str(port)]))
    assert (ports.direct, ports.url, ports.proxy_port) == (True, f"http://127.0.0.1:{port}", port + 1)  # fmt: skip
    assert ports.env()["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == str(port)
    assert f"at http://127.0.0.1:{port}/v1, answered by the replica itself" in ports.describe()
    assert f"proxy, which spreads requests over the replicas, at {ports.proxy_url}/v1" in ports.describe()  # fmt: skip
    off = plan_ports(parser.parse_args(["--model", "m", "--port", str(port), "--no-direct-ingress"]))  # fmt: skip
    assert (off.direct, off.proxy_port, off.env()) == (False, port, {})
    assert off.describe() == f"at http://127.0.0.1:{port}/v1 through Ray Serve's proxy"
    monkeypatch.setenv("RAY_ADDRESS", "auto")  # a cluster: its proxy, whatever is free here
    cluster = plan_ports(parser.parse_args(["--model", "m", "--port", "8000"]))
    assert (cluster.direct, cluster.port, cluster.proxy_port) == (False, 8000, 8000)

    env = direct_ingress_env(8100, replicas=3)
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == ("8100", "8103")  # fmt: skip
    # A replaced replica gets its port back, and a stopping one does not wait for a balancer.
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"


# ----------------------------------------------------------------------------- over HTTP


def test_bearer_matches_the_whole_key_and_nothing_else():
    """The one check behind every /v1 route and Serve's /-/ routes: `Bearer <key>`, the scheme
    in any case, whitespace around the key ignored; an empty credential, a prefix or a suffix
    of the key, the key with anything added or changed, or another scheme never match."""
    from hlm_ray.serve.guard import bearer_matches

    key = API_KEY.encode()
    right = [f"Bearer {API_KEY}", f"bearer {API_KEY}", f"BEARER {API_KEY}", f"bEaReR {API_KEY}"]
    right += [f"Bearer  {API_KEY}", f"Bearer {API_KEY} ", f"Bearer {API_KEY}\t"]
    assert [h for h in right if not bearer_matches(h, key)] == []
    wrong = ["", "Bearer", "Bearer ", "Bearer   ", API_KEY, f"Bearer{API_KEY}"]
    wrong += [
        f"Basic {API_KEY}",
        f"Token {API_KEY}",
        f"Bearer: {API_KEY}",
        f"Bearer Bearer {API_KEY}",
    ]
    wrong += [f"Bearer {API_KEY[:n]}" for n in (1, 2, len(API_KEY) // 2, len(API_KEY) - 1)]
    wrong += [f"Bearer {API_KEY[n:]}" for n in (1, len(API_KEY) // 2, len(API_KEY) - 1)]
    wrong += [f"Bearer {API_KEY}x", f"Bearer x{API_KEY}", f"Bearer {API_KEY} {API_KEY}"]
    wrong += [f"Bearer {API_KEY[:4]} {API_KEY[4:]}", f"Bearer {API_KEY.upper()}"]
    # Non-ASCII: a look-alike key (Cyrillic "е" for "e"), accents, the key then a non-ASCII
    # character: no match, and no exception (hmac.compare_digest raises on non-ASCII str).
    wrong += [f"Bearer {API_KEY.replace('e', 'е')}", f"Bearer {API_KEY}é", "Bearer clé"]
    assert [h for h in wrong if bearer_matches(h, key)] == []
    assert bearer_matches("Bearer clé", "clé".encode())  # a non-ASCII key compares as UTF-8
    assert not bearer_matches("Bearer ", b"") and not bearer_matches("", b"")  # no key: no match


def test_completion_routes_skip_fastapi_but_keep_their_paths_and_docs():
    """The two completion routes are dispatched past FastAPI's router (`_CompletionRoutes`),
    under any route prefix Serve gives the app; FastAPI still documents both."""
    from hlm_ray.serve.routes import CompletionRoutes, api, route_path
    from hlm_ray.serve.server import CompletionServer

    routes = CompletionRoutes.ROUTES
    assert route_path({"path": "/v1/completions", "root_path": ""}) == "/v1/completions"
    prefixed = {"path": "/lm/v1/chat/completions", "root_path": "/lm"}
    assert routes[route_path(prefixed)] == "chat_completions"
    assert route_path({"path": "/v1/completions/", "root_path": ""}) not in routes
    documented = api.openapi()["paths"]
    for path, method in routes.items():
        assert "post" in documented[path]
        assert callable(getattr(CompletionServer.func_or_class, method))


def test_access_lines_wait_for_a_quiet_loop_and_are_never_dropped():
    """The replica's access lines (`AccessLog`): written once no request is in flight, at
    the batch limit, or after `flush_s` while requests keep coming; in order; at once off a
    loop."""
    import asyncio
    import logging

    from hlm_ray.serve.access_log import AccessLog

    written: list[str] = []
    logger = logging.getLogger("hlm-test-access")
    logger.propagate, logger.level = False, logging.INFO
    handler = logging.Handler()
    handler.emit = lambda record: written.append(record.getMessage().split()[1])
    logger.addHandler(handler)
    access = AccessLog(logger, flush_s=0.05, batch_lines=3)

    def line(i: int) -> tuple:
        return (f"cmpl-{i}", 200, 1.5, 2, 3, 1, False, "tiny/1", "")

    async def traffic() -> None:
        access.started(), access.started()
        access.add(*line(0))
        access.finished()
        await asyncio.sleep(0)
        assert written == []  # one request still in flight
        access.add(*line(1))
        access.finished()
        await asyncio.sleep(0)
        assert written == ["cmpl-0", "cmpl-1"]  # none in flight: the next turn
        access.started()
        for i in (2, 3, 4):
            access.add(*line(i))
        assert written[2:] == ["cmpl-2", "cmpl-3", "cmpl-4"]  # the batch limit
        access.add(*line(5))
        await asyncio.sleep(0.2)
        assert written[5:] == ["cmpl-5"]  # still in flight: the timer

    try:
        asyncio.run(traffic())
        access.add(*line(6))  # off a loop (a test, shutdown): at once
        assert written == [f"cmpl-{i}" for i in range(7)]
    finally:
        logger.removeHandler(handler)


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
    r = _get(server, "/v1/models")
    [card] = r.json()["data"]
    assert card["id"] == _served_name(model_uri)
    assert card["mlflow_uri"] == model_uri
    assert card["objective"] == "vanilla" and card["max_positions"] == 128
    # No local path anywhere: the registry URI and the name say which weights answer.
    assert "source" not in card and "path" not in card
    assert str(Path(model_dir).parent.parent) not in r.text and "/tmp" not in r.text
    health = _get(server, "/healthz").json()
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

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
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
    before = _get(server, "/healthz").json()
    prompts = [f"{PROMPTS[i % 5]} {i}" for i in range(32)]

    def ask(prompt: str) -> requests.Response:
        return _post(server, {"prompt": prompt, "max_tokens": 8, "temperature": 0})

    with ThreadPoolExecutor(32) as pool:
        responses = list(pool.map(ask, prompts))
    assert [r.status_code for r in responses] == [200] * 32
    after = _get(server, "/healthz").json()
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
    ({"prompt": "x", "echo": "yes"}, 422, "echo"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of"),
    ({"prompt": "x", "max_tokens": 0}, 400, "echo"),
    ({"prompt": "x", "logprobs": 21}, 422, "logprobs"),
    ({"prompt": "x", "logit_bias": {"5000": 1}}, 400, "vocabulary"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, 422, "logit_bias"),
    ({"prompt": [1, 2, 99999]}, 400, "vocabulary"),
    ({"prompt": [[1, 2], []]}, 422, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x" * (1 << 20)}, 413, "limit"),
    # Every number is bounded: none reaches a tensor it could overflow (issue 14).
    ({"prompt": "x", "temperature": 1, "top_k": 2**63}, 422, "top_k"),
    ({"prompt": "x", "temperature": 1, "top_k": 1025}, 400, "vocabulary"),
    ({"prompt": "x", "max_tokens": 10**30}, 422, "max_tokens"),
    ({"prompt": "x", "n": 2**64}, 422, "n"),
    ({"prompt": "x", "seed": -1}, 422, "seed"),
    ({"prompt": "x", "seed": 2**63}, 422, "seed"),
    (b'{"prompt": "x", "temperature": NaN}', 422, "temperature"),
    (b'{"prompt": "x", "top_p": Infinity}', 422, "top_p"),
    (b'{"prompt": "\\ud800"}', 400, "JSON"),  # a lone surrogate
    ({"prompt": "x", "stop": "s" * 300}, 422, "stop"),
    ({"prompt": ["x"] * 2000}, 422, "prompt"),
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
    """Beyond max_ongoing_requests=1 + max_queued_requests=1, Serve answers 503. This app
    decodes on the replica's thread (`--no-decode-process`), the session's in a child."""
    from ray import serve

    args = AppArgs(model=model_uri, decode_process=False)
    app = make_app(args, num_cpus=0.5, max_ongoing_requests=1, max_queued_requests=1)
    serve.run(app, name="hlm-overload", route_prefix="/slow")
    slow = f"{server}/slow"
    try:
        with ThreadPoolExecutor(8) as pool:
            responses = list(
                pool.map(lambda _: _post(slow, {"prompt": "x", "max_tokens": 120}), range(8))
            )
        codes = [r.status_code for r in responses]
        assert 503 in codes and 200 in codes, codes
        assert set(codes) <= {200, 503}, codes
        for r in responses:  # Serve's own 503, in OpenAI's shape (the proxy's guard)
            if r.status_code == 503:
                assert r.json()["error"]["type"] == "server_error", r.text
        assert _post(slow, {"prompt": "x", "max_tokens": 4}).status_code == 200
    finally:
        serve.delete("hlm-overload")


@pytest.mark.ray
def test_a_headless_decoder_never_fine_tuned_answers_through_its_prior_readout(
    server, model_dir, tmp_path
):
    """The endpoint serves a raw headless decoder (the tiny decoder's folder, its token counts
    with it, marked headless) through its prior readout, in the replica's decode process: the
    prompt's log-probabilities are the library's with that readout, not its raw Eᵀ's."""
    import warnings

    from ray import serve

    folder = headless_copy(model_dir, tmp_path / "headless" / "model")
    prior = Generator.load(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the raw-head warning
        tied = Generator.load(folder, readout="tied")
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1}
    args = AppArgs(model=str(folder), readout="prior")
    serve.run(make_app(args, num_cpus=0), name="hlm-prior", route_prefix="/prior")
    try:
        r = _post(f"{server}/prior", body)
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["logprobs"]["token_logprobs"][1:]
    finally:
        serve.delete("hlm-prior")
    settings = dict(max_new_tokens=4, temperature=0, logprobs=1, prompt_logprobs=True)
    [want], [raw] = prior.generate(PROMPTS[0], **settings), tied.generate(PROMPTS[0], **settings)
    assert prior.info["readout"] == "prior"
    expected = [e.logprob for e in want.prompt_logprobs[1:] + want.logprobs]
    assert got == pytest.approx(expected, abs=1e-5)
    assert got[: len(want.prompt_logprobs) - 1] != pytest.approx(
        [e.logprob for e in raw.prompt_logprobs[1:]], abs=1e-3
    )


# ----------------------------------------------------------------------------- hostile traffic


@pytest.mark.ray
def test_a_poisoned_request_does_not_fail_its_batch_mates(server, library):
    """top_k = 2**63 once raised inside the batch and failed all its batch-mates with 500: now
    it is refused alone and every ordinary request gets the text it gets alone."""
    prompts = [f"{PROMPTS[i % 5]} {i}" for i in range(15)]
    poisons = [
        {"prompt": "x", "max_tokens": 32, "temperature": 1, "top_k": 2**63},
        {"prompt": "x", "max_tokens": 32, "temperature": 1, "top_k": 1025},
    ]
    bodies = [{"prompt": p, "max_tokens": 8, "temperature": 0} for p in prompts]
    bodies[3:3] = poisons[:1]
    bodies[9:9] = poisons[1:]
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: _post(server, b), bodies))
    normal = [r for b, r in zip(bodies, responses, strict=True) if b not in poisons]
    poisoned = [r for b, r in zip(bodies, responses, strict=True) if b in poisons]
    assert [r.status_code for r in poisoned] == [422, 400]
    assert all(r.json()["error"]["param"] == "top_k" for r in poisoned)
    assert [r.status_code for r in normal] == [200] * 15, [r.text for r in normal]
    alone = [library.generate(p, max_new_tokens=8, temperature=0)[0].text for p in prompts]
    assert [r.json()["choices"][0]["text"] for r in normal] == alone


@pytest.mark.ray
def test_api_key_is_required_and_checked(server):
    """The session's replicas read the key from their environment (`api_key_env`, as
    deploy/serve.yaml reads HLM_API_KEY), not from their args: enforced over HTTP."""
    body = {"prompt": "x", "max_tokens": 2}
    # One of each kind `test_bearer_matches_the_whole_key_and_nothing_else` checks: none, the
    # bare key, another key, an empty credential, a prefix, a suffix, the key with one more
    # character, another scheme; on the replica's routes and on Serve's own /-/routes.
    wrong = ["Bearer wrong", API_KEY, "Bearer ", f"Bearer {API_KEY[0]}", f"Bearer {API_KEY[1:]}"]
    wrong += [f"Bearer {API_KEY}x", f"Basic {API_KEY}"]
    for headers in [{}] + [{"Authorization": h} for h in wrong]:
        r = requests.post(f"{server}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
        for path in ("/v1/models", "/-/routes"):
            r = requests.get(f"{server}{path}", headers=headers, timeout=30)
            assert r.status_code == 401, (headers, path, r.status_code)
    lower = {"Authorization": f"bearer  {API_KEY} "}  # the scheme's case, spaces: the same key
    assert _post(server, body, headers=lower).status_code == 200
    assert _post(server, body).status_code == 200
    assert requests.get(f"{server}/healthz", timeout=30).status_code == 200  # probes need no key
    assert requests.get(f"{server}/-/healthz", timeout=30).status_code == 200
    # Every other route needs it: FastAPI's docs, Serve's route table, paths that do not exist.
    for path in ("/docs", "/openapi.json", "/redoc", "/-/routes", "/v1/models/x", "/nothing"):
        r = requests.get(f"{server}{path}", timeout=30)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
        assert r.json()["error"]["code"] == "invalid_api_key", path
        assert requests.get(f"{server}{path}", headers=AUTH, timeout=30).status_code in (200, 404)


@pytest.mark.ray
@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405)],
)
def test_every_error_is_in_openai_shape(server, method, path, status):
    r = requests.request(method, f"{server}{path}", headers=AUTH, timeout=30)
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def _stall(port: int) -> socket.socket:
    """A client that sends its headers and 10 of the 100 bytes it announces, then waits."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n"
        b'{"prompt":'
    )
    return sock


@pytest.mark.ray
def test_stalled_clients_hold_no_capacity_and_get_408(server):
    """500 half-sent requests (70 stalled the service before the proxy's guard): while every
    one of them is still held, ordinary requests are all answered and none of the stalled ones
    has reached the replica; then every stalled client is answered 408 and closed."""
    import select

    port = int(server.rsplit(":", 1)[1])
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    before = _get(server, "/healthz").json()["requests"]
    stalled = [_stall(port) for _ in range(500)]
    try:
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: _post(server, body).status_code, range(16)))
        # Still held: no stalled client has been answered (or closed) yet.
        held = select.poll()
        for sock in stalled:
            held.register(sock, select.POLLIN)
        answered = held.poll(0)
        assert codes == [200] * 16, codes
        assert answered == [], f"{len(answered)} stalled clients were answered before the rest"
        # The replica saw the 16 ordinary requests only: the guard holds the stalled bodies.
        assert _get(server, "/healthz").json()["requests"] - before == 16
        answers = []
        for sock in stalled[::50]:
            sock.settimeout(BODY_TIMEOUT_S + 20)
            head = sock.recv(4096)
            while sock.recv(4096):  # the server closes the connection
                pass
            answers.append(head.split(b"\r\n", 1)[0])
        assert answers == [b"HTTP/1.1 408 Request Timeout"] * 10
    finally:
        for sock in stalled:
            sock.close()


@pytest.mark.ray
def test_a_header_flood_from_one_address_leaves_keyed_requests_answered(server):
    """Issue 44's flood at the session's proxy, bounded (`serve_common.header_flood`)."""
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    header_flood(server, lambda: _post(server, body).status_code)


@pytest.mark.ray
def test_fuzz_never_gets_a_5xx_and_the_server_stays_healthy(server):
    from collections import Counter

    bodies = fuzz_bodies(seed=14, count=300)
    session = requests.Session()

    def send(body: bytes) -> int:
        headers = {**AUTH, "content-type": "application/json"}
        return session.post(f"{server}/v1/completions", data=body, headers=headers,
                            timeout=30).status_code  # fmt: skip

    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(send, bodies))
    counts = Counter(codes)
    print(f"fuzz: {len(bodies)} requests in {time.monotonic() - start:.1f} s: {dict(counts)}")
    assert not [c for c in codes if c >= 500], counts
    assert counts[200] > 20 and counts[422] > 20  # both valid and invalid bodies were sent
    assert _get(server, "/healthz").status_code == 200
    assert _post(server, {"prompt": "still fine?", "max_tokens": 2}).status_code == 200


@pytest.mark.ray
def test_a_client_that_leaves_mid_body_is_logged_as_such_not_as_a_500(server):
    import ray

    port = int(server.rsplit(":", 1)[1])
    sock = _stall(port)
    time.sleep(0.2)
    sock.close()
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    for _ in range(50):
        text = "\n".join(f.read_text(errors="replace") for f in logs.glob("proxy_*.log"))
        if "client disconnected while sending its request" in text:
            break
        time.sleep(0.1)
    assert "client disconnected while sending its request to /v1/completions" in text
    assert " 500 " not in text and "Traceback" not in text
    assert _post(server, {"prompt": "x", "max_tokens": 2}).status_code == 200


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _actors(*filters: tuple) -> list:
    """Ray's actors (State API) of this session's cluster (others may run on the machine)."""
    import ray
    from ray.util.state import list_actors

    return list_actors(address=ray.get_runtime_context().gcs_address, filters=list(filters))


def _replica() -> tuple[str, int, int]:
    """(actor name, pid, decode child's pid) of the session app's one live replica."""
    [actor] = _actors(
        ("class_name", "=", "ServeReplica:hlm-test:CompletionServer"), ("state", "=", "ALIVE")
    )
    [child] = [
        c
        for c in _children(actor.pid)
        if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()  # not the resource tracker
    ]
    return actor.name, actor.pid, child


@pytest.mark.ray
def test_a_replica_whose_decode_process_dies_is_replaced(server, library):
    """Kill the session replica's decode child: the replica fails Serve's health check
    (`check_health`), Serve starts another (a new replica, a new decode process) and requests
    are answered again, with the library's text."""
    import signal

    name, pid, child = _replica()
    os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 120  # 3 failed checks (1 s apart here), then a new replica
    while True:
        try:
            new = _replica()
        except (ValueError, OSError):  # none alive or two, or its decode process not up yet
            new = None
        if new is not None and new[0] != name:
            break
        assert time.monotonic() < deadline, "the replica was not replaced"
        time.sleep(1)
    assert new[1] != pid and new[2] != child
    assert [a.state for a in _actors(("name", "=", name))] == ["DEAD"]
    body = {"prompt": PROMPTS[:2], "max_tokens": 8, "temperature": 0}
    for _ in range(60):  # until the proxy routes to the new replica
        r = _post(server, body)
        if r.status_code == 200:
            break
        time.sleep(1)
    assert r.status_code == 200, r.text
    expected = [c.text for c in library.generate(PROMPTS[:2], max_new_tokens=8, temperature=0)]
    assert [c["text"] for c in r.json()["choices"]] == expected


@pytest.mark.ray  # a Ray of its own
@pytest.mark.slow
def test_hlm_serve_with_no_options_answers_on_its_port_past_the_proxy(model_dir, tmp_path):
    """`hlm serve --model M --port P` and nothing else, in a Ray of its own (a subprocess:
    Serve's throughput settings are read as Ray starts): the replica answers P itself (direct
    ingress) and decodes in a child process, Serve's proxy answers P + 1, both with the text
    the library gives; the guard runs on P too (a half-sent body is answered 408 and closed),
    and the connection guard on both (unfinished headers: 408 after --header-timeout-s);
    Ctrl-C stops it cleanly."""
    import signal
    import subprocess
    import sys

    from hlm_ray.serve.launch import Ports

    port = free_port()
    Ports.plan("127.0.0.1", port, replicas=1, direct=True)  # P + 1 free as well
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HLM_API_KEY")}
    env["HLM_SERVE_BODY_TIMEOUT_S"] = "2"
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "hlm_ray.cli", "serve", "--model", model_dir, "--port", str(port),
           "--body-timeout-s", "2", "--header-timeout-s", "2", "--api-key", API_KEY]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while "Ctrl-C to stop" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        startup = log.read_text()
        assert f"at http://127.0.0.1:{port}/v1, answered by the replica itself" in startup
        assert f"proxy, which spreads requests over the replicas, at http://127.0.0.1:{port + 1}/v1" in startup  # fmt: skip
        assert "; a child process decodes; API key required; POST /v1/completions" in startup
        body = {"prompt": "The cat", "max_tokens": 8, "temperature": 0}
        want = Generator.load(model_dir).generate(["The cat"], max_new_tokens=8, temperature=0)
        for where in (port, port + 1):
            url = f"http://127.0.0.1:{where}"
            r = requests.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want[0].text
            # The key on every route but the probes', on both ports (--api-key, not $HLM_API_KEY).
            for path in ("/docs", "/openapi.json", "/-/routes", "/v1/models"):
                assert requests.get(f"{url}{path}", timeout=30).status_code == 401, (where, path)
                assert requests.get(f"{url}{path}", headers=AUTH, timeout=30).status_code == 200
            assert requests.get(f"{url}/healthz", timeout=30).status_code == 200
        with socket.create_connection(("127.0.0.1", port), timeout=30) as half:
            half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                         b"Content-Type: application/json\r\n\r\n0123456789")  # fmt: skip
            answer = b""  # headers and body may come in separate segments: read to the close
            while chunk := half.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
        # The connection guard too: headers not finished within --header-timeout-s.
        for where in (port, port + 1):
            with socket.create_connection(("127.0.0.1", where), timeout=30) as slow:
                sent = time.monotonic()
                slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                answer = b""
                while chunk := slow.recv(4096):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 408") and b"request headers" in answer, where
            assert b"within 2 s" in answer and time.monotonic() - sent < 8, (
                where
            )  # not the 10 s default
        # The replica and its decode process at niceness 0, not Ray's 15 for workers.
        served = {p: title for p, title in _descendants(proc.pid).items()
                  if "ServeReplica" in title or "spawn_main" in title}  # fmt: skip
        assert len(served) == 2, served
        assert {p: nice_of(p) for p in served} == dict.fromkeys(served, 0)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()[-3000:]


def _descendants(pid: int) -> dict[int, str]:
    """Every process under `pid`, with its command line."""
    procs = processes()
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (title, pp) in procs.items():
            if pp == parent and child not in found:
                found[child] = title
                frontier.append(child)
    return found
