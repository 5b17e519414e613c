"""The proxy's guard (`hlm_ray.serve.guard.BodyGuard`) as plain ASGI: scopes, `receive` and
`send` made here, an app that records what reached it. No Ray, no socket: what test_serve.py
checks end to end over HTTP (the key on /-/routes, 408, 413, Serve's errors in OpenAI's shape),
here one rule at a time."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from hlm_ray.serve import guard
from hlm_ray.serve.guard import BodyGuard

KEY = "guard-key-42"


class App:
    """An ASGI app that reads the whole body, records it, and answers `status` with `body` in
    `chunks` pieces (plain text unless `ctype` says otherwise)."""

    def __init__(self, status=200, body=b"ok", ctype=b"text/plain", chunks=1, upper=False):
        self.status, self.body, self.ctype, self.chunks = status, body, ctype, chunks
        self.upper = upper
        self.seen: list[tuple[str, bytes]] = []

    async def __call__(self, scope, receive, send):
        body = b""
        if scope["type"] == "http":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        self.seen.append((scope.get("path", scope["type"]), body))
        if scope["type"] != "http":
            return
        headers = [(b"content-type", self.ctype), (b"x-kept", b"1")]
        headers.append((b"content-length", str(len(self.body)).encode()))
        if self.upper:  # as some servers send them: the guard replaces them all the same
            headers = [(name.title(), value) for name, value in headers]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        size = -(-len(self.body) // self.chunks) or 1
        pieces = [self.body[i : i + size] for i in range(0, len(self.body), size)] or [b""]
        for i, piece in enumerate(pieces):
            more = i < len(pieces) - 1
            await send({"type": "http.response.body", "body": piece, "more_body": more})


def call(app, path="/v1/completions", messages=None, headers=(), scope_type="http", **limits):
    """Run the guard around `app` on one request (`messages` from the client: an empty body
    unless given); returns (status, headers, body) of what it sent (status None: nothing) and
    the messages `receive` had left."""
    scope = {"type": scope_type, "path": path, "headers": [(k.lower(), v) for k, v in headers]}
    queue = list(body_of(b"") if messages is None else messages)
    sent: list[dict] = []

    async def receive():
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)  # a client that sends nothing more

    async def send(message):
        sent.append(message)

    if path is None:
        del scope["path"]
    asyncio.run(BodyGuard(app, **limits)(scope, receive, send))
    starts = [m for m in sent if m["type"] == "http.response.start"]
    if not starts:
        return None, {}, b"", queue
    # A valid response: one start, each header once, the last body message says so.
    assert len(starts) == 1 and sent[0] is starts[0]
    names = [name for name, _ in starts[0]["headers"]]
    lower = [n.lower() for n in names]
    assert len(lower) == len(set(lower)), names  # no header twice, in any case
    if starts[0]["status"] >= 400:  # an error the guard wrote or rewrote: its own names
        assert {b"content-type", b"content-length"} <= set(names), names
        assert dict(starts[0]["headers"])[b"content-type"] == b"application/json"
    bodies = sent[1:]
    assert bodies and all(m["type"] == "http.response.body" for m in bodies)
    assert bodies[-1]["more_body"] is False and all(m["more_body"] for m in bodies[:-1])
    body = b"".join(m["body"] for m in bodies)
    return starts[0]["status"], dict(starts[0]["headers"]), body, queue


@pytest.fixture
def serve_log(caplog):
    """The guard's log lines: Ray's "ray.serve" logger does not propagate once Ray Serve is
    imported, so the capture handler goes on it directly."""
    logger = logging.getLogger("ray.serve")
    old = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # each line once, imported Ray or not
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.level, logger.propagate = old


def body_of(data: bytes, pieces: int = 1) -> list[dict]:
    size = -(-len(data) // pieces) or 1
    parts = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
    return [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
            for i, p in enumerate(parts)]  # fmt: skip


def error_of(body: bytes) -> dict:
    return json.loads(body)["error"]


def test_the_app_gets_the_whole_body_once_then_the_clients_messages():
    app = App()
    status, headers, body, left = call(app, messages=[*body_of(b"0123456789", 3), "later"])
    assert (status, body, app.seen) == (200, b"ok", [("/v1/completions", b"0123456789")])
    assert headers[b"content-type"] == b"text/plain" and headers[b"x-kept"] == b"1"
    assert left == ["later"]  # read no further than the body

    async def replayed():  # after the body, the app's receive is the client's own
        client = iter([{"type": "http.disconnect"}])

        async def receive():
            return next(client)

        replay = guard._replay(b"abc", receive)
        return [await replay(), await replay()]

    first, second = asyncio.run(replayed())
    assert first == {"type": "http.request", "body": b"abc", "more_body": False}
    assert second == {"type": "http.disconnect"}


def test_other_scopes_pass_untouched():
    app = App()
    assert call(app, scope_type="lifespan")[0] is None
    assert app.seen == [("/v1/completions", b"")]  # reached the app, nothing read or sent
    got = []

    async def app_of_its_own(scope, receive, send):
        got.append((receive, send))

    async def receive():
        return {}

    async def send(message):
        pass

    asyncio.run(BodyGuard(app_of_its_own)({"type": "websocket"}, receive, send))
    assert got == [(receive, send)]  # the client's own channels, not wrapped


def test_a_scope_or_message_without_optional_keys_is_read_as_empty():
    """ASGI's optional keys: no path, no headers, a body message without body or more_body
    (the end of the body); a response start without headers, body messages without them."""
    app = App()
    scope = {"type": "http"}

    async def receive():
        return {"type": "http.request"}

    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(BodyGuard(app)(scope, receive, send))
    assert app.seen == [("http", b"")] and sent[0]["status"] == 200
    assert call(App(), path=None)[0] == 200

    async def bare_error(scope, receive, send):
        await send({"type": "http.response.start", "status": 404})
        await send({"type": "http.response.body", "body": b"gone", "more_body": True})
        await send({"type": "http.response.body"})

    status, headers, body, _ = call(bare_error)
    assert (status, error_of(body)["message"]) == (404, "gone")
    assert headers[b"content-type"] == b"application/json"


@pytest.mark.parametrize(("declared", "status"), [(b"11", 413), (b"10", 200), (b"x", 200)])
def test_a_declared_length_over_the_limit_is_413_before_any_read(declared, status):
    app = App()
    got, headers, body, left = call(
        app, headers=[(b"Content-Length", declared)], messages=body_of(b"0123456789"),
        max_body_bytes=10,
    )  # fmt: skip
    assert got == status
    if status == 413:
        assert app.seen == [] and len(left) == 1  # nothing read
        assert headers[b"connection"] == b"close"
        assert error_of(body)["code"] == "request_too_large"
        assert error_of(body)["message"] == "request body is 11 bytes; the limit is 10"
        assert headers[b"content-length"] == str(len(body)).encode()


def test_a_body_that_grows_past_the_limit_is_413():
    app = App()
    status, headers, body, _ = call(app, messages=body_of(b"x" * 11, 4), max_body_bytes=10)
    assert (status, app.seen) == (413, [])
    assert error_of(body)["message"] == "request body is over 10 bytes (the limit)"
    assert headers[b"connection"] == b"close"
    assert call(App(), messages=body_of(b"x" * 10, 4), max_body_bytes=10)[0] == 200


def test_a_body_not_received_in_time_is_408_and_closed(serve_log):
    app = App()
    status, headers, body, _ = call(
        app, messages=body_of(b"01234", 2)[:1], body_timeout_s=0.05
    )  # half a body, then nothing
    assert (status, app.seen) == (408, [])
    assert error_of(body)["message"] == "the request body was not received within 0.05 s"
    assert "client on /v1/completions sent no complete body in 0 s: 408" in serve_log.messages
    assert error_of(body)["type"] == "invalid_request_error"
    assert headers[b"connection"] == b"close"


def test_a_client_that_leaves_mid_body_gets_nothing_and_reaches_no_app(serve_log):
    app = App()
    messages = [*body_of(b"01234", 2)[:1], {"type": "http.disconnect"}]
    assert call(app, messages=messages)[0] is None and app.seen == []
    assert serve_log.messages == [
        "client disconnected while sending its request to /v1/completions"
    ]


def test_after_the_body_the_app_hears_the_client_leave():
    heard = []

    async def app(scope, receive, send):
        heard.append(await receive())  # the buffered body
        heard.append(await receive())  # then the client's own next message

    call(app, messages=[*body_of(b"abc"), {"type": "http.disconnect"}])
    assert heard == [{"type": "http.request", "body": b"abc", "more_body": False},
                     {"type": "http.disconnect"}]  # fmt: skip


def test_limits_come_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv(guard.BODY_TIMEOUT_ENV, "2.5")
    monkeypatch.setenv(guard.MAX_BODY_ENV, "123")
    from_env = BodyGuard(App())
    assert (from_env.body_timeout_s, from_env.max_body_bytes) == (2.5, 123)
    given = BodyGuard(App(), body_timeout_s=1.0, max_body_bytes=7)
    assert (given.body_timeout_s, given.max_body_bytes) == (1.0, 7)
    monkeypatch.delenv(guard.BODY_TIMEOUT_ENV)
    monkeypatch.delenv(guard.MAX_BODY_ENV)
    default = BodyGuard(App())
    assert (default.body_timeout_s, default.max_body_bytes) == (10.0, 1 << 20)


def test_serves_own_routes_need_the_key_when_there_is_one(monkeypatch):
    monkeypatch.setenv(guard.API_KEY_ENV, KEY)
    auth = [(b"Authorization", f"Bearer {KEY}".encode())]
    for path in ("/-/routes", "/-/anything"):
        for headers in ([], [(b"Authorization", b"Bearer ")], [(b"Authorization", KEY.encode())]):
            app = App()
            status, answered, body, _ = call(app, path=path, headers=headers)
            assert (status, app.seen) == (401, []), (path, headers)
            assert b"connection" not in answered  # the connection may serve the next request
            assert error_of(body)["code"] == "invalid_api_key"
            assert error_of(body)["message"] == (
                "missing or wrong API key: send 'Authorization: Bearer KEY'"
            )
        assert call(App(), path=path, headers=auth)[0] == 200
    assert call(App(), path="/-/healthz")[0] == 200  # the probes' route stays open
    assert call(App(), path="/v1/models")[0] == 200  # the replica checks its own routes
    monkeypatch.setenv(guard.API_KEY_ENV, "")
    assert call(App(), path="/-/routes")[0] == 200  # no key set: no check
    monkeypatch.delenv(guard.API_KEY_ENV)
    assert call(App(), path="/-/routes")[0] == 200


def test_plain_text_errors_are_rewritten_in_openais_shape_json_ones_pass():
    for chunks in (1, 3):
        app = App(status=503, body=b"  Service Unavailable: queue full \n", chunks=chunks)
        app.upper = chunks == 3
        status, headers, body, _ = call(app)
        assert status == 503
        assert error_of(body) == {"message": "Service Unavailable: queue full",
                                  "type": "server_error", "param": None,
                                  "code": "server_overloaded"}  # fmt: skip
        assert headers[b"content-type"] == b"application/json"
        assert headers[b"content-length"] == str(len(body)).encode()
        assert headers[b"x-kept" if chunks == 1 else b"X-Kept"] == b"1"  # others are kept
    app = App(status=400, body=b"bad \xff request", chunks=2)  # not UTF-8: replaced
    app.ctype = b"text/plain; charset=latin-1"
    status, headers, body, _ = call(app)
    assert (status, error_of(body)["message"]) == (400, "bad \ufffd request")
    assert b"connection" not in headers  # the app's error keeps the connection
    for status, reason in ((404, "not found"), (405, "method not allowed"),
                           (503, "the server is overloaded"), (502, "HTTP 502")):  # fmt: skip
        got, _, body, _ = call(App(status=status, body=b""))
        assert (got, error_of(body)["message"]) == (status, reason)
    app_error = json.dumps({"error": {"message": "bad top_k"}}).encode()
    app = App(status=422, body=app_error, ctype=b"application/json")
    assert call(app)[2] == app_error  # the app's own JSON errors pass unchanged
    assert call(App(status=200, body=b"plain"))[2] == b"plain"  # not an error
    assert call(App(status=399, body=b"plain"))[2] == b"plain"


def test_the_proxy_installs_the_guard_and_the_environment_names_it():
    from starlette.middleware import Middleware

    [middleware] = guard.proxy_middlewares()
    assert isinstance(middleware, Middleware) and middleware.cls is BodyGuard
    env = guard.guard_env(body_timeout_s=2.5, max_body_bytes=99)
    assert env[guard.CALLBACK_ENV] == "hlm_ray.serve.guard:proxy_middlewares"
    assert (env[guard.BODY_TIMEOUT_ENV], env[guard.MAX_BODY_ENV]) == ("2.5", "99")
    assert guard.API_KEY_ENV not in env
    assert guard.guard_env(api_key="k")[guard.API_KEY_ENV] == "k"
    defaults = guard.guard_env()
    assert (defaults[guard.BODY_TIMEOUT_ENV], defaults[guard.MAX_BODY_ENV]) == ("10", "1048576")
    options = guard.guard_controller_options(max_body_bytes=5)
    assert options == {"runtime_env": {"env_vars": guard.guard_env(max_body_bytes=5)}}
