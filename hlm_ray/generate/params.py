"""What one decoded row is: its settings (`SamplingParams`), its result (`Completion`), the text
deltas it streams (`Delta`) and its running state (`Row`), and each choice's seed (`row_seed`).

    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, stop=(".",))
    row = Row(prompt_ids=[464, 3797], params=params, seed=row_seed(1, choice=0))
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

from hlm_ray.detokenize import IncrementalText
from hlm_ray.errors import HLMError
from hlm_ray.sampling import TokenLogprob

_SEED_MOD = 2**63


@dataclass(frozen=True)
class SamplingParams:
    """How one row is decoded."""

    max_new_tokens: int = 16
    """Tokens to generate at most (the row ends earlier at EOS or a stop sequence); 0 generates
    nothing (to score the prompt with `prompt_logprobs`)."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy (argmax)."""
    top_k: int | None = None
    """Sample among the k most likely tokens only (None: all)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p."""
    stop: tuple[str, ...] = ()
    """Strings that end the row; the text is cut before the first one."""
    logprobs: int | None = None
    """Record each generated token's log-probability and those of the `logprobs` most likely
    tokens at its position (0: its own only; None: nothing)."""
    prompt_logprobs: bool = False
    """Also record the log-probability of each prompt token after the first (with `logprobs`
    alternatives), computed in the forward pass that reads the prompt."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling (OpenAI's `logit_bias`,
    -100..100); log-probabilities do not see them."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise HLMError(f"max_new_tokens={self.max_new_tokens} must be >= 0")
        if self.logprobs is not None and self.logprobs < 0:
            raise HLMError(f"logprobs={self.logprobs} must be >= 0 (or None for none)")
        if any(not (math.isfinite(b) and -100 <= b <= 100) for _, b in self.logit_bias):
            raise HLMError("logit_bias values must be numbers in [-100, 100]")
        if not 0 <= self.temperature <= 100:
            raise HLMError(f"temperature={self.temperature} must be in [0, 100] (0 = greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise HLMError(f"top_k={self.top_k} must be >= 1 (or None for no limit)")
        if not 0 < self.top_p <= 1:
            raise HLMError(f"top_p={self.top_p} must be in (0, 1]")
        if any(not s for s in self.stop):
            raise HLMError("stop sequences must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Completion:
    text: str
    """The generated text, cut before a stop sequence; EOS is not part of it."""
    token_ids: list[int]
    """The generated tokens (EOS excluded; a stop sequence's tokens included)."""
    finish_reason: str
    """"stop" (EOS or a stop sequence), "length" (max_new_tokens), "timeout" (a row's deadline)."""
    prompt_tokens: int
    completion_tokens: int
    """Tokens the model generated, EOS included."""
    logprobs: list[TokenLogprob] | None = None
    """Per generated token, EOS included (params.logprobs set), else None."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """Per prompt token, None for the first one (nothing predicts it) (params.prompt_logprobs
    set), else None."""


@dataclass
class Delta:
    """A piece of one row's text; `finish_reason` is set on the row's last delta."""

    index: int
    text: str
    finish_reason: str | None = None


@dataclass
class Row:
    """One sequence to decode: a prompt (as ids), its settings, its seed, an optional deadline
    (`time.monotonic()` value). `result` is set when the row finishes."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int | None = None
    deadline: float | None = None
    result: Completion | None = None
    index: int = 0
    """The row's choice index in its request, reported in its `Delta`s."""
    # Decoding state.
    token_ids: list[int] = field(default_factory=list)
    emitted: str = ""
    num_generated: int = 0
    text: IncrementalText | None = None
    """The generated tokens' text, decoded as they come."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_from: int = 0
    """Where in the text a stop sequence may still begin (the text before was searched)."""

    def reset(self) -> None:
        """Forget any decoding done (to decode the row again, e.g. alone)."""
        self.result, self.token_ids, self.emitted, self.num_generated = None, [], "", 0
        self.text, self.logprobs, self.prompt_logprobs, self.stop_from = None, [], None, 0


def row_seed(seed: int | None, choice: int) -> int:
    """The seed of choice `choice` of a request seeded with `seed` (random when None). It does not
    depend on the row's position in a batch, so a seeded request decodes the same way alone or
    batched with others."""
    if seed is None:
        return secrets.randbits(63)
    return (seed * 1_000_003 + choice) % _SEED_MOD
