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

import yaml

from hlm_ray.config import OBJECTIVES, Config, apply_overrides, flatten
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

PRESETS: dict[str, dict[str, Any]] = {
    # Tiny CPU variants: train in well under a minute on 2 cores.
    "tiny-decoder": {
        "model": {
            "arch": "gpt_neox",
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 2,
            "max_positions": 128,
        },
        "tokenizer": {"kind": "bpe", "vocab_size": 1024},
        "data": {"seq_len": 64},
        "optim": _TINY_OPTIM,
        "run": _TINY_RUN,
    },
    "tiny-encoder": {
        "model": {
            "arch": "bert",
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 2,
            "max_positions": 128,
        },
        "tokenizer": {"kind": "bpe", "vocab_size": 1024},
        "data": {"seq_len": 64},
        "optim": _TINY_OPTIM,
        "run": _TINY_RUN,
    },
    # gpt2-11m shrunk to CPU scale with its own small BPE (the 50k GPT-2 vocabulary would make
    # the vanilla head most of the work): the tiny decoder sweeps.
    "tiny-gpt2": {
        "model": {
            "arch": "gpt2",
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 2,
            "max_positions": 128,
            "dropout": 0.0,
        },
        "tokenizer": {"kind": "bpe", "vocab_size": 1024},
        "data": {"seq_len": 64},
        "optim": {**_TINY_OPTIM, "schedule": "cosine", "grad_clip": 1.0},
        "run": _TINY_RUN,
    },
    # Paper Table 10 / Figure 8: the batch-size ablation decoder (GPT-2, 11M parameters).
    "gpt2-11m": {
        "model": {
            "arch": "gpt2",
            "hidden_size": 192,
            "num_layers": 3,
            "num_heads": 3,
            "max_positions": 1024,
            "dropout": 0.1,
        },
        "tokenizer": {"kind": "file", "path": "tokenizers/gpt2"},
        "data": {"seq_len": 128},
        "optim": {
            "lr": 2.5e-4,
            "weight_decay": 0.01,
            "grad_clip": 1.0,
            "schedule": "cosine",
            "warmup_steps": 2000,
            "max_steps": 1_000_000,
            "global_batch_size": 64,
            "micro_batch_size": 64,
        },
        "run": {"eval_every": 2000, "checkpoint_every": 5000, "log_every": 50},
    },
    # Paper Table 9 / Figure 7: the vocabulary ablation encoder (BERT-Small, L4 H512 A8).
    "bert-small": {
        "model": {
            "arch": "bert",
            "hidden_size": 512,
            "num_layers": 4,
            "num_heads": 8,
            "intermediate_size": 2048,
            "max_positions": 512,
            "dropout": 0.1,
        },
        "tokenizer": {"kind": "bpe", "vocab_size": 32768},
        "data": {"seq_len": 128},
        "optim": {
            "lr": 2e-4,
            "weight_decay": 0.01,
            "grad_clip": 1.0,
            "schedule": "linear",
            "warmup_steps": 10_000,
            "max_steps": 400_000,
            "global_batch_size": 64,
            "micro_batch_size": 64,
        },
        "run": {"eval_every": 5000, "checkpoint_every": 10_000, "log_every": 50},
    },
    # Paper Table 7: Pythia-70M decoders (K = 8 × 2047 rows per device).
    "pythia-70m": {
        "model": {
            "arch": "gpt_neox",
            "hidden_size": 512,
            "num_layers": 6,
            "num_heads": 8,
            "intermediate_size": 2048,
            "max_positions": 2048,
            "rotary_pct": 0.25,
        },
        "tokenizer": {"kind": "file", "path": "tokenizers/gpt-neox-20b"},
        "data": {"seq_len": 2048},
        "optim": {
            "lr": 1e-3,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "weight_decay": 0.1,
            "grad_clip": 1.0,
            "schedule": "cosine",
            "warmup_steps": 1430,
            "max_steps": 143_000,
            "global_batch_size": 1024,
            "micro_batch_size": 8,
        },
        "run": {"eval_every": 1000, "checkpoint_every": 1000, "log_every": 10},
    },
    # Paper Table 6: bert-base encoders with the Pythia tokenizer, sequence length 128.
    "bert-base": {
        "model": {
            "arch": "bert",
            "hidden_size": 768,
            "num_layers": 12,
            "num_heads": 12,
            "intermediate_size": 3072,
            "max_positions": 512,
            "dropout": 0.1,
        },
        "tokenizer": {"kind": "file", "path": "tokenizers/gpt-neox-20b"},
        "data": {"seq_len": 128},
        "optim": {
            "lr": 1e-4,
            "weight_decay": 0.01,
            "grad_clip": 1.0,
            "schedule": "linear",
            "warmup_steps": 10_000,
            "max_steps": 1_000_000,
            "global_batch_size": 256,
            "micro_batch_size": 32,
        },
        "run": {"eval_every": 10_000, "checkpoint_every": 10_000, "log_every": 100},
    },
    # Paper Table 8: the multilingual encoder (distilbert-base-multilingual-cased, 119k vocab).
    "distilbert-multilingual": {
        "model": {
            "arch": "distilbert",
            "hidden_size": 768,
            "num_layers": 6,
            "num_heads": 12,
            "intermediate_size": 3072,
            "max_positions": 512,
            "dropout": 0.1,
        },
        "tokenizer": {"kind": "file", "path": "distilbert/distilbert-base-multilingual-cased"},
        "data": {"seq_len": 128},
        "optim": {
            "lr": 2e-4,
            "weight_decay": 0.01,
            "grad_clip": 1.0,
            "schedule": "linear",
            "warmup_steps": 10_000,
            "max_steps": 400_000,
            "global_batch_size": 64,
            "micro_batch_size": 64,
        },
        "run": {"eval_every": 10_000, "checkpoint_every": 10_000, "log_every": 100},
    },
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
        if not path.is_file():
            raise HLMError(f"config file {path} not found")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise HLMError(f"config file {path} is not valid YAML: {err}".splitlines()[0]) from None
        flat = dict(flatten(loaded))
        cfg = apply_overrides(cfg, flat)
    if overrides:
        cfg = apply_overrides(cfg, overrides)
    return cfg
