"""The Ray Serve application: OpenAI-compatible completions and chat endpoints over
`hlm_ray.generate`.

    serve run deploy/serve.yaml                  # import_path: hlm_ray.serve.app:build_app
    hlm serve --model models:/hlm-tiny-generator/1 --port 8000

    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"prompt": "The cat", "max_tokens": 16, "temperature": 0}'
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="hlm-tiny-generator/1", prompt="The cat", max_tokens=16)
    client.completions.create(model=..., prompt="The cat", max_tokens=0, echo=True, logprobs=1)
    client.chat.completions.create(model=..., messages=[{"role": "user", "content": "Hi"}])

Routes: `POST /v1/completions` (JSON, or server-sent events with `stream: true`; echo, logprobs,
token-id prompts: `hlm_ray.serve.protocol`), `POST /v1/chat/completions` (the same over a simple
documented template, streamed as `chat.completion.chunk`s), `GET /v1/models` and
`GET /v1/models/{id}` (the served model and its source / MLflow URI, the chat template),
`GET /healthz` (with batching counters). Every response carries the model's id (`model` in the
body, `x-hlm-model` header).

Bad input is answered before any decoding, in OpenAI's error shape
(`{"error": {"message", "type", "param", "code"}}`, the message naming the field): 400 for
invalid JSON and for limits that depend on the model or the server (`max_tokens`, `n`, prompt
length in tokens against the model's positions, token ids against the vocabulary), 404
`model_not_found` for another model's id, 413 for a body over `max_body_bytes`, 422 for unknown
fields, wrong types and out-of-range values. Over `max_queued_requests` Serve itself answers 503.

Requests are batched continuously on the replica (`hlm_ray.serve.engine.DecodeLoop`): one decode
thread runs a batch of rows (prompts x n, up to `max_batch_size`), and the rows of requests that
arrive, streamed or not, join it at the next step, each with its own settings and seed; finished
rows leave, and so do the rows of a client that disconnects. The event loop only parses, queues
and answers, so it keeps accepting requests while the batch decodes.
One log line per request (`ray.serve` logger: id, status, latency, token counts), written in
batches when no request is in flight (`hlm_ray.serve.access_log`).
"""

# No `from __future__ import annotations` in this module: Serve reads `build_app`'s parameter
# annotation at run time to turn a config file's `args:` into `AppArgs`, which a string defeats.

import asyncio
import hmac
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve import Application
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from hlm_ray.errors import one_line
from hlm_ray.generate import (
    Generator,
    Row,
    check_generation_ready,
    default_model_name,
)
from hlm_ray.pretrained import REGISTRY_SCHEME, model_info, resolve_model_dir
from hlm_ray.serve.access_log import AccessLog
from hlm_ray.serve.decode_process import DecodeProcess
from hlm_ray.serve.engine import DecodeLoop, Job
from hlm_ray.serve.guard import error_body
from hlm_ray.serve.protocol import (
    CHAT_TEMPLATE,
    ApiError,
    chat_rows,
    check_model_id,
    completion_choice,
    completion_rows,
    parse_request,
    strip_reply,
    usage,
)
from hlm_ray.serve.schemas import (
    AppArgs,
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatCompletion,
    ChatDelta,
    ChatReply,
    ChatRequest,
    Choice,
    CompletionRequest,
    CompletionResponse,
    Health,
    ModelCard,
    ModelList,
    ModelQuery,
    Usage,
)

log = logging.getLogger("ray.serve")
# Bodies up to this size are parsed into rows on the event loop (a 4 KiB prompt tokenizes in well
# under a millisecond); bigger ones in a thread, so that a 1 MB prompt never stalls the loop.
INLINE_BODY_BYTES = 4096
SWITCH_INTERVAL_S = float(os.environ.get("HLM_SERVE_SWITCH_INTERVAL_S", "0.0005"))
api = FastAPI(title="hlm_ray completions", version="1")  # completions and chat


def _body_doc(model) -> dict[str, Any]:
    """The OpenAPI entry of a route that reads its body itself."""
    schema = model.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _ClientGone(Exception):
    """The client disconnected before its request was read."""


