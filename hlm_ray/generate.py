"""Text generation from a decoder: greedy or sampled, batched, streamed. No Ray needed.

    gen = Generator.load("runs/tiny-gen")                  # or a checkpoint/model folder, models:/...
    [c] = gen.generate("The cat", max_new_tokens=20, temperature=0)      # greedy
    c.text, c.token_ids, c.finish_reason, c.prompt_tokens, c.completion_tokens
    outs = gen.generate(["a", "b"], max_new_tokens=20, temperature=0.8, top_p=0.9, seed=1, n=2)
    for delta in gen.stream("The cat", max_new_tokens=20, stop=["."]):
        print(delta.text, end="")

Sampling is ours, not `model.generate`'s: per step the float32 logits of each row go through
`apply_temperature`, `top_k_filter`, `top_p_filter` (the order Hugging Face uses) and are sampled
with the row's own seeded `torch.Generator`, so a seeded row gives the same text alone or batched
with other rows (up to float noise). Prompts are left-padded into one batch with an attention
mask and explicit positions, and decoded with the KV cache (`past_key_values`).

A headless decoder that was never fine-tuned only has the raw Eᵀ head (its input embeddings) and
is refused: `hlm finetune --task clm` gives it a real head (`allow_raw_head=True` overrides).

The server batches rows of several requests, each row with its own settings, through
`Generator.complete_rows` / `Generator.stream_rows`.
"""

from __future__ import annotations

import random
import secrets
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hlm_ray.device import device_name
from hlm_ray.errors import HLMError
from hlm_ray.models import max_input_positions
from hlm_ray.pretrained import REGISTRY_SCHEME, load_pretrained, model_info, resolve_model_dir

_SEED_MOD = 2**63


# ----------------------------------------------------------------------------- settings, results


@dataclass(frozen=True)
class SamplingParams:
    """How one row is decoded."""

    max_new_tokens: int = 16
    """Tokens to generate at most (the row ends earlier at EOS or a stop sequence)."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy (argmax)."""
    top_k: int | None = None
    """Sample among the k most likely tokens only (None: all)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p."""
    stop: tuple[str, ...] = ()
    """Strings that end the row; the text is cut before the first one."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise HLMError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
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
    # Decoding state.
    token_ids: list[int] = field(default_factory=list)
    emitted: str = ""
    num_generated: int = 0
    # Incremental detokenization: `text_done` is the text of token_ids[:num_done], which ends
    # on a whole character, so only the tokens after it are decoded again at each step.
    text_done: str = ""
    num_done: int = 0

    def reset(self) -> None:
        """Forget any decoding done (to decode the row again, e.g. alone)."""
        self.result, self.token_ids, self.emitted, self.num_generated = None, [], "", 0
        self.text_done, self.num_done = "", 0


def row_seed(seed: int | None, choice: int) -> int:
    """The seed of choice `choice` of a request seeded with `seed` (random when None). It does not
    depend on the row's position in a batch, so a seeded request decodes the same way alone or
    batched with others."""
    if seed is None:
        return secrets.randbits(63)
    return (seed * 1_000_003 + choice) % _SEED_MOD


# ----------------------------------------------------------------------------- logit filters


def apply_temperature(logits_BV: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (rows with temperature 0 are left as they are:
    they are decoded greedily)."""
    t_B1 = torch.where(temperature_B > 0, temperature_B, 1.0).to(logits_BV.dtype)[:, None]
    return logits_BV / t_B1


