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
- ``code``: lr 1e-4, cosine decay (the authors' code);
- ``text``: lr 1e-4, constant after 2k warm-up steps (the paper's text);
- ``appendix``: lr 1e-5, constant (the appendix table);
- ``tiny``: 40 steps of 32 sequences at lr 1e-3 (CPU tests and demos).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hlm_ray.config import Config, ModelConfig, apply_overrides
from hlm_ray.errors import HLMError
from hlm_ray.pretrained import model_info, resolve_model_dir, run_config_of

_PAPER = {"optim.max_steps": 10_000, "optim.global_batch_size": 256, "optim.weight_decay": 0.01}
RECIPES: dict[str, dict[str, Any]] = {
    "code": {**_PAPER, "optim.lr": 1e-4, "optim.schedule": "cosine", "optim.warmup_steps": 0},
    "text": {**_PAPER, "optim.lr": 1e-4, "optim.schedule": "constant", "optim.warmup_steps": 2000},
    "appendix": {**_PAPER, "optim.lr": 1e-5, "optim.schedule": "constant", "optim.warmup_steps": 0},
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
    folder = resolve_model_dir(model_ref)
    info = model_info(folder)
    if info["family"] != "decoder":
        raise HLMError(
            f"--task clm needs a decoder; {model_ref} is an encoder ({info['model_type']}): "
            "fine-tune encoders with --task glue:<name> or xnli:<lang>"
        )
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
