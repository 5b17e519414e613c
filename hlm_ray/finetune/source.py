"""The model a fine-tune starts from: resolved to its folder and refused, with what to do
instead, when it is not of the family the fine-tune needs.

    folder, info = source_model("runs/tiny-headless", "decoder", "--task clm",
                                hint="fine-tune encoders with --task glue:<name> or xnli:<lang>")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hlm_ray.errors import HLMError
from hlm_ray.pretrained import model_info, resolve_model_dir


def source_model(
    model_ref: str | Path, family: str, what: str, *, hint: str = ""
) -> tuple[Path, dict[str, Any]]:
    """The folder and `model_info` of `model_ref` (a registry model downloaded once); an
    HLMError naming `what` needs and, after a colon, `hint` when it is not a `family` model."""
    folder = resolve_model_dir(model_ref)
    info = model_info(folder)
    if info["family"] != family:
        raise HLMError(
            f"{what} needs {_a(family)}; {model_ref} is {_a(info['family'])} "
            f"({info['model_type']})" + (f": {hint}" if hint else "")
        )
    return folder, info


def _a(word: str) -> str:
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"
