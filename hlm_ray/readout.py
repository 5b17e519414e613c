"""Readouts of a decoder: how its last hidden state h (D,) becomes next-token logits (V,).

    head   the model's own output layer: a vanilla decoder's softmax head, or the head that
           `hlm finetune --task clm` trained for a headless decoder (the "finetuned" readout)
    tied   a headless decoder that was never fine-tuned: its input embeddings, h·Eᵀ / τ, with
           τ the CWT temperature it was trained with
    prior  the logits plus the log of the unigram prior q(w) of the run's training tokens:
           s·(h·Eᵀ / τ) + β·log q(w) for a headless decoder (s, β from readout.json: the
           derived s = β = 1, with a fit on the validation split recorded beside them); z +
           log q(w) for a decoder with a trained head (β = 1, a comparison: its softmax
           already learnt q)

Why `prior` works: CWT scores a target against the other targets of its micro-batch, negatives
drawn by token frequency q(w), so its optimum is h·e_w / τ = log p(w | context) − log q(w) + c
(sampled softmax's "logQ" effect); adding log q(w) back gives the language model.
docs/readout.md has the argument, when it fails and how to choose a readout.

    from hlm_ray.readout import attach_readout, resolve_readout, ReadoutProcessor
    readout = resolve_readout(folder)            # the model's default (readout.json), or
    readout = resolve_readout(folder, "tied")    # one by name
    attach_readout(model, readout)               # model(...).logits are the readout's now
    model.generate(ids, logits_processor=[ReadoutProcessor(readout)])  # plain transformers

The files beside a model's config.json: `token_counts.npz` (`hlm_ray.unigram.COUNTS_FILE`, the
counts of the tokens it trained on) and `readout.json` (`READOUT_FILE`: its default readout,
the CWT temperature, the prior's smoothing, scale and weight). transformers' GPT-NeoX and GPT-2
heads are bias-free `nn.Linear` layers, so the prior cannot travel inside model.safetensors:
`attach_readout` (the project's generator, server, evaluations and lm-evaluation-harness
adapter) and `ReadoutProcessor` (any `generate()` call) apply the same `Readout.apply`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import LogitsProcessor

from hlm_ray.errors import HLMError, one_line
from hlm_ray.unigram import COUNTS_FILE, DEFAULT_ALPHA, Unigram, load_counts

READOUT_FILE = "readout.json"
READOUTS = ("head", "tied", "prior")
RAW_READOUTS = ("tied", "prior")
"""A headless decoder that was never fine-tuned has no trained head: these two only."""
HEAD_READOUTS = ("head", "prior")
"""A decoder with a trained head (vanilla, mixed, or fine-tuned)."""


@dataclass(frozen=True)
class Readout:
    """logits' = scale · logits + prior_weight · log_prior, in float32 (V,) per position."""

    name: str
    scale: float = 1.0
    prior_weight: float = 0.0
    log_prior: np.ndarray | None = field(default=None, repr=False)
    """(V,) natural-log unigram probabilities log q(w) (sum to one in probability)."""
    note: str = ""
    """What it is and how its numbers were chosen, in words (the model card, eval results)."""

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and (self.prior_weight == 0.0 or self.log_prior is None)

    def bias(self) -> torch.Tensor | None:
        """(V,) float32 β·log q(w), or None without a prior."""
        if self.log_prior is None or self.prior_weight == 0.0:
            return None
        return torch.as_tensor(self.prior_weight * self.log_prior, dtype=torch.float32)

    def apply(self, logits_NV: torch.Tensor, bias_V: torch.Tensor | None = None) -> torch.Tensor:
        """The readout's logits from the model's (…, V) logits (any float dtype; float32 out).
        `bias_V`: `self.bias()` already on the logits' device (a caller that reuses it)."""
        out = logits_NV.float()
        if self.scale != 1.0:
            out = out * self.scale
        if bias_V is None:
            bias_V = self.bias()
        if bias_V is not None:
            out = out + bias_V.to(out.device)
        return out


class ReadoutHead(nn.Module):
    """A model's output layer followed by a `Readout` (what `attach_readout` installs).

    Its `weight` is the wrapped layer's (code that reads the head's matrix still finds it); the
    prior is a non-persistent buffer, so nothing about the readout enters a state dict."""

    def __init__(self, head: nn.Module, readout: Readout):
        super().__init__()
        self.head = head
        self.readout = readout
        bias = readout.bias()
        self.register_buffer("bias_V", bias, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, hidden_ND: torch.Tensor) -> torch.Tensor:
        return self.readout.apply(self.head(hidden_ND), self.bias_V)


