"""OpenAI's completions and chat completions APIs over `hlm_ray.generate`: requests checked and
turned into rows, finished rows turned into response bodies. No Ray: the app's routes call these.

    req = parse_request(body, CompletionRequest)        # ApiError 400 / 422 naming the field
    rows, prompt_tokens = completion_rows(req, generator, app_args)
    generator.complete_rows(rows)
    choices = [completion_choice(generator, row, i, req) for i, row in enumerate(rows)]

The chat template is deliberately simple, for base (non-chat) decoders: each message on its own
line as `System: ...`, `User: ...`, `Assistant: ...` (a `developer` message is a system one),
then `Assistant:` for the model to complete. The reply stops at a line that starts a new turn
(`CHAT_STOPS`) and loses the one space the model writes after `Assistant:`.

    System: Answer briefly.
    User: What is the capital of France?
    Assistant:
"""

from __future__ import annotations

import json
import time
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from hlm_ray.errors import HLMError
from hlm_ray.generate import Generator, Row, SamplingParams, row_seed
from hlm_ray.serve.error_shape import error_body
from hlm_ray.serve.schemas import (
    AppArgs,
    ChatMessage,
    ChatRequest,
    Choice,
    CompletionRequest,
    Logprobs,
    ModelQuery,
    Usage,
)

CHAT_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
CHAT_STOPS = ("\nUser:", "\nSystem:")
CHAT_TEMPLATE = "System: {system}\nUser: {user}\nAssistant: {reply}\n...\nAssistant:"
"""The chat layout, as `GET /v1/models/{id}` reports it."""

Request = TypeVar("Request", bound=BaseModel)


class ApiError(Exception):
    """An error answered to the client: status, a message naming the field (`param`), and
    OpenAI's `code` when it has a specific one (`model_not_found`, ...)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return json.loads(error_body(self.status, self.message, self.param, self.code))


def parse_request(body: bytes, model: type[Request] = CompletionRequest) -> Request:
    """Parse and validate a request body; ApiError 400 for invalid JSON, 422 naming the field
    for anything pydantic rejects."""
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        errors = err.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            raise ApiError(400, f"request body is not valid JSON: {errors[0]['msg']}") from None
        messages = [f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors]
        param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
        raise ApiError(422, "; ".join(messages[:3]), param) from None


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The messages laid out by the chat template (module docstring)."""
    lines = [f"{CHAT_ROLES[m.role]}: {m.text()}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


# ----------------------------------------------------------------------------- requests -> rows


def check_model_id(req: CompletionRequest | ChatRequest | ModelQuery, served: str) -> None:
    if req.model is not None and req.model != served:
        raise ApiError(
            404,
            f"model {req.model!r} is not served here; this server serves {served!r}",
            "model",
            "model_not_found",
        )


def completion_rows(req: CompletionRequest, gen: Generator, args: AppArgs) -> tuple[list[Row], int]:
    """A completions request's rows, after every limit that depends on the model or server."""
    check_model_id(req, gen.name)
    if req.suffix:
        raise ApiError(400, "suffix is not supported: these decoders only continue a prompt "
                       "(no fill-in-the-middle); leave it out", "suffix", "unsupported_parameter")  # fmt: skip
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(
            400,
            f"best_of={req.best_of} with n={req.n}: only best_of equal to n is served (every "
            "sampled completion is returned); leave best_of out",
            "best_of",
            "unsupported_value",
        )
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens=0 returns nothing unless echo is true (to score the "
                       "prompt); ask for at least 1 token", "max_tokens")  # fmt: skip
    if req.stream and (req.echo or req.logprobs is not None):
        raise ApiError(400, "echo and logprobs are not streamed; send stream: false",
                       "stream", "unsupported_parameter")  # fmt: skip
    params = _params(req, req.max_tokens, req.stops(), gen, args)
    params = SamplingParams(**{**params.__dict__, "logprobs": req.logprobs,
                               "prompt_logprobs": req.echo and req.logprobs is not None})  # fmt: skip
    return _rows(req.prompts(), params, req, gen, args)


def chat_rows(req: ChatRequest, gen: Generator, args: AppArgs) -> tuple[list[Row], int]:
    """A chat request's rows: its messages in the template, completed up to the next turn."""
    check_model_id(req, gen.name)
    params = _params(req, req.limit(), (*req.stops(), *CHAT_STOPS), gen, args)
    return _rows([chat_prompt(req.messages)], params, req, gen, args)


def _params(
    req: CompletionRequest | ChatRequest, max_tokens: int, stops, gen: Generator, args: AppArgs
) -> SamplingParams:
    limit = min(args.max_tokens_limit, gen.max_positions - 1)
    if max_tokens > limit:
        raise ApiError(
            400, f"max_tokens={max_tokens} is above this server's limit of {limit}", "max_tokens"
        )
    if req.n > args.max_n:
        raise ApiError(400, f"n={req.n} is above this server's limit of {args.max_n}", "n")
    if req.top_k is not None and req.top_k > gen.vocab_size:
        raise ApiError(
            400,
            f"top_k={req.top_k} is above the model's vocabulary of {gen.vocab_size} tokens",
            "top_k",
        )
    try:
        gen.check_ids([token for token, _ in req.bias()], "logit_bias")
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            stop=tuple(stops),
            logit_bias=req.bias(),
        )
    except HLMError as err:
        param = "logit_bias" if "logit_bias" in str(err) else None
        raise ApiError(400, str(err), param) from None