def top_k_filter(logits_BV: torch.Tensor, k_B: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits, -inf elsewhere (k = 0: keep all). Ties with the k-th
    largest value are kept."""
    vocab = logits_BV.shape[-1]
    off_B = (k_B <= 0) | (k_B >= vocab)
    sorted_BV = logits_BV.sort(dim=-1, descending=True).values
    kth_B1 = sorted_BV.gather(-1, (k_B.clamp(1, vocab) - 1)[:, None])
    drop_BV = (logits_BV < kth_B1) & ~off_B[:, None]
    return logits_BV.masked_fill(drop_BV, float("-inf"))


def top_p_filter(logits_BV: torch.Tensor, p_B: torch.Tensor) -> torch.Tensor:
    """Nucleus filter: keep, per row, the most likely tokens until their probability reaches p
    (at least one token), -inf elsewhere (p >= 1: keep all)."""
    sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
    probs_BV = sorted_BV.softmax(dim=-1)
    mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV  # probability of the tokens above
    drop_sorted_BV = (mass_before_BV >= p_B[:, None]) & (p_B < 1)[:, None]
    drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
    return logits_BV.masked_fill(drop_BV, float("-inf"))


def sample_next(
    logits_BV: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[random.Random | None],
) -> torch.Tensor:
    """Next token per row (B,): argmax for greedy rows, else temperature -> top-k -> top-p ->
    a draw from the row's own generator (a seeded `random.Random`: one uniform per step costs
    0.1 µs there against ~15 µs for a `torch.rand` call, per row and step)."""
    logits_BV = logits_BV.float()
    next_B = logits_BV.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return next_B
    device = logits_BV.device
    sub_BV = logits_BV[torch.tensor(sampled, device=device)]
    temperature = [params[i].temperature for i in sampled]
    # k >= V keeps every token: clamp, so that no k overflows a tensor (k = 2**63 did).
    top_k = [min(params[i].top_k or 0, logits_BV.shape[-1]) for i in sampled]
    top_p = [params[i].top_p for i in sampled]
    sub_BV = apply_temperature(sub_BV, torch.tensor(temperature, device=device))
    if any(top_k):  # (each filter sorts the vocabulary: skip it when no row uses it)
        sub_BV = top_k_filter(sub_BV, torch.tensor(top_k, device=device))
    if min(top_p) < 1:
        sub_BV = top_p_filter(sub_BV, torch.tensor(top_p, device=device))
    # One uniform draw per row from the row's generator, then inverse-CDF sampling for all rows
    # at once (cheaper than a multinomial call per row).
    u_B = torch.tensor([generators[i].random() for i in sampled], device=device)
    cdf_BV = sub_BV.softmax(dim=-1).cumsum(dim=-1)
    # right=True: the first token whose cumulative probability exceeds u, so a token filtered
    # out (zero probability, flat CDF) is never drawn; rounding at the top end falls back to the
    # last token that has probability.
    drawn_B = torch.searchsorted(cdf_BV, (u_B * cdf_BV[:, -1])[:, None], right=True)[:, 0]
    last_B = (sub_BV > float("-inf")).cumsum(dim=-1).argmax(dim=-1)
    next_B[torch.tensor(sampled, device=device)] = torch.minimum(drawn_B, last_B)
    return next_B


# ----------------------------------------------------------------------------- loading


def check_generation_ready(
    info: dict[str, str | None], ref: str | Path, *, allow_raw_head: bool = False
) -> None:
    """Refuse models that cannot generate: encoders, and headless decoders that were never
    fine-tuned (their only head is the raw Eᵀ), unless `allow_raw_head`."""
    if info["family"] != "decoder":
        raise HLMError(
            f"{ref} is an encoder ({info['model_type']}); only decoders generate text: "
            "pass a decoder run (or one fine-tuned with `hlm finetune --task clm`)"
        )
    if info["objective"] == "headless" and info["finetuned"] is None:
        if not allow_raw_head:
            raise HLMError(
                f"{ref} is a headless decoder that was never fine-tuned: its only output head is "
                f"the raw Eᵀ of its input embeddings; run `hlm finetune --task clm --model {ref}` "
                "first (or pass allow_raw_head=True / --allow-raw-head to use Eᵀ anyway)"
            )
        warnings.warn(
            f"{ref} is a headless decoder that was never fine-tuned: generating with the raw Eᵀ "
            "head (expect poor text; `hlm finetune --task clm` gives it a real head)",
            UserWarning,
            stacklevel=3,
        )


def default_model_name(ref: str | Path) -> str:
    """The name a model is served under: `NAME/VERSION` (or `NAME@alias`) for a registry URI,
    else the run folder's name (`run/checkpoint_...` for a checkpoint)."""
    text = str(ref)
    if text.startswith(REGISTRY_SCHEME):
        return text[len(REGISTRY_SCHEME) :].strip("/")
    path = Path(text).expanduser().resolve()
    if path.name == "model":
        path = path.parent
    if path.name.startswith("checkpoint_"):
        return f"{path.parent.name}/{path.name}"
    return path.name


# ----------------------------------------------------------------------------- the generator


