"""Continuous batching: rows that join a running batch between decoding steps and leave it when
they finish, each with its own slice of the KV cache. No Ray; `Generator.stream_rows` and the
server's decode loop (`hlm_ray.serve.engine`) both decode through it.

    batch = RunningBatch(generator)
    deltas = batch.admit(rows_a)            # prefill rows_a, sample their first token
    deltas = batch.step()                   # one token for every running row
    deltas = batch.admit(rows_b)            # rows_b join: prefilled alone, then merged
    while batch.rows:
        deltas = batch.step()               # [(row, Delta)]; finished rows have left
    batch.drop(rows)                        # a client went away: its rows stop here

Layout: every running row's tokens are right-aligned in one left-padded KV cache, keys and
values (B, H, L, D) per layer, with an attention mask (B, L) that is 0 on the padding and
explicit positions that count real tokens only. Rows that join are prefilled as their own
left-padded batch and concatenated along B after padding the narrower cache on the left; rows
that leave are cut out along B, and columns that have become padding for every row left are
trimmed, so L stays the longest running row. A row therefore sees exactly the keys, values and
positions it sees alone, and samples from its own seeded generator: it decodes the same text
alone or joining any batch at any step (up to float noise).
"""

from __future__ import annotations

import functools
import inspect
import random
import secrets
import time

import torch
import torch.nn.functional as F

from hlm_ray.detokenize import IncrementalText
from hlm_ray.errors import HLMError
from hlm_ray.sampling import add_logit_bias, sample_next


