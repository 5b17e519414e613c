"""The Generator: a decoder, its tokenizer and the decoding loop (prompts to rows, the prefill
that scores prompts, log-probabilities, a sampled token's text and stop sequences).

    gen = Generator.load("runs/tiny-gen")
    [c] = gen.generate("The cat", max_new_tokens=20, temperature=0)

See the package docstring (`hlm_ray.generate`) for the sampling and scoring contract.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from hlm_ray.batching import RunningBatch, returned_cache
from hlm_ray.detokenize import text_offsets, token_strings
from hlm_ray.device import device_name
from hlm_ray.errors import HLMError
from hlm_ray.generate.loading import check_generation_ready, default_model_name
from hlm_ray.generate.params import Completion, Delta, Row, SamplingParams, row_seed
from hlm_ray.generate.stops import first_stop, held_back
from hlm_ray.models import max_input_positions
from hlm_ray.pretrained import load_pretrained, model_info, resolve_model_dir
from hlm_ray.sampling import TokenLogprob, token_logprobs


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
        readout: str | None = None,
    ) -> Generator:
        """Load a decoder for generation from a run, checkpoint or model folder or a `models:/`
        URI; refuses encoders and un-fine-tuned headless decoders (see module docstring).
        `weights=False`: its tokenizer, limits and names without the weights (the model on the
        meta device), for a process that only tokenizes and formats. `readout`: the decoder's
        readout (`hlm_ray.readout`: head, tied, prior; None: the model's default)."""
        device = device_name(device) if weights else "meta"
        folder = resolve_model_dir(ref)  # downloads a registry model once
        info = model_info(folder)
        readout = check_generation_ready(
            info, ref, allow_raw_head=allow_raw_head, readout=readout, folder=folder
        )
        pre = load_pretrained(
            folder, kind="causal_lm", device=device, weights=weights, readout=readout
        )
        info = {**info, "path": str(folder), "readout": readout}
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
        return head(hidden_BLD[:, -1]).float(), returned_cache(out)

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
        cut = first_stop(text, stops, row.stop_from)
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
        safe = text[: len(text) - held_back(text, stops)]
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
