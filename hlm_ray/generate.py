"""Text generation from a decoder: greedy or sampled, batched, streamed. No Ray needed.

    gen = Generator.load("runs/tiny-gen")                  # or a checkpoint/model folder, models:/...
    [c] = gen.generate("The cat", max_new_tokens=20, temperature=0)      # greedy
    c.text, c.token_ids, c.finish_reason, c.prompt_tokens, c.completion_tokens
    outs = gen.generate(["a", "b"], max_new_tokens=20, temperature=0.8, top_p=0.9, seed=1, n=2)
    for delta in gen.stream("The cat", max_new_tokens=20, stop=["."]):
        print(delta.text, end="")

    [c] = gen.generate("The cat", max_new_tokens=1, logprobs=2, prompt_logprobs=True)
    c.prompt_logprobs[1].logprob, c.logprobs[0].top       # scoring (OpenAI's echo + logprobs)

Sampling is ours, not `model.generate`'s (`hlm_ray.sampling`): per step the float32 logits of each
row get its `logit_bias`, go through temperature, top-k, top-p (the order Hugging Face uses) and
are sampled with the row's own seeded generator, so a seeded row gives the same text alone or
batched with other rows (up to float noise). Log-probabilities (`logprobs`, `prompt_logprobs`) are
the log-softmax, in float32, over the whole vocabulary of the model's *un-filtered* logits: no
bias, temperature, top-k/p or padding mask is applied to them. A prompt is scored in the forward
pass that reads it (one pass, not token by token); `max_new_tokens=0` only scores it. Text is
decoded incrementally (`hlm_ray.detokenize`). Prompts are left-padded into one batch with an attention
mask and explicit positions, and decoded with the KV cache (`past_key_values`).

A headless decoder that was never fine-tuned only has the raw Eᵀ head (its input embeddings) and
is refused: `hlm finetune --task clm` gives it a real head (`allow_raw_head=True` overrides).

The server batches rows of several requests, each row with its own settings, through
`Generator.complete_rows` / `Generator.stream_rows`.
"""

from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hlm_ray.batching import RunningBatch
from hlm_ray.detokenize import IncrementalText, text_offsets, token_strings
from hlm_ray.device import device_name
from hlm_ray.errors import HLMError
from hlm_ray.models import max_input_positions
from hlm_ray.pretrained import REGISTRY_SCHEME, load_pretrained, model_info, resolve_model_dir
from hlm_ray.sampling import (  # noqa: F401  (re-exported: the sampling API predates its module)
    TokenLogprob,
    add_logit_bias,
    apply_temperature,
    sample_next,
    token_logprobs,
    top_k_filter,
    top_p_filter,
)

_SEED_MOD = 2**63


