"""Load a trained model and its tokenizer from wherever it lives.

Every stage after pretraining (fine-tuning, evaluation, generation, serving) starts here:

    pre = load_pretrained("runs/tiny-headless")           # a run folder (uses <run>/model)
    pre = load_pretrained("runs/x/checkpoint_00000050")   # a checkpoint folder
    pre = load_pretrained("runs/x/model")                 # a model folder (save_pretrained)
    pre = load_pretrained("models:/tiny-gen/1")           # the MLflow model registry
    pre.model, pre.tokenizer, pre.family, pre.objective, pre.path, pre.run_config
    pre = load_pretrained("runs/tiny-headless", readout="auto")  # logits through its readout
    pre.readout                                             # hlm_ray.readout.Readout, or None

A model folder holds `config.json` (with `hlm_objective` / `hlm_family`, written by hlm_ray) and
the tokenizer; a run or checkpoint folder also holds the `config.yaml` it was trained with, which
fine-tuning reads to find the pretraining data. A decoder's readout (`hlm_ray.readout`: its
own head, the tied input embeddings, or either plus the log unigram prior) is attached when
`readout` is given; a head bias saved with `init.prior_bias` is always restored.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hlm_ray.config import Config
from hlm_ray.errors import HLMError
from hlm_ray.paths import resolve_input

if TYPE_CHECKING:  # transformers is imported where a model is loaded, not to find its folder
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

REGISTRY_SCHEME = "models:/"
_KINDS = ("auto", "causal_lm", "encoder", "masked_lm")


@dataclass
class Pretrained:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast
    family: str  # "decoder" | "encoder"
    objective: str  # the pretraining objective: "headless" | "vanilla" | "mixed"
    finetuned: str | None  # "clm" once `hlm finetune --task clm` gave a headless decoder a head
    path: Path  # the model folder
    run_config: Config | None  # the config it was trained with, when the folder has one
    source: str  # what the user passed (path or models:/ URI)
    readout: object | None = None  # the hlm_ray.readout.Readout attached, when one was asked


def resolve_model_dir(ref: str | Path) -> Path:
    """The model folder (`config.json` + weights + tokenizer) that `ref` names."""
    text = str(ref)
    if text.startswith(REGISTRY_SCHEME):
        from hlm_ray.tracking import download_model

        return resolve_model_dir(download_model(text))
    path = resolve_input(text)
    if not path.exists():
        raise HLMError(f"model {text} does not exist; {_HINT}")
    for candidate in (path, path / "model"):
        if (candidate / "config.json").is_file():
            return candidate.resolve()
    raise HLMError(f"{text} is not a model (no config.json in it or in {text}/model); {_HINT}")


_HINT = (
    "pass a run folder, a checkpoint folder, a model folder written by save_pretrained, "
    "or models:/NAME/VERSION"
)


def model_info(model_dir: str | Path) -> dict[str, str | None]:
    """{"family", "objective", "finetuned", "model_type"} from a model folder's config.json, without loading
    the weights."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    model_type = config.get("model_type", "")
    family = config.get("hlm_family") or (
        "decoder" if model_type in ("gpt_neox", "gpt2", "llama", "mistral") else "encoder"
    )
    return {
        "family": family,
        "objective": config.get("hlm_objective", "vanilla"),
        "finetuned": config.get("hlm_finetuned"),
        "model_type": model_type,
    }


def run_config_of(model_dir: Path) -> Config | None:
    """The hlm_ray config the model was trained with: `config.yaml` beside the model folder
    (a run or checkpoint), or inside it (a registered model)."""
    for candidate in (model_dir.parent / "config.yaml", model_dir / "config.yaml"):
        if candidate.is_file():
            import yaml

            return Config.from_dict(yaml.safe_load(candidate.read_text()))
    return None


def load_pretrained(
    ref: str | Path,
    *,
    kind: str = "auto",
    device: str = "cpu",
    weights: bool = True,
    readout: str | None = None,
) -> Pretrained:
    """Load model + tokenizer. `kind`: "causal_lm" (decoders), "masked_lm" (an encoder with its
    MLM head, vanilla only), "encoder" (the bare body of any encoder), or "auto" (the class the
    model was saved as). `weights=False`: the model's structure and config on PyTorch's meta
    device, no weights read and no memory for them (for a process that only tokenizes, like a
    serving replica whose decode process holds the model); it cannot run. `readout` (decoders):
    None leaves the logits as transformers computes them; "auto" is the model's default
    readout, or a name of `hlm_ray.readout.READOUTS`."""
    if kind not in _KINDS:
        raise HLMError(f"kind={kind!r} is not one of {', '.join(_KINDS)}")
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    from hlm_ray.tokenizer import load_tokenizer

    folder = resolve_model_dir(ref)
    info = model_info(folder)
    if kind == "causal_lm" and info["family"] != "decoder":
        raise HLMError(f"{ref} is an encoder ({info['model_type']}); this needs a decoder")
    if kind in ("encoder", "masked_lm") and info["family"] != "encoder":
        raise HLMError(f"{ref} is a decoder ({info['model_type']}); this needs an encoder")
    if kind == "auto":
        kind = "causal_lm" if info["family"] == "decoder" else "encoder"
        if info["family"] == "encoder" and info["objective"] != "headless":
            kind = "masked_lm"
    if kind == "masked_lm" and info["objective"] == "headless":
        raise HLMError(f"{ref} is a headless encoder: it has no masked-LM head")
    if readout not in (None, "auto") and kind != "causal_lm":
        raise HLMError(f"--readout {readout}: {ref} is an encoder; readouts are for decoders")
    cls = {"causal_lm": AutoModelForCausalLM, "masked_lm": AutoModelForMaskedLM}.get(
        kind, AutoModel
    )
    bias = None  # a head bias (init.prior_bias): transformers reports it unused, hlm restores it
    if weights and kind == "causal_lm":
        from hlm_ray.head_bias import saved_head_bias

        bias = saved_head_bias(folder)
    try:
        if weights:
            with _transformers_quiet(bias is not None):
                model = cls.from_pretrained(str(folder)).to(device)
        else:
            import torch
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(folder))
            with torch.device("meta"):
                model = cls.from_config(config)
        tokenizer = load_tokenizer(folder)
    except (OSError, ValueError) as err:
        raise HLMError(f"cannot load the model in {folder}: {str(err).splitlines()[0]}") from None
    attached = None
    if bias is not None:
        from hlm_ray.head_bias import add_head_bias

        add_head_bias(model, bias)
    if weights and kind == "causal_lm" and readout is not None:
        from hlm_ray.readout import load_readout

        attached = load_readout(model, folder, None if readout == "auto" else readout)
    model.eval()
    return Pretrained(
        model=model,
        tokenizer=tokenizer,
        family=info["family"],
        objective=info["objective"],
        finetuned=info["finetuned"],
        path=folder,
        run_config=run_config_of(folder),
        source=str(ref),
        readout=attached,
    )


@contextlib.contextmanager
def _transformers_quiet(quiet: bool):
    """transformers' loading report at error level only, while `quiet` (a key it does not
    know, which hlm_ray puts back itself)."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