def attach_readout(model, readout: Readout):
    """Make `model(...).logits` (and `model.get_output_embeddings()(h)`) the readout's logits:
    its output layer is wrapped in a `ReadoutHead` (an identity readout leaves it as it is; an
    earlier readout is replaced). Returns the model."""
    head = model.get_output_embeddings()
    if isinstance(head, ReadoutHead):
        head = head.head
    if readout.is_identity:
        model.set_output_embeddings(head)
    else:
        device = next(head.parameters()).device
        model.set_output_embeddings(ReadoutHead(head, readout).to(device))
    model.hlm_readout = readout
    return model


def readout_of(model) -> Readout | None:
    """The readout `attach_readout` gave the model (None: its own head, never attached)."""
    return getattr(model, "hlm_readout", None)


class ReadoutProcessor(LogitsProcessor):
    """`Readout.apply` as a transformers `LogitsProcessor`, for a plain `model.generate(...,
    logits_processor=[ReadoutProcessor(readout)])` on a model loaded without hlm_ray. It must
    come first (before temperature or top-k), as the project's own generator applies it."""

    def __init__(self, readout: Readout):
        self.readout = readout
        self._bias = readout.bias()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.readout.apply(scores, self._bias)


# --- what a model folder records ---------------------------------------------------------------


def read_record(folder: str | Path) -> dict[str, Any]:
    """The folder's readout.json ({} when there is none), checked (`record_problem`): a
    damaged record is one line, never numbers read as NaN or a readout silently replaced."""
    path = Path(folder) / READOUT_FILE
    if not path.is_file():
        return {}
    again = f"write it again with `hlm data count --model {Path(folder)} --force`"
    try:
        record = json.loads(path.read_text())
    except (ValueError, OSError) as err:
        raise HLMError(f"{path} is not valid JSON ({one_line(err)}); {again}") from None
    problem = record_problem(record)
    if problem is not None:
        raise HLMError(f"{path} is damaged: {problem}; {again}")
    return record


def record_problem(record: Any) -> str | None:
    """What is wrong with a readout.json's contents, in a few words; None when they are usable.
    Each number a readout reads must be one, finite: the CWT temperature and the smoothing
    alpha positive, the prior's scale positive and its weight any finite number."""
    if not isinstance(record, dict):
        return f"it holds a JSON {type(record).__name__}, not an object"
    name = record.get("readout")
    if name is not None and name not in READOUTS:
        return f"readout {name!r} is none of {', '.join(READOUTS)}"
    for key in ("temperature", "alpha"):
        if key in record and not _number(record[key], positive=True):
            return f"{key} {record[key]!r} is not a positive finite number"
    prior = record.get("prior")
    if prior is None:
        return None
    if not isinstance(prior, dict):
        return f"prior is a JSON {type(prior).__name__}, not an object"
    for key, positive in (("scale", True), ("prior_weight", False)):
        if key in prior and not _number(prior[key], positive=positive):
            kind = "a positive finite number" if positive else "a finite number"
            return f"prior.{key} {prior[key]!r} is not {kind}"
    return None


def _number(value: Any, *, positive: bool) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return ok and math.isfinite(value) and (value > 0 or not positive)


def write_record(folder: str | Path, record: dict[str, Any]) -> Path:
    path = Path(folder) / READOUT_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    return path


def is_raw_headless(config: dict[str, Any]) -> bool:
    """A headless decoder never fine-tuned: its only output layer is the tied Eᵀ."""
    return (
        config.get("hlm_family") == "decoder"
        and config.get("hlm_objective") == "headless"
        and not config.get("hlm_finetuned")
    )


def _config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def has_prior(folder: str | Path) -> bool:
    return (Path(folder) / COUNTS_FILE).is_file()


def default_readout(folder: str | Path) -> str:
    """The readout a model is used with when none is asked for: `head` for a decoder with a
    trained head; for a raw headless decoder, the one its readout.json records, else `prior`
    when it has token counts, else `tied` (its raw Eᵀ)."""
    folder = Path(folder)
    if not is_raw_headless(_config(folder)):
        return "head"
    recorded = read_record(folder).get("readout")
    if recorded in RAW_READOUTS:
        return recorded
    return "prior" if has_prior(folder) else "tied"


