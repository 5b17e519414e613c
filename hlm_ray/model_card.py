"""A model folder's README.md: what the model is, how it was trained, what it scored.

    write_model_card("runs/tiny-headless/model")                      # facts from the run folder
    write_model_card("runs/tiny-gen/model", scores={"lambada/accuracy": 0.21})
    card = model_card_text(folder)                                    # the text, nothing written

The card opens with Hugging Face's YAML front matter (``library_name``, ``pipeline_tag``, ``tags``
with ``headless`` or ``vanilla``, ``encoder`` or ``decoder``), then the facts: the objective,
the family and architecture, the corpus, steps and tokens (from the run folder's ``config.yaml``,
``summary.json`` and ``finetune.json`` when the model folder sits in one), and the scores. A raw
headless decoder is saved as a ``*ForCausalLM`` whose output layer is the tied input embedding,
never trained to predict: its card says in bold, near the top, how it generates: through its
prior readout (`hlm_ray.readout`: its input embeddings plus the log unigram prior of its
training tokens, from ``token_counts.npz`` and ``readout.json``), which hlm_ray applies and
plain `transformers` cannot, or not at all until it is fine-tuned (``hlm finetune --task clm``).
Every decoder's card says which readout it is used with.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

CARD_FILE = "README.md"

_RAW_HEADLESS_WARNING = (
    "**This is a raw headless decoder: it cannot generate text yet.** It was pretrained with "
    "the contrastive (headless) objective, so it has no trained language-modelling head: the "
    "output layer `transformers` loads is the tied input embedding (Eᵀ), which was never "
    "trained to predict the next token, and `generate()` gives junk. Fine-tune it into a "
    "generator first: `hlm finetune --task clm --model <this folder>`."
)


_PRIOR_HEADLESS_NOTE = (
    "**This headless decoder was never fine-tuned: it generates through its prior readout, "
    "which hlm_ray applies and plain `transformers` does not.** Its output layer is the tied "
    "input embedding Eᵀ, whose scores are log p(w | context) − log q(w) up to a constant "
    "(the contrastive loss drew its negatives by token frequency q). `hlm generate`, `hlm "
    "serve` and `hlm eval` add log q(w) back (q: the unigram prior of its training tokens, in "
    "`token_counts.npz`; scale and weight in `readout.json`). A GPT-NeoX or GPT-2 head in "
    "`transformers` has no bias to hold the prior: with plain `transformers`, pass "
    "`hlm_ray.readout.ReadoutProcessor` to `generate()`, or fine-tune a real head with "
    "`hlm finetune --task clm --model <this folder>`."
)
_HEAD_BIAS_NOTE = (
    "Its output head has a trained bias (started at the log unigram prior, `init.prior_bias`) "
    "saved in model.safetensors; `transformers` has no bias in this head and reports the key "
    "as unused: load it with hlm_ray (`hlm_ray.pretrained.load_pretrained`), which restores it."
)


def _readout(folder: Path, what: dict[str, Any]) -> str | None:
    """The readout row of a decoder's card: which readout it is used with, and its numbers."""
    if what["family"] != "decoder":
        return None
    from hlm_ray.readout import READOUT_FILE, default_readout, read_record

    name = default_readout(folder)
    if name == "head":
        return "head (its own output head)"
    if name == "tied":
        return "tied (its input embeddings, raw Eᵀ: no token counts for the prior readout)"
    prior = read_record(folder).get("prior") or {}
    how = prior.get("method", "derived")
    return (
        f"prior: s·h·Eᵀ/τ + β·log q(w), s = {prior.get('scale', 1.0):.4g}, β = "
        f"{prior.get('prior_weight', 1.0):.4g} ({how}; `{READOUT_FILE}`)"
    )


