"""The Ray Serve deployment: `CompletionServer`, one replica of the OpenAI-compatible
completions and chat endpoints over `hlm_ray.generate`.

    from hlm_ray.serve.server import CompletionServer
    serve.run(CompletionServer.bind(AppArgs(model="runs/tiny-gen")))   # or hlm_ray.serve.app

Routes: `POST /v1/completions` (JSON, or server-sent events with `stream: true`; echo, logprobs,
token-id prompts: `hlm_ray.serve.protocol`), `POST /v1/chat/completions` (the same over a simple
documented template, streamed as `chat.completion.chunk`s: `hlm_ray.serve.streaming`),
`GET /v1/models` and `GET /v1/models/{id}` (the served model and its MLflow URI, the chat
template), `GET /healthz` (with batching counters). Every response carries the model's id
(`model` in the body, `x-hlm-model` header).

Bad input is answered before any decoding, in OpenAI's error shape: 400 for invalid JSON and for
limits that depend on the model or the server (`max_tokens`, `n`, prompt length in tokens
against the model's positions, token ids against the vocabulary), 404 `model_not_found` for
another model's id, 413 for a body over `max_body_bytes`, 422 for unknown fields, wrong types and
out-of-range values. Over `max_queued_requests` Serve itself answers 503.

Requests are batched continuously: one decode loop (`hlm_ray.serve.engine.DecodeLoop`, on a
thread, or in a child process with `decode_process`: `hlm_ray.serve.decode_process`) runs a
batch of rows (prompts x n, up to `max_batch_size`), and the rows of requests that arrive,
streamed or not, join it at the next step, each with its own settings and seed; finished rows
leave, and so do the rows of a client that disconnects. The event loop only parses, queues and
answers. One log line per request (`ray.serve` logger: id, status, latency, token counts),
written when no request is in flight (`hlm_ray.serve.access_log`).
"""

# No `from __future__ import annotations`: FastAPI (through `serve.ingress`'s class-based view)
# reads the routes' annotations at run time.

import asyncio
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from hlm_ray.errors import one_line
from hlm_ray.generate import Generator, Row
from hlm_ray.pretrained import REGISTRY_SCHEME
from hlm_ray.serve.access_log import AccessLog
from hlm_ray.serve.decode_process import DecodeProcess
from hlm_ray.serve.engine import DecodeLoop, freeze_loaded_heap
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
from hlm_ray.serve.routes import ClientGone, api, body_doc, check_key, read_body
from hlm_ray.serve.schemas import (
    AppArgs,
    ChatChoice,
    ChatCompletion,
    ChatReply,
    ChatRequest,
    CompletionRequest,
    CompletionResponse,
    Health,
    ModelCard,
    ModelList,
    ModelQuery,
    Usage,
)
from hlm_ray.serve.streaming import stream_events

log = logging.getLogger("ray.serve")
# Bodies up to this size are parsed into rows on the event loop (a 4 KiB prompt tokenizes in well
# under a millisecond); bigger ones in a thread, so that a 1 MB prompt never stalls the loop.
INLINE_BODY_BYTES = 4096
SWITCH_INTERVAL_S = float(os.environ.get("HLM_SERVE_SWITCH_INTERVAL_S", "0.0005"))


