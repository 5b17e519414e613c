"""Hugging Face models built from config, and the pieces the objectives need.

The model returns hidden states; the objectives own the loss. Which HF class is built:
- decoders (gpt_neox, gpt2): ``*ForCausalLM``. A headless decoder ties its output head to the
  input embedding (the raw Eᵀ head, no extra parameters; `hlm finetune --task clm` gives it a
  real one), so any `transformers` user can load it with `AutoModelForCausalLM`.
- encoders (bert, distilbert): ``*ForMaskedLM`` for vanilla and mixed; the bare body for
  headless, since CWT reads the raw last layer and a prediction head would be dead weight
  (and unused parameters break DDP).

    model = build_model(cfg.model, vocab_size=len(tok), objective="headless", special_ids=ids)
    hidden_BLD = hidden_states(model, input_ids_BL)        # after the final layer norm
    E_VD = input_embedding_weight(model)                    # what CWT scores against
    head = lm_head(model)                                   # LMHead(transform, weight, bias)

Every saved config carries ``hlm_objective`` and ``hlm_family`` so later stages know what they
load.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertModel,
    DistilBertConfig,
    DistilBertForMaskedLM,
    DistilBertModel,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from hlm_ray.config import ModelConfig
from hlm_ray.errors import HLMError
from hlm_ray.objectives import LMHead

_HF_CLASSES: dict[str, type[PretrainedConfig]] = {
    "gpt_neox": GPTNeoXConfig,
    "gpt2": GPT2Config,
    "bert": BertConfig,
    "distilbert": DistilBertConfig,
}
_MPE = "max_position_embeddings"
# Each ModelConfig field under its name in each architecture's config (in _HF_CLASSES's order).
_HF_NAMES = {
    "hidden_size": ("hidden_size", "n_embd", "hidden_size", "dim"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_hidden_layers", "n_layers"),
    "num_heads": ("num_attention_heads", "n_head", "num_attention_heads", "n_heads"),
    "intermediate_size": ("intermediate_size", "n_inner", "intermediate_size", "hidden_dim"),
    "max_positions": (_MPE, "n_positions", _MPE, _MPE),
}
# The dropout fields that all take model.dropout.
_HF_DROPOUT = {
    "gpt_neox": ("hidden_dropout", "attention_dropout"),
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "distilbert": ("dropout", "attention_dropout"),
}


def hf_config(
    cfg: ModelConfig, vocab_size: int, objective: str, special_ids: dict[str, int]
) -> PretrainedConfig:
    """The `transformers` config for `cfg`, with the tokenizer's size and special ids."""
    column = list(_HF_CLASSES).index(cfg.arch)
    values = {f: getattr(cfg, f) for f in _HF_NAMES}
    values["intermediate_size"] = cfg.intermediate_size or 4 * cfg.hidden_size
    kwargs = {names[column]: values[f] for f, names in _HF_NAMES.items()}
    kwargs |= dict.fromkeys(_HF_DROPOUT[cfg.arch], cfg.dropout)
    eos, pad = special_ids.get("eos_token"), special_ids.get("pad_token")
    if cfg.family == "decoder":
        kwargs |= dict(bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    else:
        kwargs["pad_token_id"] = pad if pad is not None else 0
    if cfg.arch == "gpt_neox":
        rope = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": cfg.rotary_pct,
        }
        # Pythia's head is untied; a headless decoder's only head is Eᵀ.
        kwargs |= dict(rope_parameters=rope, use_parallel_residual=True)
        kwargs["tie_word_embeddings"] = objective == "headless"
    elif cfg.arch == "gpt2":
        kwargs["tie_word_embeddings"] = True  # GPT-2 ties its head, vanilla or headless
    hf = _HF_CLASSES[cfg.arch](vocab_size=vocab_size, **kwargs)
    hf.hlm_objective = objective
    hf.hlm_family = cfg.family
    return hf


def model_class(arch: str, objective: str) -> type[PreTrainedModel]:
    if arch == "gpt_neox":
        return GPTNeoXForCausalLM
    if arch == "gpt2":
        return GPT2LMHeadModel
    if arch == "bert":
        return BertModel if objective == "headless" else BertForMaskedLM
    return DistilBertModel if objective == "headless" else DistilBertForMaskedLM


def build_model(
    cfg: ModelConfig, *, vocab_size: int, objective: str, special_ids: dict[str, int]
) -> PreTrainedModel:
    """A randomly initialised model for `objective`, with `cfg.attn_impl` attention."""
    attn_impl = resolve_attention(cfg.attn_impl)
    hf = hf_config(cfg, vocab_size, objective, special_ids)
    cls = model_class(cfg.arch, objective)
    kwargs = {"add_pooling_layer": False} if cls is BertModel else {}
    model = cls._from_config(hf, attn_implementation=attn_impl, **kwargs)
    return model


def body(model: PreTrainedModel) -> nn.Module:
    """The transformer without any head (the model itself for a bare encoder)."""
    return getattr(model, model.base_model_prefix, model)