_LOSS = {"headless": "contrastive weight tying", "vanilla": "cross-entropy"}


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _read_yaml(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    import yaml

    return yaml.safe_load(path.read_text())


def describe(config: dict[str, Any]) -> dict[str, Any]:
    """What the HF `config` says the model is: kind, pipeline tag, tags, a one-line title."""
    model_type = config.get("model_type", "")
    family = config.get("hlm_family") or (
        "decoder" if model_type in ("gpt_neox", "gpt2", "llama", "mistral") else "encoder"
    )
    objective = config.get("hlm_objective", "vanilla")
    finetuned = config.get("hlm_finetuned")
    if family == "decoder" and objective == "headless" and not finetuned:
        kind, tag, title = "raw-headless-decoder", "feature-extraction", "Raw headless decoder"
    elif family == "decoder" and finetuned:
        kind, tag = "generator", "text-generation"
        title = f"{objective.capitalize()} decoder fine-tuned into a generator ({finetuned})"
    elif family == "decoder":
        kind, tag, title = "generator", "text-generation", f"{objective.capitalize()} decoder"
    elif finetuned:
        kind, tag = "classifier", "text-classification"
        title = f"{objective.capitalize()} encoder fine-tuned as a classifier ({finetuned})"
    elif objective == "headless":
        kind, tag, title = "encoder", "feature-extraction", "Headless encoder (no MLM head)"
    else:
        kind, tag, title = "encoder", "fill-mask", f"{objective.capitalize()} encoder"
    tags = ["hlm_ray", objective, family]
    if model_type:
        tags.append(model_type)
    if finetuned:
        tags.append("finetuned")
    return {
        "kind": kind,
        "family": family,
        "objective": objective,
        "finetuned": finetuned,
        "model_type": model_type,
        "pipeline_tag": tag,
        "tags": tags,
        "title": title,
    }


def _shape(config: dict[str, Any]) -> str:
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    width = config.get("hidden_size", config.get("n_embd"))
    heads = config.get("num_attention_heads", config.get("n_head"))
    return f"{layers} layers, d={width}, {heads} heads, vocabulary {config.get('vocab_size')}"


def _run_facts(folder: Path) -> list[tuple[str, str]]:
    """Corpus, steps and tokens of the run the model folder came from (its parent folder)."""
    run = folder.parent
    rows: list[tuple[str, str]] = []
    cfg = _read_yaml(run / "config.yaml")
    summary = _read_json(run / "summary.json")
    facts = _read_json(run / "finetune.json")
    if cfg is not None:
        data = cfg.get("data") or {}
        corpus = data.get("prepared") or ", ".join(map(str, data.get("sources") or ()))
        rows.append(("corpus", f"{corpus} (sequences of {data.get('seq_len')} tokens)"))
        if cfg.get("preset"):
            rows.append(("preset", str(cfg["preset"])))
    if facts is not None:
        rows.append(("fine-tuned from", f"`{facts.get('source_model')}` ({facts.get('recipe')})"))
        if facts.get("pretrain_tokens"):
            rows.append(("pretraining tokens", f"{int(facts['pretrain_tokens']):,}"))
    if summary is not None:
        what = "fine-tuning" if facts is not None else "training"
        rows.append((f"{what} steps", f"{summary.get('steps'):,}"))
        rows.append((f"{what} tokens", f"{summary.get('tokens'):,}"))
    return rows


def _has_head_bias(folder: Path) -> bool:
    from hlm_ray.head_bias import saved_head_bias

    return saved_head_bias(folder) is not None


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return str(value)


def _usage(kind: str, pipeline_tag: str, readout: str | None = None) -> str:
    if kind == "raw-headless-decoder" and readout and readout.startswith("prior"):
        return (
            '```bash\nhlm generate --model <this folder> "The cat"      # its prior readout\n'
            "hlm serve --model <this folder>                  # OpenAI-compatible endpoint\n```"
            "\n\nWith `transformers` alone (the readout applied to `generate()`):\n\n"
            "```python\nfrom transformers import AutoModelForCausalLM\n"
            "from hlm_ray.readout import ReadoutProcessor, resolve_readout\n"
            'model = AutoModelForCausalLM.from_pretrained("<this folder>")\n'
            'processor = ReadoutProcessor(resolve_readout("<this folder>"))\n'
            "model.generate(ids, logits_processor=[processor])\n```"
        )
    if kind == "raw-headless-decoder":
        return (
            "```bash\nhlm finetune --task clm --model <this folder> --register NAME\n```\n\n"
            "Its hidden states are usable as they are (`AutoModel.from_pretrained(folder)`)."
        )
    if kind == "classifier":
        return (
            "```python\nfrom transformers import pipeline\n"
            'clf = pipeline("text-classification", model="<this folder>")\n'
            'clf("a sentence"); clf({"text": "first", "text_pair": "second"})\n```\n\n'
            "The tokenizer adds [CLS]/[SEP] exactly as fine-tuning built the inputs."
        )
    return (
        "```python\nfrom transformers import pipeline\n"
        f'pipe = pipeline("{pipeline_tag}", model="<this folder>")\n```'
    )


def model_card_text(
    folder: str | Path,
    *,
    scores: dict[str, Any] | None = None,
    notes: list[str] | None = None,
    base: str | Path | None = None,
) -> str:
    """The README.md text of the model folder `folder` (which holds its `config.json`)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    what = describe(config)
    architecture = (config.get("architectures") or [what["model_type"]])[0]
    front = [
        "---",
        "library_name: transformers",
        f"pipeline_tag: {what['pipeline_tag']}",
        "tags:",
        *(f"- {tag}" for tag in what["tags"]),
        "---",
        "",
        f"# {what['title']}",
        "",
    ]
    readout = _readout(folder, what)
    if what["kind"] == "raw-headless-decoder":
        prior = readout is not None and readout.startswith("prior")
        front += [_PRIOR_HEADLESS_NOTE if prior else _RAW_HEADLESS_WARNING, ""]
    front += [
        "Trained with hlm_ray (headless language models, Godey et al., ICLR 2024: a contrastive "
        "loss against the input embeddings replaces the vocabulary softmax).",
        "",
        "| | |",
        "|---|---|",
        f"| objective | {what['objective']} ({_LOSS.get(what['objective'], 'see config')}) |",
        f"| family | {what['family']} |",
        f"| architecture | {architecture} ({_shape(config)}) |",
    ]
    if what["finetuned"]:
        front.append(f"| fine-tuned | {what['finetuned']} |")
    if readout is not None:
        front.append(f"| readout | {readout} |")
    if config.get("hlm_classify"):
        detail = ", ".join(f"{k} {_format(v)}" for k, v in config["hlm_classify"].items())
        front.append(f"| best classifier | {detail} |")
    if config.get("id2label"):
        labels = ", ".join(f"{k}: {v}" for k, v in config["id2label"].items())
        front.append(f"| labels | {labels} |")
    front += [f"| {k} | {v} |" for k, v in _run_facts(folder)]
    if base is not None:  # the pretrained model it was fine-tuned from
        front += [f"| base model: {k} | {v} |" for k, v in _run_facts(Path(base))]
    if scores:
        front += ["", "## Scores", "", "| metric | value |", "|---|---|"]
        front += [f"| {k} | {_format(v)} |" for k, v in sorted(scores.items())]
    front += ["", "## Use", "", _usage(what["kind"], what["pipeline_tag"], readout)]
    if what["family"] == "decoder" and _has_head_bias(folder):
        front += ["", _HEAD_BIAS_NOTE]
    if notes:
        front += ["", *notes]
    return "\n".join(front) + "\n"


def write_model_card(folder: str | Path, **details: Any) -> Path:
    """Write ``<folder>/README.md`` (replacing an older card); returns its path. `details`: those
    of `model_card_text` (scores, notes, and `base`: the model folder it was fine-tuned from,
    whose run facts (corpus, steps, tokens) are added)."""
    path = Path(folder) / CARD_FILE
    path.write_text(model_card_text(folder, **details))
    return path
