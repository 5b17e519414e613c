"""Headless decoder -> generator: a new, untied language-modelling head, trained with
cross-entropy on a small slice of the pretraining data (the paper's §4 / Appendix recipe).

    cfg, info = clm_config("runs/tiny-headless", recipe="tiny", output_dir="runs/tiny-gen")
    summary = train_worker(cfg.to_dict())        # or launch(cfg) on Ray Train (what the CLI does)

The fine-tune is an ordinary hlm_ray training run (same loop, checkpoints, MLflow run) whose
config says: start from the headless model (`init.model_dir`), add a head that is a copy of the
input embedding (`init.new_head`), train with the vanilla objective on the run's own corpus and
tokenizer. The result is a plain `transformers` causal LM with ``hlm_finetuned: "clm"`` in its
config. `probe=True` trains the head only.

Recipes: the paper's sources disagree, so all three are here (batch 256 sequences, 10k steps):
- ``text``: lr 1e-4, constant after 2k linear warm-up steps (§4.2), and "all other
  hyperparameters are kept similar to pretraining": the pretraining run's AdamW betas, eps,
  weight decay and clipping (Table 7's (0.9, 0.95), 1e-8, 0.1, 1 for a model without its run
  config);
- ``code``: lr 1e-4, cosine decay from step 0 (the authors' code), the optimizer as ``text``;
- ``appendix``: Table 14: lr 1e-5, constant after 2k linear warm-up steps, weight decay 0
  (the table gives no betas: the pretraining ones, as ``text``);
- ``tiny``: 40 steps of 32 sequences at lr 1e-3 (CPU tests and demos).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hlm_ray.config import Config, ModelConfig, apply_overrides
from hlm_ray.errors import HLMError
from hlm_ray.finetune.source import source_model
from hlm_ray.pretrained import run_config_of

# §4.2: "we fine-tune our headless models ... for 10000 steps using an effective batch size of
# 256" (Table 14 agrees).
_PAPER = {"optim.max_steps": 10_000, "optim.global_batch_size": 256}
# §4.2: "All other hyperparameters are kept similar to pretraining": Table 7's AdamW (betas
# (0.9, 0.95), eps 1e-8), weight decay 0.1, clipping 1. `clm_config` replaces these with the
# pretraining run's own values when the model comes with its run config.
PRETRAINING_OPTIM = {
    "optim.betas": (0.9, 0.95),
    "optim.eps": 1e-8,
    "optim.weight_decay": 0.1,
    "optim.grad_clip": 1.0,
}
RECIPES: dict[str, dict[str, Any]] = {
    # The authors' fine-tuning code: lr 1e-4, cosine, no warm-up (NOTES.md).
    "code": {
        **_PAPER,
        **PRETRAINING_OPTIM,
        "optim.lr": 1e-4,
        "optim.schedule": "cosine",
        "optim.warmup_steps": 0,
    },
    # §4.2: "a learning rate of 1e-4, and a constant learning rate schedule with 2000 linear
    # warm-up steps".
    "text": {
        **_PAPER,
        **PRETRAINING_OPTIM,
        "optim.lr": 1e-4,
        "optim.schedule": "constant",
        "optim.warmup_steps": 2000,
    },
    # Table 14: learning rate 1e-5, weight decay 0, LR schedule constant, linear warm-up 2000
    # (no betas in the table: the pretraining ones, as the text says).
    "appendix": {
        **_PAPER,
        **PRETRAINING_OPTIM,
        "optim.lr": 1e-5,
        "optim.weight_decay": 0.0,
        "optim.schedule": "constant",
        "optim.warmup_steps": 2000,
    },
    "tiny": {
        "optim.max_steps": 40,
        "optim.global_batch_size": 32,
        "optim.lr": 1e-3,
        "optim.schedule": "constant",
        "optim.warmup_steps": 4,
        "optim.weight_decay": 0.0,
        "run.log_every": 10,
        "run.eval_every": 20,
        "run.checkpoint_every": 20,
    },
}


# What a recipe sets itself, whatever the pretraining run used.
_TABLE_14_OWN = {"appendix": ("optim.weight_decay",)}


def clm_config(
    model_ref: str | Path,
    *,
    recipe: str = "tiny",
    probe: bool = False,
    output_dir: str | Path,
    overrides: list[str] | dict[str, Any] | None = None,
) -> tuple[Config, dict[str, Any]]:
    """The training config of the fine-tune, and facts to log (source, token fraction)."""
    if recipe not in RECIPES:
        raise HLMError(f"unknown clm recipe {recipe!r}; choose one of: {', '.join(RECIPES)}")
    hint = "fine-tune encoders with --task glue:<name> or xnli:<lang>"
    folder, info = source_model(model_ref, "decoder", "--task clm", hint=hint)
    if info["objective"] != "headless":
        raise HLMError(
            f"{model_ref} is a {info['objective']} decoder: it was trained with a real head, so "
            "there is nothing to fine-tune; evaluate or serve it as it is"
        )
    if info["finetuned"]:
        raise HLMError(f"{model_ref} is already fine-tuned ({info['finetuned']}); use it as is")
    base = run_config_of(folder)
    model_cfg = base.model if base is not None else model_config_from_hf(folder)
    data = base.data.__dict__ if base is not None else {}
    settings: dict[str, Any] = {
        **{f"model.{k}": v for k, v in model_cfg.__dict__.items()},
        **{f"data.{k}": v for k, v in data.items()},
        "objective.name": "vanilla",
        "tokenizer.kind": "file",
        "tokenizer.path": str(folder),
        "init.model_dir": str(folder),
        "init.new_head": True,
        "init.train": "head" if probe else "all",
        "run.output_dir": str(output_dir),
        **RECIPES[recipe],
    }
    if base is not None:
        for key in PRETRAINING_OPTIM:  # "kept similar to pretraining": the run's own values
            if key in RECIPES[recipe] and key not in _TABLE_14_OWN.get(recipe, ()):
                settings[key] = getattr(base.optim, key.removeprefix("optim."))
        settings["run.seed"] = base.run.seed
        settings["objective.ce_impl"] = base.objective.ce_impl
        settings["optim.micro_batch_size"] = min(
            base.optim.micro_batch_size, settings["optim.global_batch_size"]
        )
        settings["optim.precision"] = base.optim.precision
    cfg = apply_overrides(Config(preset=f"clm-{recipe}"), settings)
    if overrides:
        cfg = apply_overrides(cfg, overrides)
    cfg = apply_overrides(cfg, {"preset": f"clm-{recipe}{'-probe' if probe else ''}"})
    tokens = cfg.optim.max_steps * cfg.optim.global_batch_size * cfg.data.seq_len
    pretrain_tokens = _pretraining_tokens(folder, base)
    facts = {
        "source_model": str(model_ref),
        "source_dir": str(folder),
        "recipe": recipe,
        "probe": probe,
        "finetune_tokens": tokens,
        "pretrain_tokens": pretrain_tokens,
        "pretrain_token_fraction": tokens / pretrain_tokens if pretrain_tokens else None,
    }
    return cfg, facts


def fixed_config(cfg: Config, facts: dict[str, Any], settings: dict[str, Any]):
    """The fine-tune `cfg` with fixed steps, batch and rate (`settings`, dotted keys; warm-up a
    tenth of its steps, the micro-batch at most the batch), and its `facts` updated: what a
    preset records (`hlm_ray.finetune.generators.GENERATORS`)."""
    steps = settings["optim.max_steps"]
    batch = settings.get("optim.global_batch_size", cfg.optim.global_batch_size)
    extra = {"optim.warmup_steps": max(1, steps // 10),
             "optim.micro_batch_size": min(cfg.optim.micro_batch_size, batch), **settings}  # fmt: skip
    cfg = apply_overrides(cfg, extra)
    tokens = cfg.optim.max_steps * cfg.optim.global_batch_size * cfg.data.seq_len
    fraction = tokens / facts["pretrain_tokens"] if facts.get("pretrain_tokens") else None
    return cfg, {**facts, "finetune_tokens": tokens, "pretrain_token_fraction": fraction}


def model_config_from_hf(folder: Path) -> ModelConfig:
    """The ModelConfig of a model folder that came without its hlm_ray config."""
    hf = json.loads((folder / "config.json").read_text())
    kind = hf.get("model_type")
    if kind == "gpt_neox":
        rope = hf.get("rope_parameters") or {}
        return ModelConfig(
            arch="gpt_neox",
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_positions=hf["max_position_embeddings"],
            rotary_pct=rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25)),
        )
    if kind == "gpt2":
        return ModelConfig(
            arch="gpt2",
            hidden_size=hf["n_embd"],
            num_layers=hf["n_layer"],
            num_heads=hf["n_head"],
            intermediate_size=hf.get("n_inner"),
            max_positions=hf["n_positions"],
        )
    raise HLMError(f"{folder} holds a {kind} model; --task clm supports gpt_neox and gpt2")


def _pretraining_tokens(folder: Path, base: Config | None) -> int | None:
    summary = folder.parent / "summary.json"
    if summary.is_file():
        return int(json.loads(summary.read_text())["tokens"])
    if base is not None:
        return base.optim.max_steps * base.optim.global_batch_size * base.data.seq_len
    return None


def write_facts(output_dir: str | Path, facts: dict[str, Any]) -> Path:
    path = Path(output_dir) / "finetune.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(facts, indent=1))
    return path
