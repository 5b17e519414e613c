"""Bits per byte of one decoder through each of its readouts (`hlm_ray.readout`), for sweeps
that compare them: a raw headless decoder through `tied` and `prior`, a decoder with a trained
head (vanilla, mixed) through `prior` (its head plus log q: a check that should score worse).

    scores = readout_bpb("runs/x/model", limit=100)     # {"bpb/tied": 3.49, "bpb/prior": 2.63}
    readout_bpb("runs/x/model", ["prior"], limit=100)    # one readout by name
    compared_readouts(model_info(folder))                 # ("tied", "prior") / ("prior",) / ()

The protocol is `hlm_ray.evaluate.bpb`'s (the same texts, context length and windows as
`hlm eval --task bpb`, so `bpb/<readout>` equals `hlm eval --task bpb --readout <readout>`),
with one forward pass per readout.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from hlm_ray.evaluate.bpb import DEFAULT_NUM_TEXTS, bits_per_byte, default_bpb_texts
from hlm_ray.evaluate.common import context_length_of

log = logging.getLogger(__name__)


def compared_readouts(info: dict) -> tuple[str, ...]:
    """The readouts a sweep scores besides the model's own head (`pretrained.model_info`)."""
    if info["family"] != "decoder" or info["finetuned"]:
        return ()
    return ("tied", "prior") if info["objective"] == "headless" else ("prior",)


def readout_bpb(
    model_dir: str | Path,
    readouts: Sequence[str] | None = None,
    *,
    limit: int | None = DEFAULT_NUM_TEXTS,
    batch_size: int = 32,
    device: str = "cpu",
    progress: bool = False,
) -> dict[str, float]:
    """{"bpb/<readout>": bits per byte} of the decoder in `model_dir` through each readout
    (None: `compared_readouts`) on the first `limit` bits-per-byte texts."""
    from hlm_ray.pretrained import load_pretrained, model_info, resolve_model_dir
    from hlm_ray.readout import attach_readout, has_prior, resolve_readout

    folder = resolve_model_dir(model_dir)
    names = compared_readouts(model_info(folder)) if readouts is None else tuple(readouts)
    if readouts is None and "prior" in names and not has_prior(folder):
        # A model saved before runs counted their tokens: no prior to score, said once.
        log.warning("%s has no token counts: no bpb/prior (`hlm data count` adds them)", folder)
        names = tuple(n for n in names if n != "prior")
    if not names:
        return {}
    readouts_by_name = {name: resolve_readout(folder, name) for name in names}  # errors first
    pre = load_pretrained(folder, kind="causal_lm", device=device)
    length, _ = context_length_of(pre.run_config, pre.model.config, str(folder))
    texts = default_bpb_texts(limit=limit or DEFAULT_NUM_TEXTS)
    scores = {}
    for name, readout in readouts_by_name.items():
        attach_readout(pre.model, readout)
        out = bits_per_byte(
            pre.model, pre.tokenizer, texts, batch_size=batch_size, seq_len=length,
            progress=progress,
        )  # fmt: skip
        scores[f"bpb/{name}"] = out["bpb"]
    return scores