def hidden_states(
    model: PreTrainedModel,
    input_ids_BL: torch.Tensor,
    attention_mask_BL: torch.Tensor | None = None,
) -> torch.Tensor:
    """Last hidden states (B, L, D): after the final layer norm for decoders, the raw last
    layer for encoders (no BERT prediction transform: CWT predicts from it directly)."""
    out = body(model)(input_ids=input_ids_BL, attention_mask=attention_mask_BL)
    return out.last_hidden_state


def input_embedding_weight(model: PreTrainedModel) -> torch.Tensor:
    """The input embedding table (V, D): CWT's targets are its rows."""
    return model.get_input_embeddings().weight


def lm_head(model: PreTrainedModel) -> LMHead:
    """The vocabulary head as (transform, weight, bias), so objectives can chunk or fuse it."""
    if isinstance(model, GPTNeoXForCausalLM | GPT2LMHeadModel):
        head = model.lm_head  # a bias only with init.prior_bias (hlm_ray.head_bias)
        return LMHead(transform=None, weight=head.weight, bias=head.bias)
    if isinstance(model, BertForMaskedLM):
        pred = model.cls.predictions
        return LMHead(transform=pred.transform, weight=pred.decoder.weight, bias=pred.bias)
    if isinstance(model, DistilBertForMaskedLM):

        def transform(h: torch.Tensor) -> torch.Tensor:
            return model.vocab_layer_norm(model.activation(model.vocab_transform(h)))

        proj = model.vocab_projector
        return LMHead(transform=transform, weight=proj.weight, bias=proj.bias)
    raise HLMError(
        f"{type(model).__name__} has no language-modelling head (a headless encoder); "
        "use the headless objective or fine-tune it"
    )


def objective_of(model_or_config: PreTrainedModel | PretrainedConfig) -> str:
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "hlm_objective", "vanilla")


def num_parameters(model: nn.Module, *, exclude_embeddings: bool = False) -> int:
    params = {id(p): p for p in model.parameters()}
    if exclude_embeddings:
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                params.pop(id(module.weight), None)
    return sum(p.numel() for p in params.values())


# --- attention backends ------------------------------------------------------------------------


def resolve_attention(name: str) -> str:
    """The `attn_implementation` string for transformers; registers xformers on first use."""
    if name != "xformers":
        return name
    if not torch.cuda.is_available():
        raise HLMError("model.attn_impl=xformers needs a CUDA GPU; use sdpa on this machine")
    try:
        import xformers.ops  # noqa: F401
    except ImportError:
        raise HLMError(
            "model.attn_impl=xformers needs the xformers package: pip install 'hlm_ray[gpu]'"
        ) from None
    from transformers import AttentionInterface

    AttentionInterface.register("xformers", xformers_attention)
    return "xformers"


def xformers_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q, k, v are (B, H, L, Dh); returns
    (B, L, H, Dh). Packed pretraining batches carry no padding mask; a padded batch (mask given)
    goes to sdpa, which takes the additive mask as is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from xformers.ops import LowerTriangularMask, memory_efficient_attention

    if attention_mask is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    bias = LowerTriangularMask() if causal and query.shape[2] > 1 else None
    out = memory_efficient_attention(
        query.transpose(1, 2),  # (B, L, H, Dh): xformers' layout
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_bias=bias,
        p=dropout if module.training else 0.0,
        scale=scaling,
    )
    return out, None


# --- starting from a trained model (fine-tuning) -----------------------------------------------


def init_from_pretrained(
    model: PreTrainedModel, model_dir: str, *, new_head: bool, train: str = "all"
) -> PreTrainedModel:
    """Load the weights of `model_dir` into `model` (same architecture, same vocabulary).

    `new_head`: the paper's recipe for a headless decoder: a language-modelling head that starts
    as an *untied copy* of the input embedding E (V, D), so it begins exactly at the raw Eᵀ head
    and then learns on its own while E keeps its role as input table. `train="head"` freezes
    everything but that head (a linear probe)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    folder = Path(model_dir)
    source = json.loads((folder / "config.json").read_text())
    if source.get("vocab_size") != model.config.vocab_size:
        raise HLMError(
            f"{model_dir} has vocab_size {source.get('vocab_size')} but the model being "
            f"initialised has {model.config.vocab_size}; use the tokenizer saved with that model"
        )
    weights = load_file(str(folder / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    head_keys = {"lm_head.weight", "embed_out.weight"}
    if set(missing) - head_keys or unexpected:
        raise HLMError(
            f"{model_dir} does not match the model being initialised (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}); fine-tune with the architecture it was trained with"
        )
    if new_head:
        embedding = input_embedding_weight(model)
        head = model.get_output_embeddings()
        head.weight = nn.Parameter(embedding.detach().clone())  # untied: its own storage
        model.config.tie_word_embeddings = False
        model.config.hlm_objective = source.get("hlm_objective", "vanilla")
        model.config.hlm_finetuned = "clm"
    if train == "head":
        for param in model.parameters():
            param.requires_grad_(False)
        model.get_output_embeddings().weight.requires_grad_(True)
    return model


def max_input_positions(config) -> int | None:
    """The longest input (in tokens) a Hugging Face model config allows, from whichever of
    `max_position_embeddings`, `n_positions`, `n_ctx` it has; `config` is a `PretrainedConfig`
    or its config.json as a dict (or None: a model without one). None when it does not say."""
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
