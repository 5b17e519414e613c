"""Which models may generate, and the name a model is served under.

check_generation_ready(model_info(folder), ref)   # refuses encoders and raw headless decoders
default_model_name("runs/tiny-gen/checkpoint_00000100")   # "tiny-gen/checkpoint_00000100"
"""

from __future__ import annotations

import warnings
from pathlib import Path

from hlm_ray.errors import HLMError
from hlm_ray.pretrained import REGISTRY_SCHEME


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