@api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """404 (no such route), 405 (wrong method) and friends in OpenAI's error shape."""
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(json.loads(error_body(exc.status_code, message)), exc.status_code)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(json.loads(error_body(422, str(exc.errors()[:1]))), 422)


class _CompletionRoutes:
    """ASGI middleware: `POST /v1/completions` and `/v1/chat/completions` handed straight to the
    replica's route methods, past FastAPI's router, dependency solver and exit stacks.

    Those cost about 0.1 ms per request, a third of the request path the replica's one event
    loop runs for every request (measured behind direct ingress with 32 kept-alive clients: a
    trivial FastAPI route took 10.8-12.0 ms per round of 32 requests, the same answer given
    here 7.3-7.4 ms). The FastAPI routes still declare both paths (OpenAPI, /docs) and run the
    same methods; errors other than the API's own still reach FastAPI's 500 handler."""

    ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.ROUTES.get(_route_path(scope))
            if route is not None:
                server = serve.get_replica_context().servable_object
                server.access_log.started()
                try:
                    response = await getattr(server, route)(Request(scope, receive))
                    await response(scope, receive, send)
                finally:
                    server.access_log.finished()
                return
        await self.app(scope, receive, send)


def _route_path(scope) -> str:
    """The path below the application's route prefix (Serve puts the prefix in `root_path`)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


api.add_middleware(_CompletionRoutes)


# Helpers the routes use are defined above the class: `serve.ingress` pickles the FastAPI app,
# with its routes' globals, when the class is decorated.
@serve.deployment(
    # Enough in flight on a replica for its batch to fill; beyond that requests wait in the
    # router's queue, and past max_queued_requests they are refused with 503.
    max_ongoing_requests=64,
    max_queued_requests=256,
    ray_actor_options={"num_cpus": 1},
    max_constructor_retry_count=2,  # a model that does not load will not load on retry 20
    # Our own line per request (id, status, latency, tokens) replaces Serve's access line.
    logging_config={"enable_access_log": False},
)
@serve.ingress(api)
class CompletionServer:
    def __init__(self, args: AppArgs):
        import torch
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.args = AppArgs.model_validate(args) if isinstance(args, dict) else args
        if self.args.num_threads:
            torch.set_num_threads(self.args.num_threads)
        # The decode thread releases the GIL in every torch op and must win it back, against the
        # event loop and the tokenizing threads, hundreds of times per step; at Python's default
        # 5 ms switch interval a busy event loop held it for whole steps (measured: steps took
        # twice as long on the replica as in process while requests arrived).
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.generator = Generator.load(
            self.args.model,
            device=self.args.device,
            allow_raw_head=self.args.allow_raw_head,
            name=self.args.name,
            # With a decode process, the replica only tokenizes and formats: the child alone
            # holds the model's weights.
            weights=not self.args.decode_process,
        )
        self.name = self.generator.name
        self.created = int(time.time())
        # Tokenizing a 1 MB prompt takes most of a second: never on the event loop, and not
        # behind the decoding thread either.
        self._prep_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prepare")
        key = self.args.api_key.get_secret_value() if self.args.api_key else None
        key = key or os.environ.get(self.args.api_key_env, "")
        self._api_key = key.encode() if key else None
        self._mlflow_uri = self.args.model if self.args.model.startswith(REGISTRY_SCHEME) else None
        if self.args.decode_process:
            self._engine = DecodeProcess(
                self.generator.info["path"],  # the local folder (a registry model downloaded)
                device=self.args.device,
                max_rows=self.args.max_batch_size,
                wait_s=self.args.batch_wait_timeout_s,
                allow_raw_head=self.args.allow_raw_head,
                name=self.name,
                num_threads=self.args.num_threads,
                switch_interval_s=SWITCH_INTERVAL_S,
            )
        else:
            self._engine = DecodeLoop(
                self.generator,
                max_rows=self.args.max_batch_size,
                wait_s=self.args.batch_wait_timeout_s,
            )
        self._requests = 0
        self.access_log = AccessLog(log)
        log.info(
            "serving %s (%s) from %s, %d positions, %s",
            self.name,
            self.args.model,
            self.generator.info.get("path"),
            self.generator.max_positions,
            "API key required" if self._api_key else "no API key",
        )

    # ------------------------------------------------------------------------- routes

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        if isinstance(self._engine, DecodeProcess):  # asks the child (a pipe round trip)
            loop = asyncio.get_running_loop()
            stats = dict(await loop.run_in_executor(self._prep_pool, self._engine.refresh_stats))
        else:
            stats = dict(self._engine.stats)
        stats["busy_s"], stats["busy_cpu_s"] = (
            round(stats["busy_s"], 4),
            round(stats["busy_cpu_s"], 4),
        )
        health = Health(model=self.name, requests=self._requests, **stats)
        return self._json(health.model_dump())

    def check_health(self) -> None:
        """Serve's periodic check: a replica whose decode process died is replaced."""
        if isinstance(self._engine, DecodeProcess) and not self._engine.alive:
            raise RuntimeError("the decode process exited: this replica cannot decode")

    def __del__(self) -> None:
        if hasattr(self, "access_log"):
            self.access_log.flush()
        if hasattr(self, "_engine"):
            self._engine.close()

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        if (denied := self._check_key(request)) is not None:
            return self._json(denied.body(), denied.status)
        return self._json(ModelList(data=[self._card()]).model_dump())

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> JSONResponse:
        """One model's card (ids hold a slash: `NAME/VERSION`); 404 `model_not_found`."""
        try:
            if (denied := self._check_key(request)) is not None:
                raise denied
            check_model_id(ModelQuery(model=model_id), self.name)
        except ApiError as err:
            return self._json(err.body(), err.status)
        return self._json(self._card().model_dump())

    def _card(self) -> ModelCard:
        info = self.generator.info
        return ModelCard(
            id=self.name,
            created=self.created,
            mlflow_uri=self._mlflow_uri,
            objective=info.get("objective"),
            finetuned=info.get("finetuned"),
            max_positions=self.generator.max_positions,
            chat_template=CHAT_TEMPLATE,
        )

    @api.post("/v1/completions", openapi_extra=_body_doc(CompletionRequest))
    async def completions(self, request: Request):
        return await self._answer(request, "cmpl", CompletionRequest, completion_rows)

    @api.post("/v1/chat/completions", openapi_extra=_body_doc(ChatRequest))
    async def chat_completions(self, request: Request):
        return await self._answer(request, "chatcmpl", ChatRequest, chat_rows)

    async def _answer(self, request: Request, prefix: str, model, make_rows):
        """Check, queue for a batch (or stream alone), answer: both completion routes."""
        start = time.perf_counter()
        rid = f"{prefix}-{os.urandom(12).hex()}"
        loop = asyncio.get_running_loop()
        try:
            if (denied := self._check_key(request)) is not None:
                raise denied
            body = await self._read_body(request)
            req = parse_request(body, model)
            if len(body) <= INLINE_BODY_BYTES:  # tokenized in microseconds: no thread hop
                rows, prompt_tokens = make_rows(req, self.generator, self.args)
            else:
                rows, prompt_tokens = await loop.run_in_executor(
                    self._prep_pool, make_rows, req, self.generator, self.args
                )
        except ApiError as err:
            return self._fail(rid, err, start)
        except _ClientGone:
            self._log(rid, 499, start, None, 0, stream=False, reason="client disconnected")
            return self._json(ApiError(400, "client disconnected").body(), 400)
        if req.stream:
            events = self._events(rid, req, rows, prompt_tokens, start)
            return StreamingResponse(events, media_type="text/event-stream", headers=self._headers)
        done = asyncio.Event()
        job = self._engine.submit(rows, lambda: loop.call_soon_threadsafe(done.set))
        try:
            await done.wait()
        except asyncio.CancelledError:  # the client went away: free its rows
            self._engine.cancel(job)
            raise
        if job.error is not None:  # a bug or the device failing, not the request: say so
            err = job.error
            log.error("completion %s failed: %s", rid, one_line(err, with_type=True), exc_info=err)
            message = f"generation failed for request {rid}: {one_line(err, with_type=True)}"
            return self._fail(rid, ApiError(500, message), start)
        if any(row.result.finish_reason == "timeout" for row in rows):
            return self._fail(rid, self._timeout_error(), start)
        if len(rows) == 1 and getattr(req, "logprobs", None) is None:
            body = self._body(rid, req, rows, prompt_tokens)  # one plain choice: inline
        else:  # logprobs of many rows take a while to format: not on the event loop
            body = await loop.run_in_executor(
                self._prep_pool, self._body, rid, req, rows, prompt_tokens
            )
        self._log(rid, 200, start, body.usage, len(rows), stream=False)
        # pydantic writes the JSON itself: no dict of the response, no json.dumps pass over it.
        return Response(
            body.model_dump_json(), media_type="application/json", headers=self._headers
        )

    def _body(self, rid: str, req, rows: list[Row], prompt_tokens: int):
        counts = usage(prompt_tokens, rows)
        common = {"id": rid, "created": int(time.time()), "model": self.name,
                  "usage": counts, "system_fingerprint": self._fingerprint}  # fmt: skip
        if isinstance(req, ChatRequest):
            choices = [
                ChatChoice(
                    index=i,
                    message=ChatReply(content=strip_reply(row.result.text, started=False)),
                    finish_reason=row.result.finish_reason,
                )
                for i, row in enumerate(rows)
            ]
            return ChatCompletion(choices=choices, **common)
        choices = [completion_choice(self.generator, row, i, req) for i, row in enumerate(rows)]
        return CompletionResponse(choices=choices, **common)

    # ------------------------------------------------------------------------- streaming

    async def _events(
        self, rid: str, req, rows: list[Row], prompt_tokens: int, start: float
    ) -> AsyncIterator[str]:
        """Server-sent events: one chunk per decoding step (`text_completion` or, for chat,
        `chat.completion.chunk` opened by a chunk with the role), then usage (if asked) and
        [DONE]."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        job = self._engine.submit(rows, lambda: loop.call_soon_threadsafe(wake.set), stream=True)
        chat = isinstance(req, ChatRequest)
        common = {"id": rid, "created": int(time.time()), "model": self.name,
                  "system_fingerprint": self._fingerprint}  # fmt: skip
        started: set[int] = set()  # chat choices whose reply has begun
        status = 200
        try:
            if chat:
                opening = [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                           for i in range(len(rows))]  # fmt: skip
                yield _sse(ChatChunk(choices=opening, **common).model_dump())
            async for deltas in self._steps(job, wake):
                if any(d.finish_reason == "timeout" for d in deltas):
                    status = 504
                    yield _sse(self._timeout_error().body())
                    break
                if not chat:
                    choices = [Choice(text=d.text, index=d.index, finish_reason=d.finish_reason)
                               for d in deltas]  # fmt: skip
                    yield _sse(CompletionResponse(choices=choices, **common).model_dump())
                    continue
                pieces = []
                for d in deltas:
                    text = strip_reply(d.text, started=d.index in started)
                    if text:
                        started.add(d.index)
                    if text or d.finish_reason:
                        delta = ChatDelta(content=text or None)
                        pieces.append(ChatChunkChoice(index=d.index, delta=delta,
                                                      finish_reason=d.finish_reason))  # fmt: skip
                if pieces:
                    yield _sse(ChatChunk(choices=pieces, **common).model_dump())
            if status == 200 and req.stream_options and req.stream_options.include_usage:
                kind = ChatChunk if chat else CompletionResponse
                counts = usage(prompt_tokens, rows)
                yield _sse(kind(choices=[], usage=counts, **common).model_dump())
            yield "data: [DONE]\n\n"
        except Exception as err:
            status = 500
            log.exception("completion %s failed", rid)
            message = f"generation failed for request {rid}: {one_line(err, with_type=True)}"
            yield _sse(ApiError(500, message).body())
        finally:
            if not job.done:  # a client that went away (or a timeout): its rows leave
                self._engine.cancel(job)
            done = [row for row in rows if row.result is not None]
            self._log(rid, status, start, usage(prompt_tokens, done), len(rows), stream=True)

    @staticmethod
    async def _steps(job: Job, wake: asyncio.Event) -> AsyncIterator[list]:
        """A streamed job's deltas, one list per decoding step, as the decode thread hands
        them over; raises the job's error."""
        while True:
            await wake.wait()
            wake.clear()
            finished = job.done  # set after the job's last deltas were queued
            while job.events:
                yield job.events.popleft()
            if job.error is not None:
                raise job.error
            if finished:
                return

    # ------------------------------------------------------------------------- validation

    def _check_key(self, request: Request) -> ApiError | None:
        """401 unless the request carries the API key (when one is set), compared in constant
        time."""
        if self._api_key is None:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self._api_key
        ):
            return None
        return ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")

    async def _read_body(self, request: Request) -> bytes:
        limit = self.args.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}")
        try:
            async with asyncio.timeout(self.args.body_timeout_s):  # a timer, not a task
                body = await request.body()
        except ClientDisconnect:
            raise _ClientGone from None
        except TimeoutError:
            timeout = self.args.body_timeout_s
            raise ApiError(408, f"request body not received in {timeout:g} s") from None
        if len(body) > limit:
            raise ApiError(413, f"request body is {len(body)} bytes; the limit is {limit}")
        return body

    def _timeout_error(self) -> ApiError:
        return ApiError(504, f"generation took longer than {self.args.request_timeout_s} s")

    # ------------------------------------------------------------------------- responses, logs

    @property
    def _fingerprint(self) -> str:
        """Which weights answer: the registry URI when there is one, else the served name."""
        return self._mlflow_uri or self.name

    @property
    def _headers(self) -> dict[str, str]:
        return {"x-hlm-model": self.name}

    def _json(self, body: dict[str, Any], status: int = 200) -> JSONResponse:
        return JSONResponse(body, status_code=status, headers=self._headers)

    def _fail(self, rid: str, err: ApiError, start: float) -> JSONResponse:
        self._log(rid, err.status, start, None, 0, stream=False, reason=err.message)
        return self._json(err.body(), err.status)

    def _log(
        self,
        rid: str,
        status: int,
        start: float,
        usage: Usage | None,
        rows: int,
        *,
        stream: bool,
        reason: str = "",
    ) -> None:
        self._requests += 1
        self.access_log.add(
            rid,
            status,
            (time.perf_counter() - start) * 1000,
            usage.prompt_tokens if usage else 0,
            usage.completion_tokens if usage else 0,
            rows,
            stream,
            self.name,
            f" error={reason!r}" if reason else "",
        )


