"""Server-sent events of a streamed completion: one chunk per decoding step, as the replica's
decode loop hands the steps over.

    events = stream_events(server, rid, req, rows, prompt_tokens, start)
    return StreamingResponse(events, media_type="text/event-stream")

`text_completion` chunks for `/v1/completions`; for chat, `chat.completion.chunk`s opened by a
chunk with the assistant's role, the reply's leading space and the model's next turn stripped
(`protocol.strip_reply`). Then the usage (with `stream_options.include_usage`) and
`data: [DONE]`. A timeout ends the stream with a 504 error event, a failure with a 500 one; a
client that leaves takes its rows out of the running batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from hlm_ray.generate import Row
from hlm_ray.serve.engine import Job
from hlm_ray.serve.protocol import strip_reply, usage
from hlm_ray.serve.schemas import (
    ChatChunk,
    ChatChunkChoice,
    ChatDelta,
    ChatRequest,
    Choice,
    CompletionResponse,
)

log = logging.getLogger("ray.serve")


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload)}\n\n"


async def stream_events(
    server, rid: str, req, rows: list[Row], prompt_tokens: int, start: float
) -> AsyncIterator[str]:
    """The events of one streamed request on `server` (a `CompletionServer`: its engine, name,
    fingerprint, timeout and access log)."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    job = server.engine.submit(rows, lambda: loop.call_soon_threadsafe(wake.set), stream=True)
    chat = isinstance(req, ChatRequest)
    common = {"id": rid, "created": int(time.time()), "model": server.name,
              "system_fingerprint": server.fingerprint}  # fmt: skip
    started: set[int] = set()  # chat choices whose reply has begun
    status = 200
    try:
        if chat:
            opening = [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                       for i in range(len(rows))]  # fmt: skip
            yield sse(ChatChunk(choices=opening, **common).model_dump())
        async for deltas in steps(job, wake):
            if any(d.finish_reason == "timeout" for d in deltas):
                status = 504
                yield sse(server.timeout_error().body())
                break
            if not chat:
                choices = [Choice(text=d.text, index=d.index, finish_reason=d.finish_reason)
                           for d in deltas]  # fmt: skip
                yield sse(CompletionResponse(choices=choices, **common).model_dump())
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
                yield sse(ChatChunk(choices=pieces, **common).model_dump())
        if status == 200 and req.stream_options and req.stream_options.include_usage:
            kind = ChatChunk if chat else CompletionResponse
            yield sse(kind(choices=[], usage=usage(prompt_tokens, rows), **common).model_dump())
        yield "data: [DONE]\n\n"
    except Exception as err:
        status = 500
        log.exception("completion %s failed", rid)
        yield sse(server.generation_error(rid, err).body())
    finally:
        if not job.done:  # a client that went away (or a timeout): its rows leave
            server.engine.cancel(job)
        done = [row for row in rows if row.result is not None]
        server.log_request(rid, status, start, usage(prompt_tokens, done), len(rows), stream=True)


async def steps(job: Job, wake: asyncio.Event) -> AsyncIterator[list]:
    """A streamed job's deltas, one list per decoding step, as the decode thread hands them
    over; raises the job's error."""
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