def _rows(prompts, params: SamplingParams, req, gen: Generator, args: AppArgs):
    if len(prompts) * req.n > args.max_batch_size:
        raise ApiError(
            400,
            f"{len(prompts)} prompts x n={req.n} is {len(prompts) * req.n} completions; this "
            f"server decodes at most {args.max_batch_size} per request",
            "prompt",
        )
    deadline = time.monotonic() + args.request_timeout_s
    rows, prompt_tokens = [], 0
    for i, prompt in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            ids = gen.encode(prompt)
        else:
            ids = list(prompt)
            try:
                gen.check_ids(ids, where)
            except HLMError as err:
                raise ApiError(400, str(err), "prompt") from None
        _check_prompt(len(ids), params.max_new_tokens, where, gen, args)
        prompt_tokens += len(ids)
        rows += [Row(ids, params, row_seed(req.seed, c), deadline) for c in range(req.n)]
    return rows, prompt_tokens


def _check_prompt(num_tokens: int, max_tokens: int, where: str, gen, args: AppArgs) -> None:
    positions = gen.max_positions
    if args.max_prompt_tokens and num_tokens > args.max_prompt_tokens:
        raise ApiError(
            400,
            f"{where} has {num_tokens} tokens; this server accepts at most "
            f"{args.max_prompt_tokens}",
            "prompt",
            "context_length_exceeded",
        )
    if num_tokens + max_tokens > positions:
        raise ApiError(
            400,
            f"{where} has {num_tokens} tokens and max_tokens={max_tokens}: together more than "
            f"the model's {positions} positions; shorten the prompt or lower max_tokens",
            "prompt",
            "context_length_exceeded",
        )


# ----------------------------------------------------------------------------- rows -> bodies


def usage(prompt_tokens: int, rows: list[Row]) -> Usage:
    completion = sum(row.result.completion_tokens for row in rows if row.result is not None)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
    )


def completion_choice(gen: Generator, row: Row, index: int, req: CompletionRequest) -> Choice:
    """A finished row as a completions choice: with `echo` the prompt's text comes first, and
    with `logprobs` the tokens (prompt ones first under `echo`, EOS included) with their
    log-probabilities, alternatives and offsets in `text`."""
    result = row.result
    prompt_offsets, prompt_text = gen.text_offsets(row.prompt_ids) if req.echo else ([], "")
    logprobs = None
    if req.logprobs is not None:
        # EOS is among the scored tokens (lm-eval counts one entry per token it sent, plus
        # the max_tokens=1 it asked for): its text is empty.
        generated = [lp.token_id for lp in result.logprobs]
        offsets, _ = gen.text_offsets(generated)
        entries = (result.prompt_logprobs or []) + result.logprobs
        ids = (row.prompt_ids if req.echo else []) + generated
        alternatives = sorted({i for e in entries if e for i, _ in e.top})
        name = dict(zip(alternatives, gen.token_strings(alternatives), strict=True))
        tokens = gen.token_strings(ids)
        tops: list[dict[str, float] | None] = []
        for token, entry in zip(tokens, entries, strict=True):
            if entry is None:
                tops.append(None)
                continue
            top = {name[i]: lp for i, lp in entry.top}
            top.setdefault(token, entry.logprob)  # the chosen token is always listed (vLLM)
            tops.append(top)
        logprobs = Logprobs(
            tokens=tokens,
            token_logprobs=[e.logprob if e else None for e in entries],
            top_logprobs=tops,
            text_offset=prompt_offsets + [len(prompt_text) + o for o in offsets],
        )
    return Choice(
        text=prompt_text + result.text,
        index=index,
        finish_reason=result.finish_reason,
        logprobs=logprobs,
    )


def strip_reply(text: str, started: bool) -> str:
    """A chat reply without the space the model writes after `Assistant:` (only at the start)."""
    return text if started else text.removeprefix(" ")