# ----------------------------------------------------------------------------- settings, results


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
        # The Rust tokenizer decodes ~5x faster than the transformers wrapper around it.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = backend.decode if backend is not None else None

    @classmethod
    def load(
        cls,
        ref: str | Path,
        *,
        device: str = "cpu",
        allow_raw_head: bool = False,
        name: str | None = None,
        weights: bool = True,
    ) -> Generator:
        """Load a decoder for generation from a run, checkpoint or model folder or a `models:/`
        URI; refuses encoders and un-fine-tuned headless decoders (see module docstring).
        `weights=False`: its tokenizer, limits and names without the weights (the model on the
        meta device), for a process that only tokenizes and formats."""
        device = device_name(device) if weights else "meta"
        folder = resolve_model_dir(ref)  # downloads a registry model once
        info = model_info(folder)
        check_generation_ready(info, ref, allow_raw_head=allow_raw_head)
        pre = load_pretrained(folder, kind="causal_lm", device=device, weights=weights)
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
        # The Rust tokenizer itself when there is one: the same ids as `tokenizer(prompt)` without
        # its Python wrapping (a third of a served request's tokenizing time on a tiny model).
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            ids = backend.encode(prompt, add_special_tokens=False).ids
        else:
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return ids or [self.eos_id]

    def check_length(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        if num_prompt_tokens + max_new_tokens > self.max_positions:
            raise HLMError(
                f"prompt has {num_prompt_tokens} tokens and max_new_tokens={max_new_tokens}: "
                f"together more than the model's {self.max_positions} positions; shorten the "
                "prompt or ask for fewer tokens"
            )

    def check_ids(self, ids: Sequence[int], what: str = "prompt") -> None:
        """Token ids given by a caller must be in the vocabulary."""
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise HLMError(
                f"{what} has token id {bad[0]}, outside the model's vocabulary of "
                f"{self.vocab_size} tokens (0..{self.vocab_size - 1})"
            )

    def rows(
        self,
        prompts: Sequence[str] | str | Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seed: int | None = None,
        n: int = 1,
        deadline: float | None = None,
    ) -> list[Row]:
        """The rows of one request: each prompt (text, or token ids) `n` times (prompt-major,
        OpenAI's choice order)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise HLMError("no prompts given; pass a string or a non-empty list of strings")
        if n < 1:
            raise HLMError(f"n={n} must be >= 1")
        self.check_ids([token for token, _ in params.logit_bias], "logit_bias")
        out = []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids = self.encode(prompt)
            else:
                ids = list(prompt)
                if not ids:
                    raise HLMError("a prompt given as token ids has none")
                self.check_ids(ids)
            self.check_length(len(ids), params.max_new_tokens)
            for choice in range(n):
                out.append(Row(ids, params, row_seed(seed, choice), deadline))
        return out

    # -- the public API

    def generate(
        self, prompts: Sequence[str] | str | Sequence[Sequence[int]], **settings
    ) -> list[Completion]:
        """One completion per prompt and choice (prompt-major). `settings`: the fields of
        `SamplingParams` (max_new_tokens=16, temperature=1.0 (0 is greedy), top_k, top_p, stop,
        logprobs, prompt_logprobs, logit_bias as a dict) and seed, n."""
        return self.complete_rows(self._request_rows(prompts, settings))

    def stream(
        self, prompts: Sequence[str] | str | Sequence[Sequence[int]], **settings
    ) -> Iterator[Delta]:
        """Text deltas as they are decoded; per row (`Delta.index`), they concatenate to the text
        `generate` returns with the same arguments."""
        for deltas in self.stream_rows(self._request_rows(prompts, settings)):
            yield from deltas

    def _request_rows(self, prompts, settings: dict) -> list[Row]:
        seed, n = settings.pop("seed", None), settings.pop("n", 1)
        stop = settings.pop("stop", None)
        bias = settings.pop("logit_bias", None) or {}
        params = SamplingParams(
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            logit_bias=tuple((int(k), float(v)) for k, v in bias.items()),
            **settings,
        )
        return self.rows(prompts, params, seed=seed, n=n)

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

    # -- token text (OpenAI's logprobs object)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token as text (`hlm_ray.detokenize.token_strings`)."""
        return token_strings(self.tokenizer, ids)

    def text_offsets(self, ids: Sequence[int]) -> tuple[list[int], str]:
        """Where each token's text starts in the text of `ids`, and that text."""
        return text_offsets(self._decode, ids)

    # -- the decoding loop

    def stream_rows(self, rows: list[Row]) -> Iterator[list[Delta]]:
        """Decode `rows` as one batch with the KV cache (`hlm_ray.batching.RunningBatch`: rows
        leave as they finish); yields, per step, the rows' new text (rows that produced none are
        left out; `Delta.index` is the row's place in `rows`). Sets `row.result` on each row."""
        for i, row in enumerate(rows):
            row.index = i
        batch = RunningBatch(self)
        events = batch.admit(rows)
        while True:
            if events:
                yield [delta for _, delta in events]
            if not batch.rows:
                return
            events = batch.step()

    def _prefill_scoring(self, rows, ids_BL, mask_BL, positions_BL):
        """The first forward pass when a row scores its prompt: the decoder's last hidden states
        at every position, the head applied per scoring row to its prompt positions only (not a
        (B, L, V) logits tensor for the whole batch). Returns the last position's logits (B, V)
        and the KV cache. Assumes logits = head(last hidden state), as in the GPT-2, GPT-NeoX
        and Llama families (tests compare with the full model's logits)."""
        out = self.model.base_model(
            input_ids=ids_BL,
            attention_mask=mask_BL,
            position_ids=positions_BL,
            use_cache=True,
        )
        head = self.model.get_output_embeddings()
        hidden_BLD = out.last_hidden_state
        width = hidden_BLD.shape[1]
        for i, row in enumerate(rows):
            if not row.params.prompt_logprobs:
                continue
            # Row i's prompt fills the last n positions; position t predicts token t + 1.
            n = len(row.prompt_ids)
            logprobs_TV = head(hidden_BLD[i, width - n : width - 1]).float().log_softmax(-1)
            targets = torch.tensor(row.prompt_ids[1:], device=logprobs_TV.device)
            row.prompt_logprobs = [None] + token_logprobs(
                logprobs_TV, targets, row.params.logprobs or 0
            )
        return head(hidden_BLD[:, -1]).float(), out.past_key_values

    def _logprobs(self, logits_BV: torch.Tensor, rows: list[Row]) -> list:
        """Per row, None or a function of the sampled token giving its TokenLogprob: log-softmax
        in float32 over the full vocabulary of the un-filtered logits (B, V)."""
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        out: list = [None] * len(rows)
        if not wanted:
            return out
        logprobs_WV = logits_BV[wanted].float().log_softmax(-1)
        k = max(rows[i].params.logprobs for i in wanted)
        top_values, top_ids = logprobs_WV.topk(k, dim=-1) if k else (None, None)
        table = logprobs_WV.cpu()
        for w, i in enumerate(wanted):
            k_i = rows[i].params.logprobs
            top = []
            if k_i:
                top = list(
                    zip(top_ids[w, :k_i].tolist(), top_values[w, :k_i].tolist(), strict=True)
                )

            def entry(token: int, row_logprobs=table[w], top=top) -> TokenLogprob:
                return TokenLogprob(token, float(row_logprobs[token]), top)

            out[i] = entry
        return out

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
            row.text.push(token)
        text = row.text.text  # whole characters only
        stops = row.params.stop
        cut = _first_stop(text, stops, row.stop_from)
        # A stop sequence that begins before the text's last (longest stop - 1) characters
        # would have been found already: the next search starts there.
        row.stop_from = max(0, len(text) - max((len(s) for s in stops), default=1) + 1)
        if cut is not None:
            text, finish = text[:cut], "stop"
        elif finish is None and row.num_generated >= row.params.max_new_tokens:
            finish = "length"
        if finish is not None:
            if cut is None:
                text += row.text.flush()  # a partial character at the end, as decode() gives it
            return self._finish(row, text, finish, index)
        # Hold back what may still change: a partial stop sequence.
        safe = text[: len(text) - _held_back(text, stops)]
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
            logprobs=list(row.logprobs) if row.params.logprobs is not None else None,
            prompt_logprobs=row.prompt_logprobs,
        )
        delta = text[len(row.emitted) :] if text.startswith(row.emitted) else ""
        row.emitted = text
        return Delta(index, delta, reason)

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=True)
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )


# ----------------------------------------------------------------------------- helpers


def _first_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the earliest stop sequence starts in `text[start:]`, if any."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that could be the start of a stop sequence."""
    longest = max((len(s) for s in stops), default=1) - 1
    for k in range(min(longest, len(text)), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0
