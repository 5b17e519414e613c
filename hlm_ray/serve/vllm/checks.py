"""What the vLLM application's ingress checks before a request reaches vLLM: the API key on
every route (`KeyCheck`) and JSON bodies that vLLM's OpenAI layer would answer with a 500
(`BodyCheck`); and every error it answers in OpenAI's shape (`ErrorShape`). Pure ASGI
middlewares.

Fuzzing Ray Serve LLM 2.60 with vLLM 0.32 (tests/test_serve_vllm.py) found four bodies that
became HTTP 500 inside the server: a string with a lone UTF-16 surrogate (`"\\ud800"`, which
JSON allows and UTF-8 cannot encode), `1e999` (infinity; so are NaN and Infinity), and
integers past int64 (`"top_k": 10**40`). `BodyCheck` refuses each with 400 naming the field,
and a body that is not JSON at all with 400 in OpenAI's shape (vLLM's own is FastAPI's
`{"detail": ...}`); everything else is vLLM's to judge.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from hlm_ray.serve.error_shape import error_body
from hlm_ray.serve.guard import bearer_matches

INT64 = 2**63 - 1


class KeyCheck:
    """Every route needs `Authorization: Bearer KEY` when there is a key (`key`, else the
    replica's environment variable `env`): 401 otherwise, compared in constant time by
    `hlm_ray.serve.guard.bearer_matches` as the in-house server compares it."""

    def __init__(self, app, env: str, key: str | None = None) -> None:
        self.app = app
        key = key or os.environ.get(env, "")
        self.key = key.encode() if key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.key is not None:
            given = dict(scope.get("headers", ())).get(b"authorization", b"")
            if not bearer_matches(given.decode("latin-1"), self.key):
                message = "missing or wrong API key: send 'Authorization: Bearer KEY'"
                await answer(send, 401, message)
                return
        await self.app(scope, receive, send)


class BodyCheck:
    """JSON POST bodies are parsed strictly first: 400 for one that is not JSON, a string vLLM
    cannot encode, a number that is not finite, an integer past int64 (`problem`). The body,
    already read whole by the proxy's guard, is then handed on unchanged."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        ctype = dict(scope.get("headers", ())).get(b"content-type", b"application/json")
        if scope["type"] != "http" or scope.get("method") != "POST" or b"json" not in ctype:
            await self.app(scope, receive, send)
            return
        chunks, more, message = [], True, None
        while more:
            message = await receive()
            if message["type"] != "http.request":  # gone: let the app hear it
                break
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        found = problem(body) if message and message["type"] == "http.request" else None
        if found is not None:
            await answer(send, 400, found)
            return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                if message is not None and message["type"] != "http.request":
                    return message
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def problem(body: bytes) -> str | None:
    """What in a JSON body vLLM would answer with a 500, or a body that is not JSON (which
    vLLM answers 400 outside OpenAI's error shape); None: nothing."""

    def no_constant(name: str) -> Any:
        raise _Bad(f"{name} is not a number JSON allows here; send a finite number")

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise _Bad(f"{text} is not a finite number; send one")
        return value

    try:
        data = json.loads(body, parse_constant=no_constant, parse_float=finite)
    except _Bad as err:
        return f"request body: {err}"
    except RecursionError:
        return "request body: nested too deeply"
    except ValueError as err:  # vLLM answers these 400 too, but as FastAPI's {"detail": ...}
        return f"request body is not valid JSON: {str(err)[:200]}"
    try:
        return _walk(data, "body")
    except RecursionError:
        return "request body: nested too deeply"


def _walk(value: Any, where: str) -> str | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{where}: a string with a lone UTF-16 surrogate (\\ud800-\\udfff); send valid Unicode"
        return None
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and not -INT64 - 1 <= value <= INT64:
        return f"{where}: {str(value)[:20]}... is past the 64-bit integer range"
    if isinstance(value, dict):
        for key, item in value.items():
            found = _walk(key, f"{where} key") or _walk(item, f"{where}.{key}"[:120])
            if found:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _walk(item, f"{where}[{i}]")
            if found:
                return found
    return None


class ErrorShape:
    """Every error the ingress answers in OpenAI's shape, `{"error": {"message", "type",
    "param", "code"}}`: FastAPI's own (`{"detail": ...}`: 404 for a model not served, 405, a
    route's HTTPException) are rewritten; bodies already in that shape pass unchanged."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] = {}

        async def wrapped(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held["start"], held["chunks"] = message, []
                return
            if "start" in held and message["type"] == "http.response.body":
                held["chunks"].append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                start, body = held.pop("start"), b"".join(held.pop("chunks"))
                status, rewritten = start["status"], _openai_shape(start["status"], body)
                if rewritten is None:
                    await send(start)
                    await send({"type": "http.response.body", "body": body})
                    return
                await answer(send, status, rewritten)
                return
            await send(message)

        await self.app(scope, receive, wrapped)


def _openai_shape(status: int, body: bytes) -> str | None:
    """The message of an error body not in OpenAI's shape (None: it is, leave it)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip() or f"HTTP {status}"
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return None
    detail = data.get("detail", data) if isinstance(data, dict) else data
    return detail if isinstance(detail, str) else json.dumps(detail)[:500]


class _Bad(ValueError):
    pass


async def answer(send, status: int, message: str) -> None:
    body = error_body(status, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