# ----------------------------------------------------------------------------- builders


def check_model(args: AppArgs) -> None:
    """Fail fast, with the reason, when the model does not resolve or cannot generate (before
    any replica starts: a `models:/` URI that does not exist, an encoder, a headless decoder)."""
    folder = resolve_model_dir(args.model)
    check_generation_ready(model_info(folder), args.model, allow_raw_head=args.allow_raw_head)


def build_app(args: AppArgs) -> Application:
    """The application a Serve config file names (`import_path: hlm_ray.serve.app:build_app`);
    Serve validates the file's `args:` into `AppArgs`. Deployment options (replicas,
    autoscaling, resources, queue limits) come from the file's `deployments:` section."""
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    check_model(args)
    return CompletionServer.bind(args)


def make_app(
    args: AppArgs,
    *,
    num_replicas: int | str | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    max_ongoing_requests: int | None = None,
    max_queued_requests: int | None = None,
    name: str | None = None,
) -> Application:
    """`build_app` with deployment options given in code (what `hlm serve` and tests use);
    None keeps the deployment's default."""
    check_model(args)
    actor = dict(CompletionServer.ray_actor_options or {})
    if num_cpus is not None:
        actor["num_cpus"] = num_cpus
    if num_gpus is not None:
        actor["num_gpus"] = num_gpus
    options: dict[str, Any] = {
        "num_replicas": num_replicas,
        "autoscaling_config": autoscaling_config,
        "max_ongoing_requests": max_ongoing_requests,
        "max_queued_requests": max_queued_requests,
        "name": name,
    }
    options = {k: v for k, v in options.items() if v is not None}
    return CompletionServer.options(ray_actor_options=actor, **options).bind(args)


def model_name(args: AppArgs) -> str:
    """The id the app serves its model under."""
    return args.name or default_model_name(args.model)