def temperature_of(folder: Path, record: dict[str, Any]) -> float:
    """The CWT temperature the model was trained with: readout.json's, else that of the
    config.yaml beside the model (a run or checkpoint) or inside it (a registered copy), else 1."""
    if "temperature" in record:
        return float(record["temperature"])
    for candidate in (folder.parent / "config.yaml", folder / "config.yaml"):
        if candidate.is_file():
            import yaml

            saved = yaml.safe_load(candidate.read_text()) or {}
            return float((saved.get("objective") or {}).get("temperature", 1.0))
    return 1.0


def log_prior(folder: str | Path, record: dict[str, Any] | None = None) -> tuple[np.ndarray, str]:
    """(log q (V,), how it was smoothed) from the folder's counts and readout.json's alpha."""
    folder = Path(folder)
    record = read_record(folder) if record is None else record
    if not has_prior(folder):
        raise HLMError(
            f"{folder} has no token counts ({COUNTS_FILE}), which the prior readout needs; "
            f"count them from its training corpus with `hlm data count --model {folder}`"
        )
    counts, meta = load_counts(folder / COUNTS_FILE)
    vocab = _config(folder).get("vocab_size")
    if len(counts) != vocab or not counts.any():
        what = f"{len(counts)} counts" if len(counts) != vocab else "counts that are all zero"
        raise HLMError(
            f"{folder / COUNTS_FILE} holds {what} for a vocabulary of {vocab}: not this "
            f"model's training tokens; count them again with `hlm data count --model {folder} "
            "--force`"
        )
    alpha = float(record.get("alpha", DEFAULT_ALPHA))
    smoothing = record.get("alpha_source", f"add-{alpha:g}")
    what = f"{int(counts.sum()):,} {meta.get('what', 'tokens')}, {smoothing}"
    return Unigram(counts, alpha, smoothing).log_probs(), what


def resolve_readout(folder: str | Path, name: str | None = None) -> Readout:
    """The readout `name` (None: `default_readout`) of the decoder in model folder `folder`, with
    its numbers from readout.json and token_counts.npz; a readout the model cannot have (`tied`
    on a trained head, `head` on a raw headless decoder, `prior` without counts) is refused in
    one line that says what to do."""
    folder = Path(folder)
    config = _config(folder)
    if config.get("hlm_family", "decoder") != "decoder":
        raise HLMError(f"{folder} is an encoder: readouts are for decoders")
    raw = is_raw_headless(config)
    name = name or default_readout(folder)
    allowed = RAW_READOUTS if raw else HEAD_READOUTS
    if name not in allowed:
        what = "a headless decoder that was never fine-tuned" if raw else "a decoder with a head"
        hint = (
            "; its trained head is `head` (fine-tune it with `hlm finetune --task clm` for one)"
            if raw
            else ""
        )
        raise HLMError(
            f"--readout {name}: {folder} is {what}, whose readouts are {', '.join(allowed)}{hint}"
        )
    if name == "head":
        return Readout("head", note="the model's own output head")
    record = read_record(folder)
    tau = temperature_of(folder, record)
    if name == "tied":
        return Readout("tied", scale=1.0 / tau, note=f"tied input embeddings h·Eᵀ/τ, τ = {tau:g}")
    log_q, what = log_prior(folder, record)
    if not raw:
        return Readout("prior", 1.0, 1.0, log_q, note=f"own head + log q (weight 1; q: {what})")
    chosen = record.get("prior") or {}
    scale, weight = float(chosen.get("scale", 1.0)), float(chosen.get("prior_weight", 1.0))
    how = chosen.get("method", "derived")
    note = (
        f"tied input embeddings + log prior: {scale:.4g}·h·Eᵀ/τ + {weight:.4g}·log q(w) "
        f"(τ = {tau:g}, scale and weight {how}; q: {what})"
    )
    return Readout("prior", scale / tau, weight, log_q, note=note)


def load_readout(model, folder: str | Path, name: str | None = None) -> Readout:
    """`resolve_readout` then `attach_readout` on a loaded decoder; returns the readout."""
    readout = resolve_readout(folder, name)
    attach_readout(model, readout)
    return readout
