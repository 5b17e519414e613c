"""The ASGI side of the completions server: the FastAPI app its routes hang on, errors in
OpenAI's shape, the fast dispatch of the two completion routes, the API key and the body.

    from hlm_ray.serve.routes import api, check_key, read_body
    @serve.ingress(api)
    class CompletionServer: ...                  # hlm_ray.serve.server declares the routes

Bad input is answered in OpenAI's error shape (`{"error": {"message", "type", "param",
"code"}}`): 404/405 for a route that does not exist, 422 for a body FastAPI rejects, 401 for a
missing or wrong key, 408 for a body not received in time, 413 for one over the limit.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from hlm_ray.serve.error_shape import error_body
from hlm_ray.serve.guard import bearer_matches
from hlm_ray.serve.protocol import ApiError

api = FastAPI(title="hlm_ray completions", version="1")  # completions and chat


class ClientGone(Exception):
    """The client disconnected before its request was read."""


def body_doc(model) -> dict[str, Any]:
    """The OpenAPI entry of a route that reads its body itself."""
    schema = model.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


@api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """404 (no such route), 405 (wrong method) and friends in OpenAI's error shape."""
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(json.loads(error_body(exc.status_code, message)), exc.status_code)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(json.loads(error_body(422, str(exc.errors()[:1]))), 422)


class CompletionRoutes:
    """ASGI middleware: `POST /v1/completions` and `/v1/chat/completions` handed straight to the
    replica's route methods, past FastAPI's router, dependency solver and exit stacks.

    Those cost about 0.1 ms per request, a third of the request path the replica's one event
    loop runs for every request (measured behind direct ingress with 32 kept-alive clients: a
    trivial FastAPI route took 10.8-12.0 ms per round of 32 requests, the same answer given
    here 7.3-7.4 ms). The FastAPI routes still declare both paths (OpenAPI, /docs) and run the
    same methods; errors other than the API's own still reach FastAPI's 500 handler."""

    ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}
    OPEN = frozenset({"/healthz"})  # probes need no key

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path = route_path(scope)
            server = serve.get_replica_context().servable_object
            route = self.ROUTES.get(path) if scope["method"] == "POST" else None
            if route is not None:  # the route checks the key itself, with its request id
                server.access_log.started()
                try:
                    response = await getattr(server, route)(Request(scope, receive))
                    await response(scope, receive, send)
                finally:
                    server.access_log.finished()
                return
            # Every other route but the probe's needs the key too: /v1/models, FastAPI's
            # /docs and /openapi.json, and paths that do not exist (401 before 404).
            if path not in self.OPEN:
                denied = check_key(server._api_key, Request(scope))
                if denied is not None:
                    await JSONResponse(denied.body(), denied.status)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def route_path(scope) -> str:
    """The path below the application's route prefix (Serve puts the prefix in `root_path`)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


api.add_middleware(CompletionRoutes)


def check_key(api_key: bytes | None, request: Request) -> ApiError | None:
    """401 unless the request carries `api_key` (when one is set), compared in constant time."""
    if api_key is None or bearer_matches(request.headers.get("authorization", ""), api_key):
        return None
    return ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body: 413 over `limit` bytes (declared or sent), 408 when it takes longer than
    `timeout_s` (the proxy's guard usually answers first), `ClientGone` when the client left."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}")
    try:
        async with asyncio.timeout(timeout_s):  # a timer, not a task
            body = await request.body()
    except ClientDisconnect:
        raise ClientGone from None
    except TimeoutError:
        raise ApiError(408, f"request body not received in {timeout_s:g} s") from None
    if len(body) > limit:
        raise ApiError(413, f"request body is {len(body)} bytes; the limit is {limit}")
    return body
