"""Request and response bodies of the completions server (OpenAI's completions and chat
completions APIs) and the typed arguments of its Serve application.

    req = CompletionRequest.model_validate_json(body)   # ValidationError names the bad field
    args = AppArgs(model="models:/hlm-tiny-generator/1", max_batch_size=16)

Requests are strict: unknown fields and wrong types are rejected (422), so a typo such as
`max_token` is an error rather than silently ignored. Limits that depend on the served model or
the server's configuration (`max_tokens`, `n`, prompt length) are checked by the app (400).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_PROMPTS = 1024
# Upper bounds of the schema: every number a request carries is bounded here (422 above),
# before the server's own limits (400, they depend on the model and the configuration). No
# value that passes can overflow a tensor (int64) or a C int.
MAX_INT = 2**31 - 1
MAX_LOGPROBS = 20  # vLLM's default limit (OpenAI's is 5)
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    """Send a last chunk with the `usage` counts (and no choices) before `[DONE]`."""


class _Sampling(_Strict):
    """The fields completions and chat completions share."""

    model: str | None = None
    """The served model's id (GET /v1/models); None or omitted: the served model."""
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, le=MAX_INT)
    """Not in OpenAI's API (vLLM has it): sample among the k most likely tokens (at most the
    model's vocabulary size: the server answers 400 above it)."""
    n: int = Field(1, ge=1, le=MAX_INT)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, OpenAI's form) -> bias in [-100, 100] added to its logit before
    sampling (log-probabilities do not see it)."""
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            # ASCII decimal digits only, as OpenAI takes them: "²" and "③" pass isdigit() and
            # fail int(); "١" and "𝟏" pass isdecimal() and would be read as token 1.
            if not (key.isascii() and key.isdecimal()) or len(key) > 10:
                raise ValueError(
                    f'keys are token ids written in ASCII digits ("42"), not {key[:20]!r}'
                )
            if not -100 <= bias <= 100:
                raise ValueError(f"biases are in [-100, 100], not {bias}")
        if value and len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences are at most {MAX_STOP_CHARS} characters")
        return value

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def bias(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())


TokenIds = list[Annotated[int, Field(ge=0, le=MAX_INT)]]


class CompletionRequest(_Sampling):
    """POST /v1/completions, as OpenAI and vLLM serve it. `suffix` (fill-in-the-middle) is
    refused with 400 unless empty; penalties are accepted only at 0."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    """Text, texts, token ids, or lists of token ids (what lm-eval sends)."""
    max_tokens: int = Field(16, ge=0, le=MAX_INT)
    """0 only with `echo`: score the prompt, generate nothing."""
    echo: bool = False
    """Put the prompt before the completion in `text` (and its tokens in `logprobs`, the first
    one with `null`: nothing predicts it)."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """Return each token's log-probability and the `logprobs` most likely tokens there."""
    best_of: int | None = Field(None, ge=1, le=MAX_INT)
    """Only `best_of == n` is served (400 otherwise)."""
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_list(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("must be a string or a non-empty list of strings or token ids")
        if isinstance(value, list) and isinstance(value[0], list) and not all(value):
            raise ValueError("a prompt given as token ids has none")
        if isinstance(value, list) and len(value) > MAX_PROMPTS and not isinstance(value[0], int):
            raise ValueError(f"at most {MAX_PROMPTS} prompts")
        return value

    def prompts(self) -> list[str] | list[list[int]]:
        """One entry per prompt: a string, or a list of token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class Logprobs(BaseModel):
    """OpenAI's completions `logprobs` object (one entry per token)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class Choice(BaseModel):
    text: str
    index: int
    finish_reason: str | None
    logprobs: Logprobs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Response(BaseModel):
    """What every answer and streamed chunk carries, in OpenAI's order; each kind narrows
    `object` and `choices`."""

    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: Usage | None = None
    system_fingerprint: str | None = None
    """Which weights answered: the `models:/NAME/VERSION` URI, or the served name (never a
    local path)."""


class CompletionResponse(_Response):
    """A completion, or one server-sent chunk of a streamed one (then `usage` is None except in
    the last chunk when `stream_options.include_usage`)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[Choice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hlm_ray"
    mlflow_uri: str | None
    """The MLflow registry URI, when the model came from the registry (a local folder is
    never reported)."""
    objective: str | None
    finetuned: str | None
    max_positions: int
    chat_template: str | None = None
    """How /v1/chat/completions lays out messages for the model (`hlm_ray.serve.protocol`)."""


class ModelQuery(BaseModel):
    model: str | None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    requests: int
    """Completion requests answered by this replica (any status)."""
    batches: int
    """Prefills: forward passes that admitted requests' rows into the running batch (requests
    that arrive together share one)."""
    steps: int
    """Decoding steps (one new token for every running row)."""
    decoded_rows: int
    """Rows summed over steps (decoded_rows / steps: the mean batch)."""
    max_batch_requests: int
    """The most requests decoded together in one step."""
    max_batch_rows: int
    """The most rows (prompts x n) decoded together in one step."""
    busy_s: float
    """Seconds the decode thread spent prefilling and stepping."""
    busy_cpu_s: float
    """CPU seconds the decode thread used meanwhile (busy_s - busy_cpu_s: time it waited for
    a core or for the GIL)."""
    busy_since: float
    """Unix time the decode thread last left idle (its first prefill after an empty batch)."""
    idle_since: float
    """Unix time the batch last became empty (its last row finished)."""
    stepping_since: float = 0.0
    """Unix time of the first step since the decode thread last left idle (the batch formed)."""
    submitted_at: float = 0.0
    """Unix time the replica last handed a request to the decode thread or process."""


class AppArgs(BaseModel):
    """Arguments of `hlm_ray.serve.app:build_app` (the `args:` of a Serve config file).
    Replicas, autoscaling, CPUs/GPUs and the request queue limits are deployment options:
    set them under `deployments:` in the config file (or `hlm serve --replicas ...`)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    """A run, checkpoint or model folder, or `models:/NAME/VERSION` / `models:/NAME@alias`."""
    name: str | None = None
    """The id the model is served under (default: NAME/VERSION or the run folder's name)."""
    device: str = "auto"
    """"cpu", "cuda" or "auto" (the GPU when the replica has one)."""
    allow_raw_head: bool = False
    """Serve a headless decoder that was never fine-tuned, with its raw Eᵀ head, when it has no
    prior readout (no token counts)."""
    readout: Literal["head", "tied", "prior"] | None = None
    """How the decoder's hidden states become logits (`hlm_ray.readout`); None: the model's
    own (a headless decoder never fine-tuned: its prior readout)."""
    max_batch_size: int = Field(16, ge=1)
    """Rows (prompts x n, over concurrent requests) decoded together; also a request's limit."""
    batch_wait_timeout_s: float = Field(0.02, ge=0.0)
    """How long an idle replica waits, after a request arrives, for others to share its first
    step; it prefills each request as it arrives meanwhile, and steps as soon as the batch is
    full. Requests arriving later join the running batch at its next step, but rows that start
    at different steps finish at different steps: 20 ms let 32 concurrent clients start
    together (docs/benchmarks.md). 0: a lone request starts at once."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Longest prompt accepted, in tokens (default: the model's positions minus max_tokens)."""
    max_tokens_limit: int = Field(256, ge=1)
    """Largest `max_tokens` a request may ask for (also bounded by the model's positions)."""
    max_n: int = Field(4, ge=1)
    """Largest `n` a request may ask for."""
    request_timeout_s: float = Field(60.0, gt=0.0)
    """A request still decoding after this long is answered 504 and its rows are dropped."""
    max_body_bytes: int = Field(1 << 20, ge=1024)
    """Larger request bodies are answered 413."""
    body_timeout_s: float = Field(10.0, gt=0.0)
    """A request body not received within this long is answered 408 (the proxy's guard,
    `hlm_ray.serve.guard`, does this before a replica is involved; this is the fallback)."""
    decode_process: bool = True
    """Decode in a child process of the replica (`hlm_ray.serve.decode_process`): HTTP and
    decoding no longer take turns on one interpreter lock (with a small model on 2 cores, the
    served tokens/s of 32 clients rose from 0.27-0.29 of in-process decoding through the proxy
    to about 0.8 with direct ingress: docs/benchmarks.md). Costs one more process per replica
    (it holds the weights; the replica then loads the tokenizer and the model's config only)
    and a pipe hop per request. False: decode on a thread of the replica."""
    num_threads: int | None = Field(None, ge=1)
    """torch threads per replica (default: torch's, i.e. the replica's CPUs under Ray)."""
    api_key: SecretStr | None = None
    """Clients must send `Authorization: Bearer KEY` (401 otherwise). Prefer `api_key_env`:
    a key given here is part of the application's config."""
    api_key_env: str = "HLM_API_KEY"
    """Environment variable holding the key when `api_key` is not set (in Kubernetes, from a
    Secret); unset or empty and no `api_key`: no authentication."""


# ----------------------------------------------------------------------------- chat


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(None, max_length=256)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    """POST /v1/chat/completions: the messages are laid out by the template in
    `hlm_ray.serve.chat` and completed as text; log-probabilities are not offered here."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_PROMPTS)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    """OpenAI's newer name for `max_tokens` (either; default 16)."""
    logprobs: Literal[False] = False
    top_logprobs: None = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    def limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16


class ChatReply(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatReply
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatChunk(_Response):
    """One server-sent event of a streamed chat completion."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
