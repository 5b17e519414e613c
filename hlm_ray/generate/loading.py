"""Which models may generate, and the name a model is served under.

check_generation_ready(model_info(folder), ref, folder=folder)   # the readout it generates with;
                                          # refuses encoders and raw heads without a prior
default_model_name("runs/tiny-gen/checkpoint_00000100")   # "tiny-gen/checkpoint_00000100"
"""

from __future__ import annotations

import warnings
from pathlib import Path

from hlm_ray.errors import HLMError
from hlm_ray.pretrained import REGISTRY_SCHEME


def check_generation_ready(
    info: dict[str, str | None],
    ref: str | Path,
    *,
    allow_raw_head: bool = False,
    readout: str | None = None,
    folder: str | Path | None = None,
) -> str | None:
    """The readout a decoder generates with (`hlm_ray.readout`: `readout`, else the model's
    default, read from `folder`); refuses encoders, and a headless decoder that was never
    fine-tuned when all it has is its raw Eᵀ (`tied`: no token counts for the prior readout)
    unless `allow_raw_head` or `readout="tied"` asks for it. None without `folder`."""
    if info["family"] != "decoder":
        raise HLMError(
            f"{ref} is an encoder ({info['model_type']}); only decoders generate text: "
            "pass a decoder run (or one fine-tuned with `hlm finetune --task clm`)"
        )
    raw = info["objective"] == "headless" and info["finetuned"] is None
    chosen = readout
    if folder is not None:
        from hlm_ray.readout import default_readout, read_record, resolve_readout

        chosen = chosen or default_readout(folder)
        if chosen != "tied":  # one the model cannot have fails here, before any weights load
            resolve_readout(folder, chosen)  # its record and counts checked too
        else:
            read_record(folder)  # a damaged readout.json: one line here, not at the first request
    if raw and chosen in (None, "tied"):
        if not (allow_raw_head or readout == "tied"):
            raise HLMError(
                f"{ref} is a headless decoder that was never fine-tuned and has no token counts "
                f"for the prior readout: count them with `hlm data count --model {ref}` (then it "
                f"generates through its prior readout), or run `hlm finetune --task clm --model "
                f"{ref}` (or pass --readout tied / --allow-raw-head to use its raw Eᵀ anyway)"
            )
        warnings.warn(
            f"{ref} is a headless decoder that was never fine-tuned: generating with its raw Eᵀ "
            "head, the tied readout (expect poor text; its prior readout, `--readout prior` "
            "after `hlm data count`, or `hlm finetune --task clm` do better)",
            UserWarning,
            stacklevel=3,
        )
    return chosen


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