@serve.deployment(
    # Enough in flight on a replica for its batch to fill; beyond that requests wait in the
    # router's queue, and past max_queued_requests they are refused with 503.
    max_ongoing_requests=64,
    max_queued_requests=256,
    # Niceness 0, not the 15 Ray gives its workers: at 15 every nice-0 process on the node (the
    # raylet, GCS, a driver, the clients) preempts the decoding child at once (2 cores, 10 runs
    # each: served / in-process 0.758 median, 0.585 lowest, at 15; 0.778 and 0.756 at 0).
    ray_actor_options={"num_cpus": 1, "runtime_env": {"env_vars": {"RAY_worker_niceness": "0"}}},
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
            readout=self.args.readout,
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
            self.engine = DecodeProcess(
                self.generator.info["path"],  # the local folder (a registry model downloaded)
                device=self.args.device,
                max_rows=self.args.max_batch_size,
                wait_s=self.args.batch_wait_timeout_s,
                allow_raw_head=self.args.allow_raw_head,
                readout=self.args.readout,
                name=self.name,
                num_threads=self.args.num_threads,
                switch_interval_s=SWITCH_INTERVAL_S,
            )
        else:
            self.engine = DecodeLoop(
                self.generator,
                max_rows=self.args.max_batch_size,
                wait_s=self.args.batch_wait_timeout_s,
            )
        self._requests = 0
        self.access_log = AccessLog(log)
        freeze_loaded_heap()  # no full collection rescans the loaded app mid-request
        log.info(
            "serving %s (%s) from %s, %d positions, %s, decoding %s",
            self.name,
            self.args.model,
            self.generator.info.get("path"),
            self.generator.max_positions,
            "API key required" if self._api_key else "no API key",
            "in a child process" if self.args.decode_process else "on a thread",
        )

    # ------------------------------------------------------------------------- routes

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        if isinstance(self.engine, DecodeProcess):  # asks the child (a pipe round trip)
            loop = asyncio.get_running_loop()
            stats = dict(await loop.run_in_executor(self._prep_pool, self.engine.refresh_stats))
        else:
            stats = dict(self.engine.stats)
        stats["submitted_at"] = self.engine.submitted_at
        stats["busy_s"], stats["busy_cpu_s"] = (
            round(stats["busy_s"], 4),
            round(stats["busy_cpu_s"], 4),
        )
        health = Health(model=self.name, requests=self._requests, **stats)
        return self._json(health.model_dump())

    def check_health(self) -> None:
        """Serve's periodic check: a replica whose decode process died is replaced."""
        if isinstance(self.engine, DecodeProcess) and not self.engine.alive:
            raise RuntimeError("the decode process exited: this replica cannot decode")

    def __del__(self) -> None:
        if hasattr(self, "access_log"):
            self.access_log.flush()
        if hasattr(self, "engine"):
            self.engine.close()

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        # The key is checked before any route but these two (routes.CompletionRoutes).
        return self._json(ModelList(data=[self._card()]).model_dump())

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> JSONResponse:
        """One model's card (ids hold a slash: `NAME/VERSION`); 404 `model_not_found`."""
        try:
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

    @api.post("/v1/completions", openapi_extra=body_doc(CompletionRequest))
    async def completions(self, request: Request):
        return await self._answer(request, "cmpl", CompletionRequest, completion_rows)

    @api.post("/v1/chat/completions", openapi_extra=body_doc(ChatRequest))
    async def chat_completions(self, request: Request):
        return await self._answer(request, "chatcmpl", ChatRequest, chat_rows)

    async def _answer(self, request: Request, prefix: str, model, make_rows):
        """Check, queue for a batch (or stream alone), answer: both completion routes."""
        start = time.perf_counter()
        rid = f"{prefix}-{os.urandom(12).hex()}"
        loop = asyncio.get_running_loop()
        try:
            if (denied := check_key(self._api_key, request)) is not None:
                raise denied
            body = await read_body(request, self.args.max_body_bytes, self.args.body_timeout_s)
            req = parse_request(body, model)
            if len(body) <= INLINE_BODY_BYTES:  # tokenized in microseconds: no thread hop
                rows, prompt_tokens = make_rows(req, self.generator, self.args)
            else:
                rows, prompt_tokens = await loop.run_in_executor(
                    self._prep_pool, make_rows, req, self.generator, self.args
                )
        except ApiError as err:
            return self._fail(rid, err, start)
        except ClientGone:
            self.log_request(rid, 499, start, None, 0, stream=False, reason="client disconnected")
            return self._json(ApiError(400, "client disconnected").body(), 400)
        if req.stream:
            events = stream_events(self, rid, req, rows, prompt_tokens, start)
            return StreamingResponse(events, media_type="text/event-stream", headers=self._headers)
        done = asyncio.Event()
        job = self.engine.submit(rows, lambda: loop.call_soon_threadsafe(done.set))
        try:
            await done.wait()
        except asyncio.CancelledError:  # the client went away: free its rows
            self.engine.cancel(job)
            raise
        if job.error is not None:  # a bug or the device failing, not the request: say so
            err = job.error
            log.error("completion %s failed: %s", rid, one_line(err, with_type=True), exc_info=err)
            return self._fail(rid, self.generation_error(rid, err), start)
        if any(row.result.finish_reason == "timeout" for row in rows):
            return self._fail(rid, self.timeout_error(), start)
        if len(rows) == 1 and getattr(req, "logprobs", None) is None:
            body = self._body(rid, req, rows, prompt_tokens)  # one plain choice: inline
        else:  # logprobs of many rows take a while to format: not on the event loop
            body = await loop.run_in_executor(
                self._prep_pool, self._body, rid, req, rows, prompt_tokens
            )
        self.log_request(rid, 200, start, body.usage, len(rows), stream=False)
        # pydantic writes the JSON itself: no dict of the response, no json.dumps pass over it.
        return Response(
            body.model_dump_json(), media_type="application/json", headers=self._headers
        )

    def _body(self, rid: str, req, rows: list[Row], prompt_tokens: int):
        counts = usage(prompt_tokens, rows)
        common = {"id": rid, "created": int(time.time()), "model": self.name,
                  "usage": counts, "system_fingerprint": self.fingerprint}  # fmt: skip
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

    # ------------------------------------------------------------------------- answers, logs

    def timeout_error(self) -> ApiError:
        return ApiError(504, f"generation took longer than {self.args.request_timeout_s} s")

    @staticmethod
    def generation_error(rid: str, err: BaseException) -> ApiError:
        """A bug or the device failing, not the request: a 500 that says which."""
        return ApiError(
            500, f"generation failed for request {rid}: {one_line(err, with_type=True)}"
        )

    @property
    def fingerprint(self) -> str:
        """Which weights answer: the registry URI when there is one, else the served name."""
        return self._mlflow_uri or self.name

    @property
    def _headers(self) -> dict[str, str]:
        return {"x-hlm-model": self.name}

    def _json(self, body: dict[str, Any], status: int = 200) -> JSONResponse:
        return JSONResponse(body, status_code=status, headers=self._headers)

    def _fail(self, rid: str, err: ApiError, start: float) -> JSONResponse:
        self.log_request(rid, err.status, start, None, 0, stream=False, reason=err.message)
        return self._json(err.body(), err.status)

    def log_request(
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
        """Count the request and queue its access line."""
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
