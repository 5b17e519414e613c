"""The proxy's guard: a pure ASGI middleware that Ray Serve's HTTP proxy runs in front of every
application, so that slow, idle and oversized clients never reach (and never hold) a replica.

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=hlm_ray.serve.guard:proxy_middlewares \\
        serve run deploy/serve.yaml          # `hlm serve` sets it for the Serve it starts
    serve.start(..., controller_options=guard_controller_options())   # the same from code

Ray's proxy forwards a request to a replica as soon as its headers arrive and the replica then
pulls the body from the proxy: a client that sends `Content-Length: 100` and 10 bytes holds one
of the replica's `max_ongoing_requests` slots for as long as it likes. The guard reads the
whole body in the proxy first, within `HLM_SERVE_BODY_TIMEOUT_S` (default 10 s; 408 and the
connection closed when it runs out) and `HLM_SERVE_MAX_BODY_BYTES` (default 1 MiB; 413), and
only then passes the request on. A client that goes away while sending is logged as such.

It also gives every error the proxy itself answers (503 over the queue limit, 404 for a route no
application serves, 500) OpenAI's error shape, `{"error": {"message", "type", "param",
"code"}}`, instead of Serve's plain text. Idle keep-alive connections are closed by uvicorn
after `http_options.keep_alive_timeout_s`; headers are bounded in size by h11 (16 KiB) and in
time, with the number of connections, by `hlm_ray.serve.connections`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from typing import Any

from hlm_ray.serve import connections
from hlm_ray.serve.error_shape import error_body

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "hlm_ray.serve.guard:proxy_middlewares"
BODY_TIMEOUT_ENV = "HLM_SERVE_BODY_TIMEOUT_S"
MAX_BODY_ENV = "HLM_SERVE_MAX_BODY_BYTES"
API_KEY_ENV = "HLM_API_KEY"  # Serve's own /-/ routes need it too, where it is set
DEFAULT_BODY_TIMEOUT_S = 10.0
DEFAULT_MAX_BODY_BYTES = 1 << 20

log = logging.getLogger("ray.serve")


class BodyGuard:
    """ASGI middleware: buffer the request body under a deadline and a size limit, then call
    the app with the buffered body; rewrite plain-text error responses into OpenAI's shape."""

    def __init__(self, app, body_timeout_s: float | None = None, max_body_bytes: int | None = None):
        self.app = app
        env = os.environ
        self.body_timeout_s = body_timeout_s or float(
            env.get(BODY_TIMEOUT_ENV, DEFAULT_BODY_TIMEOUT_S)
        )
        self.max_body_bytes = max_body_bytes or int(env.get(MAX_BODY_ENV, DEFAULT_MAX_BODY_BYTES))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path.startswith("/-/") and path != "/-/healthz" and not self._key_ok(scope):
            await _answer(send, 401, "missing or wrong API key: send 'Authorization: Bearer KEY'")
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _answer(send, 413, f"request body is {declared} bytes; the limit is "
                          f"{self.max_body_bytes}", close=True)  # fmt: skip
            return
        try:
            # A timer, not a task (Python 3.11's `wait_for` wraps the read in one): a body
            # already received is read without leaving this task, so a request of a burst
            # goes on to Serve in the same turn of the event loop, not after the rest's reads.
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read(receive)
        except TimeoutError:
            log.info("client on %s sent no complete body in %.0f s: 408", path, self.body_timeout_s)
            await _answer(
                send, 408, f"the request body was not received within {self.body_timeout_s:g} s",
                close=True,
            )  # fmt: skip
            return
        except _Disconnected:
            log.info("client disconnected while sending its request to %s", path)
            return
        except _TooLarge as err:
            await _answer(send, 413, str(err), close=True)
            return
        await self.app(scope, _replay(body, receive), _openai_errors(send))

    def _key_ok(self, scope) -> bool:
        """Serve's own routes (`/-/routes`, which lists the applications) need the key the
        replicas need, when this process has one in `$HLM_API_KEY` (`hlm serve` and the
        RayService put it there); `/-/healthz` stays open for probes."""
        key = os.environ.get(API_KEY_ENV, "")
        return not key or bearer_matches(_header(scope, b"authorization") or "", key.encode())

    async def _read(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge(f"request body is over {self.max_body_bytes} bytes (the limit)")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _Disconnected(Exception):
    pass


class _TooLarge(Exception):
    pass


def bearer_matches(authorization: str, key: bytes) -> bool:
    """Whether an `Authorization` header value is `Bearer <key>`, compared in constant time
    (the replica's routes and this guard's /-/ routes check the key the same way). The scheme's
    case and whitespace around the key do not matter; anything else about the key does, and an
    empty `key` matches nothing."""
    scheme, _, given = authorization.partition(" ")
    given_ok = hmac.compare_digest(given.strip().encode(), key)
    return bool(key) and scheme.lower() == "bearer" and given_ok


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _replay(body: bytes, receive):
    """A `receive` that gives the buffered body once, then waits on the client (disconnects)."""
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _openai_errors(send):
    """A `send` that turns an error answered in plain text (Serve's own 503/404/500) into
    OpenAI's error shape; JSON errors (the app's) pass unchanged."""
    state: dict[str, Any] = {}

    async def wrapped(message) -> None:
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", ()))
            ctype = headers.get(b"content-type", b"")
            if message["status"] >= 400 and not ctype.startswith(b"application/json"):
                state["start"], state["chunks"] = message, []
                return
        if "start" in state and message["type"] == "http.response.body":
            state["chunks"].append(message.get("body", b""))
            if message.get("more_body", False):
                return
            start = state.pop("start")
            text = b"".join(state.pop("chunks")).decode(errors="replace").strip()
            status = start["status"]
            body = error_body(status, text or _REASONS.get(status, f"HTTP {status}"))
            kept = [(k, v) for k, v in start.get("headers", ())
                    if k.lower() not in (b"content-type", b"content-length")]  # fmt: skip
            kept += [(b"content-type", b"application/json"),
                     (b"content-length", str(len(body)).encode())]  # fmt: skip
            await send({**start, "headers": kept})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await send(message)

    return wrapped


_REASONS = {404: "not found", 405: "method not allowed", 503: "the server is overloaded"}


async def _answer(send, status: int, message: str, *, close: bool = False) -> None:
    body = error_body(status, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def proxy_middlewares() -> list:
    """What `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` names: the proxy's middlewares. Serve
    calls it just before it starts an HTTP server, so the connection guard
    (`hlm_ray.serve.connections`: header deadline, connection limits) is installed here too."""
    from starlette.middleware import Middleware

    connections.install()
    return [Middleware(BodyGuard)]


def guard_env(
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    api_key: str | None = None,
    **limits,
) -> dict[str, str]:
    """Environment that installs the guard in the proxies Serve starts; `limits` are the
    connection guard's (`connections.Limits` fields: header_timeout_s, max_connections,
    per_client); `api_key` guards Serve's /-/ routes (`hlm serve` passes it through the
    environment Ray inherits instead: runtime-env variables show in Ray's dashboard)."""
    env = {
        CALLBACK_ENV: CALLBACK,
        BODY_TIMEOUT_ENV: f"{body_timeout_s:g}",
        MAX_BODY_ENV: str(max_body_bytes),
        **connections.Limits(**limits).env(),
    }
    return env | ({API_KEY_ENV: api_key} if api_key else {})


def guard_controller_options(**kwargs) -> dict[str, Any]:
    """`serve.start(controller_options=...)`: the controller passes its environment to the
    proxies it creates, so they load the guard."""
    return {"runtime_env": {"env_vars": guard_env(**kwargs)}}