class RunningBatch:
    """Rows decoding together (see module docstring). Not thread-safe: one thread drives it."""

    def __init__(self, generator) -> None:
        self.gen = generator
        self.rows: list = []
        self._draws: list[random.Random | None] = []
        self._past = None  # the model's cache: per layer keys/values (B, H, L, D)
        self._mask_BL: torch.Tensor | None = None
        self._next_B: torch.Tensor | None = None  # each row's last sampled token, fed next
        self._position_B: torch.Tensor | None = None  # the position that token takes

    # ------------------------------------------------------------------------- joining

    @torch.inference_mode()
    def admit(self, rows: list) -> list:
        """Prefill `rows` (one forward pass over their left-padded prompts), sample their first
        token and add the rows still running to the batch. Returns [(row, Delta)]. When the
        prefill fails, the batch is left as it was and the error is raised."""
        if not rows:
            return []
        new = RunningBatch(self.gen)
        events = new._prefill(rows)
        self.merge(new)
        return events

    def merge(self, other: RunningBatch) -> None:
        """Take `other`'s running rows into this batch (other is left empty)."""
        if not other.rows:
            return
        if not self.rows:
            self.__dict__.update(other.__dict__)
            other.__init__(self.gen)
            return
        width = max(self._mask_BL.shape[1], other._mask_BL.shape[1])
        for mine, theirs in zip(_layers(self._past), _layers(other._past), strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(theirs.keys, width)])
            mine.values = torch.cat(
                [_pad_left(mine.values, width), _pad_left(theirs.values, width)]
            )
        self._mask_BL = torch.cat(
            [_pad_left(self._mask_BL, width, dim=1), _pad_left(other._mask_BL, width, dim=1)]
        )
        self._next_B = torch.cat([self._next_B, other._next_B])
        self._position_B = torch.cat([self._position_B, other._position_B])
        self.rows += other.rows
        self._draws += other._draws
        other.__init__(self.gen)

    def take(self, rows: list) -> RunningBatch:
        """Move `rows` (running here) into a batch of their own, with their cache."""
        ids = {id(row) for row in rows}
        out = RunningBatch(self.gen)
        taken = [i for i, row in enumerate(self.rows) if id(row) in ids]
        if taken:
            out._adopt(self, taken)
            self._keep([i for i in range(len(self.rows)) if i not in set(taken)])
        return out

    def drop(self, rows: list) -> None:
        """Stop decoding `rows` (their client went away); they get no result."""
        ids = {id(row) for row in rows}
        self._keep([i for i, row in enumerate(self.rows) if id(row) not in ids])

    # ------------------------------------------------------------------------- decoding

    @torch.inference_mode()
    def step(self) -> list:
        """One new token for every running row; rows that finish leave. Returns
        [(row, Delta)] for rows with new text, a finish, or a timeout."""
        events = self._expire()
        if not self.rows:
            return events
        width = self._mask_BL.shape[1]
        ones_B1 = self._mask_BL.new_ones(len(self.rows), 1)
        mask_BL = torch.cat([self._mask_BL, ones_B1], dim=1)
        try:
            ids_B1, positions_B1 = self._next_B[:, None], self._position_B[:, None]
            logits_BV, _ = _forward(self.gen.model, ids_B1, mask_BL, positions_B1, self._past)
            next_B, logprobs = self._choose(logits_BV)
        except Exception:
            # The forward appends to the cache in place: cut it back, so that the batch is as
            # it was and its rows can step again (alone: `hlm_ray.serve.engine`). A row's
            # generator draws only once its filters passed, the usual place to fail.
            for layer in _layers(self._past):
                layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
            raise
        self._mask_BL = mask_BL
        self._position_B = self._position_B + 1
        return events + self._push(next_B, logprobs)

    def _prefill(self, rows: list) -> list:
        gen = self.gen
        for row in rows:
            row.text = IncrementalText(gen._decode)
        now = time.monotonic()
        events = [(row, _timeout(gen, row)) for row in rows if _late(row, now)]
        self.rows = [row for row in rows if row.result is None]
        if not self.rows:
            return events
        self._draws = [_draw(row) for row in self.rows]
        ids_BL, mask_BL = gen._left_pad([row.prompt_ids for row in self.rows])
        # Positions count real tokens only, so a padded row sees the positions it would alone.
        positions_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
        if any(row.params.prompt_logprobs for row in self.rows):
            logits_BV, past = gen._prefill_scoring(self.rows, ids_BL, mask_BL, positions_BL)
        else:
            logits_BV, past = _forward(gen.model, ids_BL, mask_BL, positions_BL)
        self._past, self._mask_BL = past, mask_BL
        self._position_B = mask_BL.sum(-1)
        # Rows that asked for no new token: their prompt (scored above) was all they wanted.
        for row in self.rows:
            if row.params.max_new_tokens == 0:
                events.append((row, gen._finish(row, "", "length", row.index)))
        return events + self._push(*self._choose(logits_BV))

    def _choose(self, logits_BV: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Each running row's next token (B,) from its float32 logits (B, V), and its
        log-probability entries; changes no state but the rows' generators."""
        gen, rows = self.gen, self.rows
        params = [row.params for row in rows]
        logprobs = gen._logprobs(logits_BV, rows)  # raw logits: before any filter
        if gen.pad_id != gen.eos_id:
            logits_BV[:, gen.pad_id] = float("-inf")  # padding is never an answer
        add_logit_bias(logits_BV, params)
        return sample_next(logits_BV, params, self._draws), logprobs

    def _push(self, next_B: torch.Tensor, logprobs: list) -> list:
        """Add each row's token to its text; finished rows leave."""
        gen, rows = self.gen, self.rows
        events = []
        for i, (row, token) in enumerate(zip(rows, next_B.tolist(), strict=True)):
            if row.result is not None:  # finished in the prefill (max_new_tokens=0)
                continue
            if logprobs[i] is not None:
                row.logprobs.append(logprobs[i](token))
            delta = gen._push(row, token, row.index)
            if delta is not None:
                events.append((row, delta))
        self._next_B = next_B
        self._keep([i for i, row in enumerate(rows) if row.result is None])
        return events

    def _expire(self) -> list:
        now = time.monotonic()
        late = [row for row in self.rows if _late(row, now)]
        if not late:
            return []
        events = [(row, _timeout(self.gen, row)) for row in late]
        self.drop(late)
        return events

    # ------------------------------------------------------------------------- the cache

    def _keep(self, keep: list[int]) -> None:
        """Keep rows `keep` (indices, in order), cut the others out of the cache and trim the
        columns that are padding for every row left."""
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.__init__(self.gen)
            return
        self._adopt(self, keep)

    def _adopt(self, source: RunningBatch, keep: list[int]) -> None:
        """Become rows `keep` of `source` (which may be self)."""
        index = torch.tensor(keep, device=source._mask_BL.device)
        mask_BL = source._mask_BL.index_select(0, index)
        # The first column where some kept row has a real token: the rest is padding for all.
        first = int(mask_BL.any(0).int().argmax())
        past = source._past if source is self else _copy_cache(source._past)
        for layer, src in zip(_layers(past), _layers(source._past), strict=True):
            layer.keys = src.keys.index_select(0, index)[:, :, first:]
            layer.values = src.values.index_select(0, index)[:, :, first:]
        self._past, self._mask_BL = past, mask_BL[:, first:]
        self._next_B = source._next_B.index_select(0, index)
        self._position_B = source._position_B.index_select(0, index)
        rows, draws = source.rows, source._draws
        self.rows = [rows[i] for i in keep]
        self._draws = [draws[i] for i in keep]


# ----------------------------------------------------------------------------- helpers


def _forward(model, ids_BL, mask_BL, positions_BL, past=None):
    """One cached forward pass (the prefill, or a step that appends to `past` in place): the
    last position's logits (B, V) in float32 and the cache."""
    out = model(
        input_ids=ids_BL,
        attention_mask=mask_BL,
        position_ids=positions_BL,
        use_cache=True,
        logits_to_keep=1,
        **{cache_keyword(model): past},
    )
    return out.logits[:, -1].float(), returned_cache(out)


@functools.cache
def _forward_parameters(forward) -> frozenset[str]:
    return frozenset(inspect.signature(forward).parameters)


def cache_keyword(model) -> str:
    """The forward's name for the KV cache: `cache` in the transformers releases that renamed
    it, `past_key_values` before them (the old name warns there, and goes in 5.40)."""
    return "cache" if "cache" in _forward_parameters(type(model).forward) else "past_key_values"


def returned_cache(out):
    """The KV cache a forward pass returned, under either name (`cache_keyword`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _draw(row) -> random.Random | None:
    """The row's own generator: one uniform per sampled token (`hlm_ray.sampling`)."""
    if row.params.greedy:
        return None
    return random.Random(row.seed if row.seed is not None else secrets.randbits(63))


def _late(row, now: float) -> bool:
    return row.deadline is not None and now > row.deadline


def _timeout(gen, row):
    """Finish a row past its deadline with the text it has."""
    return gen._finish(row, row.text.text + row.text.flush(), "timeout", row.index)


def _layers(past) -> list:
    """The cache's layers, each with `keys` and `values` (B, H, L, D)."""
    layers = getattr(past, "layers", None)
    if layers is None or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        raise HLMError(
            f"continuous batching needs a plain dynamic KV cache (one DynamicLayer per layer); "
            f"this model's cache is {type(past).__name__} with "
            f"{sorted({type(layer).__name__ for layer in layers or []})}"
        )
    return layers


def _copy_cache(past):
    """A new cache object of the same kind whose layers' tensors are set by the caller."""
    import copy

    out = copy.copy(past)
    out.layers = [copy.copy(layer) for layer in past.layers]
    return out


def _pad_left(t: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """Zero-pad `t` on the left of `dim` to `width` (keys/values: dim 2 of (B, H, L, D);
    the attention mask: dim 1 of (B, L), where 0 marks the padding)."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [missing, 0]
    return F.pad(t, pad)
