"""Named presets: the paper's setups (Appendix A) and tiny CPU variants.

    from hlm_ray.presets import get_preset, load_config, PRESETS
    cfg = get_preset("bert-base", objective="headless")   # micro-batch 64, global 512
    cfg = load_config("tiny-decoder", yaml_file="my.yaml", overrides=["optim.lr=3e-4"])

Each preset is a set of overrides on the `Config` defaults, plus per-objective overrides where
the paper trained the two arms differently (bert-base: 32 / 64 sequences per device). The paper's
corpora (OpenWebText2, CC-News, multilingual Wikipedia) are not shipped here: every preset reads
the default English corpus unless `data.sources` is overridden with a hub dataset or local files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hlm_ray.config import OBJECTIVES, Config, apply_overrides, flatten
from hlm_ray.config.parse import read_yaml
from hlm_ray.errors import HLMError

_TINY_RUN = {"log_every": 10, "eval_every": 50, "eval_batches": 4, "checkpoint_every": 50}
_TINY_OPTIM = {
    "lr": 3e-3,
    "schedule": "linear",
    "warmup_steps": 10,
    "max_steps": 150,
    # Two accumulation steps in one process, one step each on 2 workers: both run as given.
    "global_batch_size": 32,
    "micro_batch_size": 16,
    "weight_decay": 0.01,
}

# Tiny CPU variants (train in well under a minute on 2 cores): D=64, 2 layers, 2 heads, 128
# positions, their own 1024-token BPE, 64-token blocks. tiny-gpt2 is gpt2-11m shrunk to CPU
# scale with its own small BPE (the 50k GPT-2 vocabulary would make the vanilla head most of
# the work): the tiny decoder sweeps.
_TINY: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # name: (arch, extra model fields, optimiser changes)
    "tiny-decoder": ("gpt_neox", {}, {}),
    "tiny-encoder": ("bert", {}, {}),
    "tiny-gpt2": ("gpt2", {"dropout": 0.0}, {"schedule": "cosine", "grad_clip": 1.0}),
}

# The paper's setups (Appendix A), one row each: arch, width D, layers, heads, MLP width (None:
# 4 D), positions, dropout, the tokenizer (a data-folder path or hub name; a number: a BPE of
# that size trained on the corpus), sequence length.
_MULTILINGUAL = "distilbert/distilbert-base-multilingual-cased"
_PAPER_MODELS: dict[str, tuple] = {
    # Table 10 / Figure 8: the batch-size ablation decoder (GPT-2, 11M parameters).
    "gpt2-11m": ("gpt2", 192, 3, 3, None, 1024, 0.1, "tokenizers/gpt2", 128),
    # Table 9 / Figure 7: the vocabulary ablation encoder (BERT-Small, L4 H512 A8).
    "bert-small": ("bert", 512, 4, 8, 2048, 512, 0.1, 32768, 128),
    # Table 7: Pythia-70M decoders (K = 8 × 2047 rows per device).
    "pythia-70m": ("gpt_neox", 512, 6, 8, 2048, 2048, 0.0, "tokenizers/gpt-neox-20b", 2048),
    # Table 6: bert-base encoders with the Pythia tokenizer, sequence length 128.
    "bert-base": ("bert", 768, 12, 12, 3072, 512, 0.1, "tokenizers/gpt-neox-20b", 128),
    # Figure 6: the multilingual encoder (distilbert-base-multilingual-cased, 119k vocabulary).
    "distilbert-multilingual": ("distilbert", 768, 6, 12, 3072, 512, 0.1, _MULTILINGUAL, 128),
}
# lr, schedule, warm-up steps, steps, global batch, micro-batch, then validation, checkpoint and
# log intervals (steps). Weight decay 0.01 and clipping at 1.0 unless _PAPER_EXTRA says more.
_PAPER_OPTIM: dict[str, tuple] = {
    "gpt2-11m": (2.5e-4, "cosine", 2000, 1_000_000, 64, 64, 2000, 5000, 50),
    "bert-small": (2e-4, "linear", 10_000, 400_000, 64, 64, 5000, 10_000, 50),
    "pythia-70m": (1e-3, "cosine", 1430, 143_000, 1024, 8, 1000, 1000, 10),
    "bert-base": (1e-4, "linear", 10_000, 1_000_000, 256, 32, 10_000, 10_000, 100),
    "distilbert-multilingual": (2e-4, "linear", 10_000, 400_000, 64, 64, 10_000, 10_000, 100),
}
_PAPER_EXTRA = {"pythia-70m": {"betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}


def _tiny(arch: str, model: dict[str, Any], optim: dict[str, Any]) -> dict[str, Any]:
    """A tiny preset: the shared CPU-scale settings, then its row of `_TINY`."""
    shape = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "max_positions": 128}
    return {
        "model": {"arch": arch, **shape, **model},
        "tokenizer": {"kind": "bpe", "vocab_size": 1024},
        "data": {"seq_len": 64},
        "optim": {**_TINY_OPTIM, **optim},
        "run": _TINY_RUN,
    }


def _paper(name: str) -> dict[str, Any]:
    """A paper preset from its rows of `_PAPER_MODELS` and `_PAPER_OPTIM`."""
    arch, width, layers, heads, mlp, positions, dropout, tokenizer, seq_len = _PAPER_MODELS[name]
    lr, schedule, warmup, steps, batch, micro, *intervals = _PAPER_OPTIM[name]
    model = dict(arch=arch, hidden_size=width, num_layers=layers, num_heads=heads)
    model.update(intermediate_size=mlp, max_positions=positions, dropout=dropout)
    optim = dict(lr=lr, weight_decay=0.01, grad_clip=1.0, schedule=schedule)
    optim.update(warmup_steps=warmup, max_steps=steps)
    optim.update(global_batch_size=batch, micro_batch_size=micro, **_PAPER_EXTRA.get(name, {}))
    bpe = {"kind": "bpe", "vocab_size": tokenizer}
    return {
        "model": model,
        "tokenizer": bpe if isinstance(tokenizer, int) else {"kind": "file", "path": tokenizer},
        "data": {"seq_len": seq_len},
        "optim": optim,
        "run": dict(zip(("eval_every", "checkpoint_every", "log_every"), intervals, strict=True)),
    }


PRESETS: dict[str, dict[str, Any]] = {
    **{name: _tiny(*row) for name, row in _TINY.items()},
    **{name: _paper(name) for name in _PAPER_MODELS},
}

# Where the paper trained the arms differently (Table 6: device batch 32 / 64, batch 256 / 512).
OBJECTIVE_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    "bert-base": {"headless": {"optim": {"micro_batch_size": 64, "global_batch_size": 512}}},
}


def get_preset(name: str, objective: str | None = None) -> Config:
    """The preset's config, with `objective.name` set and its per-objective settings applied."""
    if name not in PRESETS:
        raise HLMError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    if objective is not None and objective not in OBJECTIVES:
        raise HLMError(f"unknown objective {objective!r}; choose one of: {', '.join(OBJECTIVES)}")
    overrides = dict(flatten(PRESETS[name]))
    overrides["preset"] = name
    if objective is not None:
        overrides["objective.name"] = objective
        extra = OBJECTIVE_OVERRIDES.get(name, {}).get(objective, {})
        overrides.update(flatten(extra))
    return apply_overrides(Config(), overrides)


def load_config(
    preset: str = "tiny-decoder",
    *,
    objective: str | None = None,
    yaml_file: str | Path | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
) -> Config:
    """Preset (with its settings for `objective`), then the YAML file, then dotted overrides."""
    cfg = get_preset(preset, objective=objective)
    if yaml_file is not None:
        path = Path(yaml_file)
        if path.is_dir():
            yamls = sorted(p.name for p in path.glob("*.y*ml"))[:3]
            hint = f" (it holds {', '.join(yamls)})" if yamls else ""
            raise HLMError(f"--config {path} is a folder{hint}; pass one YAML file")
        if not path.exists():
            raise HLMError(f"config file {path} not found")
        if not path.is_file():
            raise HLMError(f"--config {path} is not a regular file; pass one YAML file")
        loaded = read_yaml(path, path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise HLMError(
                f"config file {path} holds a {type(loaded).__name__}, not a mapping of sections; "
                "write it as `optim:` / `  lr: 3e-4` lines (the sections of `hlm presets`)"
            )
        flat = dict(flatten(loaded))
        cfg = apply_overrides(cfg, flat)
    if overrides:
        cfg = apply_overrides(cfg, overrides)
    return cfg