class Generator:
    """A decoder, its tokenizer and the decoding loop."""

    def __init__(self, model, tokenizer, *, name: str, source: str, info: dict | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.source = source
        self.info = info or {}
        self.device = next(model.parameters()).device
        self.max_positions = max_input_positions(model.config)
        if self.max_positions is None:
            raise HLMError(
                f"cannot tell how many positions the {model.config.model_type} model allows"
            )
        self.vocab_size = int(model.config.vocab_size)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        # The Rust tokenizer decodes ~5x faster than the transformers wrapper around it; with a
        # byte-level decoder, text of concatenated tokens is the concatenated text (cut on
        # whole characters), so a row's text can be decoded incrementally.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = backend.decode if backend is not None else None
        self._incremental = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"

    @classmethod
    def load(
        cls,
        ref: str | Path,
        *,
        device: str = "cpu",
        allow_raw_head: bool = False,
        name: str | None = None,
    ) -> Generator:
        """Load a decoder for generation from a run, checkpoint or model folder or a `models:/`
        URI; refuses encoders and un-fine-tuned headless decoders (see module docstring)."""
        device = device_name(device)
        folder = resolve_model_dir(ref)  # downloads a registry model once
        info = model_info(folder)
        check_generation_ready(info, ref, allow_raw_head=allow_raw_head)
        pre = load_pretrained(folder, kind="causal_lm", device=device)
        info = {**info, "path": str(folder)}
        return cls(
            pre.model,
            pre.tokenizer,
            name=name or default_model_name(ref),
            source=str(ref),
            info=info,
        )

    # -- prompts

    def encode(self, prompt: str) -> list[int]:
        """Prompt ids; an empty prompt starts from EOS (the document separator), as in OpenAI's
        API where the default prompt is <|endoftext|>."""
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return ids or [self.eos_id]

    def check_length(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        if num_prompt_tokens + max_new_tokens > self.max_positions:
            raise HLMError(
                f"prompt has {num_prompt_tokens} tokens and max_new_tokens={max_new_tokens}: "
                f"together more than the model's {self.max_positions} positions; shorten the "
                "prompt or ask for fewer tokens"
            )

    def rows(
        self,
        prompts: Sequence[str] | str,
        params: SamplingParams,
        *,
        seed: int | None = None,
        n: int = 1,
        deadline: float | None = None,
    ) -> list[Row]:
        """The rows of one request: each prompt `n` times (prompt-major, OpenAI's choice order)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise HLMError("no prompts given; pass a string or a non-empty list of strings")
        if n < 1:
            raise HLMError(f"n={n} must be >= 1")
        out = []
        for prompt in prompts:
            ids = self.encode(prompt)
            self.check_length(len(ids), params.max_new_tokens)
            for choice in range(n):
                out.append(Row(ids, params, row_seed(seed, choice), deadline))
        return out

    # -- the public API

    def generate(
        self,
        prompts: Sequence[str] | str,
        *,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        stop: Sequence[str] | str | None = None,
        seed: int | None = None,
        n: int = 1,
    ) -> list[Completion]:
        """One completion per prompt and choice (prompt-major). temperature=0 is greedy."""
        params = _params(max_new_tokens, temperature, top_k, top_p, stop)
        return self.complete_rows(self.rows(prompts, params, seed=seed, n=n))

    def stream(
        self,
        prompts: Sequence[str] | str,
        *,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        stop: Sequence[str] | str | None = None,
        seed: int | None = None,
        n: int = 1,
    ) -> Iterator[Delta]:
        """Text deltas as they are decoded; per row (`Delta.index`), they concatenate to the text
        `generate` returns with the same arguments."""
        params = _params(max_new_tokens, temperature, top_k, top_p, stop)
        for deltas in self.stream_rows(self.rows(prompts, params, seed=seed, n=n)):
            yield from deltas

    def complete_rows(self, rows: list[Row]) -> list[Completion]:
        """Decode `rows` together; one Completion per row."""
        for _ in self.stream_rows(rows):
            pass
        return [row.result for row in rows]

    def complete_groups(self, groups: list[list[Row]]) -> list[Exception | None]:
        """Decode several requests' rows as one batch; when the batch fails, decode each group
        alone so that only the group that fails fails. Returns, per group, the error that
        stopped it (None: its rows have their results)."""
        rows = [row for group in groups for row in group]
        try:
            self.complete_rows(rows)
            return [None] * len(groups)
        except Exception as err:
            if len(groups) == 1:
                return [err]
        errors: list[Exception | None] = []
        for group in groups:
            for row in group:
                row.reset()
            try:
                self.complete_rows(group)
                errors.append(None)
            except Exception as err:
                errors.append(err)
        return errors

    # -- the decoding loop

    @torch.inference_mode()
    def stream_rows(self, rows: list[Row]) -> Iterator[list[Delta]]:
        """Decode `rows` as one left-padded batch with the KV cache; yields, per step, the rows'
        new text (rows that produced none are left out). Sets `row.result` on each row."""
        if not rows:
            return
        generators = [_generator(row, self.device) for row in rows]
        params = [row.params for row in rows]
        ids_BL, mask_BL = self._left_pad([row.prompt_ids for row in rows])
        # Positions count real tokens only, so a padded row sees the positions it would alone.
        positions_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
        next_position_B = mask_BL.sum(-1)
        inputs_BL, past = ids_BL, None
        for _ in range(max(p.max_new_tokens for p in params)):
            timed_out = self._expire(rows)
            if timed_out:
                yield timed_out
            if all(row.result is not None for row in rows):
                return
            out = self.model(
                input_ids=inputs_BL,
                attention_mask=mask_BL,
                position_ids=positions_BL,
                past_key_values=past,
                use_cache=True,
                logits_to_keep=1,
            )
            past = out.past_key_values
            logits_BV = out.logits[:, -1].float()
            if self.pad_id != self.eos_id:
                logits_BV[:, self.pad_id] = float("-inf")  # padding is never an answer
            next_B = sample_next(logits_BV, params, generators)
            deltas = []
            for i, row in enumerate(rows):
                if row.result is None:
                    delta = self._push(row, int(next_B[i]), i)
                    if delta is not None:
                        deltas.append(delta)
            if deltas:
                yield deltas
            inputs_BL = next_B[:, None]
            mask_BL = torch.cat([mask_BL, mask_BL.new_ones(len(rows), 1)], dim=1)
            positions_BL = next_position_B[:, None]
            next_position_B = next_position_B + 1

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids_BL = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask_BL = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids_BL[i, width - len(p) :] = torch.tensor(p)
            mask_BL[i, width - len(p) :] = 1
        return ids_BL.to(self.device), mask_BL.to(self.device)

    def _push(self, row: Row, token: int, index: int) -> Delta | None:
        """Add one sampled token to a running row; returns its new text, if any."""
        row.num_generated += 1
        finish = None
        if token == self.eos_id:
            finish = "stop"
        else:
            row.token_ids.append(token)
        text = self._row_text(row)
        cut = _first_stop(text, row.params.stop)
        if cut is not None:
            text, finish = text[:cut], "stop"
        elif finish is None and row.num_generated >= row.params.max_new_tokens:
            finish = "length"
        if finish is not None:
            return self._finish(row, text, finish, index)
        # Hold back what may still change: a partial UTF-8 character, a partial stop sequence.
        safe = text.rstrip("\ufffd")
        safe = safe[: len(safe) - _held_back(safe, row.params.stop)]
        if len(safe) > len(row.emitted) and safe.startswith(row.emitted):
            delta = safe[len(row.emitted) :]
            row.emitted = safe
            return Delta(index, delta)
        return None

    def _finish(self, row: Row, text: str, reason: str, index: int) -> Delta:
        row.result = Completion(
            text=text,
            token_ids=list(row.token_ids),
            finish_reason=reason,
            prompt_tokens=len(row.prompt_ids),
            completion_tokens=row.num_generated,
        )
        delta = text[len(row.emitted) :] if text.startswith(row.emitted) else ""
        row.emitted = text
        return Delta(index, delta, reason)

    def _expire(self, rows: list[Row]) -> list[Delta]:
        now = time.monotonic()
        return [
            self._finish(row, self._decode(row.token_ids), "timeout", i)
            for i, row in enumerate(rows)
            if row.result is None and row.deadline is not None and now > row.deadline
        ]

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=True)
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def _row_text(self, row: Row) -> str:
        """The row's text so far; with a byte-level tokenizer only the tokens after the last
        whole character are decoded (re-decoding every token at every step was quadratic)."""
        if not self._incremental:
            return self._decode(row.token_ids)
        tail = self._decode(row.token_ids[row.num_done :])
        if tail and not tail.endswith("\ufffd"):
            row.text_done += tail
            row.num_done = len(row.token_ids)
            return row.text_done
        return row.text_done + tail


# ----------------------------------------------------------------------------- helpers


def _params(max_new_tokens, temperature, top_k, top_p, stop) -> SamplingParams:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, stop=stops
    )


def _generator(row: Row, device: torch.device) -> random.Random | None:
    if row.params.greedy:
        return None
    return random.Random(row.seed if row.seed is not None else secrets.randbits(63))


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop sequence starts in `text`, if any."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that could be the start of a stop sequence."""
    longest = max((len(s) for s in stops), default=1) - 1
    for k in range(min(longest, len(text)), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0
