"""Request and response bodies of the completions server (the OpenAI completions API) and the
typed arguments of its Serve application.

    req = CompletionRequest.model_validate_json(body)   # ValidationError names the bad field
    args = AppArgs(model="models:/hlm-tiny-generator/1", max_batch_size=16)

Requests are strict: unknown fields and wrong types are rejected (422), so a typo such as
`max_token` is an error rather than silently ignored. Limits that depend on the served model or
the server's configuration (`max_tokens`, `n`, prompt length) are checked by the app (400).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_PROMPTS = 1024
# Upper bounds of the schema: every number a request carries is bounded here (422 above),
# before the server's own limits (400, they depend on the model and the configuration). No
# value that passes can overflow a tensor (int64) or a C int.
MAX_INT = 2**31 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    """Send a last chunk with the `usage` counts (and no choices) before `[DONE]`."""


class CompletionRequest(_Strict):
    """POST /v1/completions. Fields the OpenAI API has but this server does not implement are
    accepted only at their neutral value (`echo: false`, `logprobs: null`, penalties 0)."""

    model: str | None = None
    """The served model's id (GET /v1/models); None or omitted: the served model."""
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=1, le=MAX_INT)
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
    echo: Literal[False] = False
    logprobs: None = None
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0

    @field_validator("prompt")
    @classmethod
    def _prompt_list(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("must be a string or a non-empty list of strings")
        if isinstance(value, list) and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts")
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

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class Choice(BaseModel):
    text: str
    index: int
    finish_reason: str | None
    logprobs: None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    """A completion, or one server-sent chunk of a streamed one (then `usage` is None except in
    the last chunk when `stream_options.include_usage`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    """Which weights answered: the `models:/NAME/VERSION` URI, or the served name (never a
    local path)."""


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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    requests: int
    """Completion requests answered by this replica (any status)."""
    batches: int
    """Batches of non-streaming requests decoded by this replica."""
    max_batch_requests: int
    """The most requests decoded together in one batch."""
    max_batch_rows: int
    """The most rows (prompts x n) decoded together in one batch."""


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
    """Serve a headless decoder that was never fine-tuned, with its raw Eᵀ head."""
    max_batch_size: int = Field(16, ge=1)
    """Rows (prompts x n, over concurrent requests) decoded together; also a request's limit."""
    batch_wait_timeout_s: float = Field(0.02, ge=0.0)
    """How long the first request of a batch waits for others to join it."""
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
    num_threads: int | None = Field(None, ge=1)
    """torch threads per replica (default: torch's, i.e. the replica's CPUs under Ray)."""
    api_key: SecretStr | None = None
    """Clients must send `Authorization: Bearer KEY` (401 otherwise). Prefer `api_key_env`:
    a key given here is part of the application's config."""
    api_key_env: str = "HLM_API_KEY"
    """Environment variable holding the key when `api_key` is not set (in Kubernetes, from a
    Secret); unset or empty and no `api_key`: no authentication."""
