"""The typed config tree (model, tokenizer, data, objective, optim, run, init): the schema alone.

Every entry point builds one `Config` from a preset, an optional YAML file and dotted overrides
(`hlm_ray.presets.load_config`), and validates it before any work starts. Ray and Tune carry it
as a plain dict (`to_dict` / `Config.from_dict`) and turn it back into a `Config` on the first
line of a worker.

    cfg = apply_overrides(Config(), ["objective.name=vanilla", "optim.lr=3e-4"])
    cfg.optim.grad_accum_steps(world_size=2)   # derived from the global batch, checked
    spec = build(SweepSpec, {"values": [8, 16]}, prefix="sweep.")   # any dataclass from a dict

An invalid value raises `HLMError` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from hlm_ray.errors import HLMError

Arch = Literal["gpt_neox", "gpt2", "bert", "distilbert"]
DECODERS = ("gpt_neox", "gpt2")
ENCODERS = ("bert", "distilbert")


@dataclass(frozen=True)
class ModelConfig:
    arch: Arch = "gpt_neox"
    """Hugging Face architecture: gpt_neox / gpt2 (decoders, causal LM), bert / distilbert
    (encoders, masked LM)."""
    hidden_size: int = 64
    """Width D of the residual stream (and of the embeddings the CWT loss compares)."""
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int | None = None
    """MLP width; None means 4 × hidden_size."""
    max_positions: int = 128
    """Position embeddings / rotary cache length: data.seq_len must not exceed it."""
    rotary_pct: float = 0.25
    """GPT-NeoX only: fraction of each head's dimensions that get rotary embeddings."""
    dropout: float = 0.0
    attn_impl: Literal["sdpa", "eager", "xformers"] = "sdpa"
    """Attention backend; xformers needs the `gpu` extra and CUDA."""

    @property
    def family(self) -> str:
        return "decoder" if self.arch in DECODERS else "encoder"


@dataclass(frozen=True)
class TokenizerConfig:
    kind: Literal["bpe", "file"] = "bpe"
    """bpe: train a byte-level BPE on the corpus (cached); file: load `path`."""
    vocab_size: int = 1024
    """Requested size for kind=bpe (the real size, which the model uses, may be smaller)."""
    path: str | None = None
    """kind=file: a tokenizer.json, a folder, a data-folder path (tokenizers/gpt2) or hub name."""
    min_frequency: int = 2
    train_sample_bytes: int | None = 100_000_000
    """kind=bpe: the BPE trains on a seeded sample of this many bytes of *training* documents
    (never validation ones); None: all of them."""


@dataclass(frozen=True)
class DataConfig:
    sources: tuple[str, ...] = ("corpus/en",)
    """Local text/JSONL/parquet files or folders, data-folder paths, or hub dataset names."""
    prepared: str | None = None
    """A folder written by `hlm data prepare` (it then replaces sources and the tokenizer
    settings); None: the cache's prepared folder for `sources` (prepared when missing)."""
    text_field: str = "text"
    seq_len: int = 64
    """Tokens per packed block."""
    val_fraction: float = 0.02
    """Share of documents held out for validation (by a seeded hash of each document)."""
    split_seed: int = 0
    """Seed of the document-level train/validation split (and of the BPE's sample)."""
    max_tokens: int | None = None
    """Use only the first max_tokens training tokens (None: all of them)."""
    shard_tokens: int = 1 << 24
    """Tokens per shard of a prepared folder."""
    invalid_utf8: Literal["refuse", "replace"] = "refuse"
    """A text file that is not valid UTF-8: refuse it (an error naming it) or replace the bad
    bytes with U+FFFD."""
    mlm_probability: float = 0.15


ObjectiveName = Literal["headless", "vanilla", "mixed"]
OBJECTIVES: tuple[str, ...] = get_args(ObjectiveName)
"""The objectives (`objective.name`), the one list every check and choice reads."""


@dataclass(frozen=True)
class ObjectiveConfig:
    name: ObjectiveName = "headless"
    """headless: contrastive weight tying; vanilla: cross-entropy over the vocabulary;
    mixed: cwt_weight × CWT + ce_weight × CE."""
    temperature: float = 1.0
    cwt_variant: Literal["dedup", "plain", "mask_same"] = "dedup"
    """dedup and plain give the same loss (dedup scores unique target ids with a log-count);
    mask_same removes same-id negatives: a different objective, for ablation."""
    cwt_chunk_size: int | None = None
    """Score the K×K logits in row chunks of this size (None: all at once)."""
    cwt_compile: bool = False
    """Run the CWT loss through torch.compile (fused softmax; same loss and gradients)."""
    cross_worker_negatives: bool = False
    """Score each worker's predictions against all workers' targets (changes the objective)."""
    num_negatives: int | None = None
    """A separate negative set S_N (the paper's footnote): score each row against a seeded
    random subset of N of its micro-batch's targets instead of all of them (plain counting,
    so cwt_variant dedup or plain; a different objective). None: every in-batch target."""
    ce_impl: Literal["full", "chunked", "linear"] = "full"
    """Vanilla head: full logits, row-chunked, or torch's fused linear cross-entropy."""
    ce_chunk_size: int = 4096
    """Rows per chunk of the chunked and linear vanilla heads (chunk_size × V logits at once)."""
    vanilla_impl: Literal["torch", "liger", "cce", "cce_compile"] = "torch"
    """Vanilla head kernel: torch (ce_impl decides), or the `gpu` extra's fused kernels: Liger,
    Cut Cross-Entropy (CUDA; no head bias), its torch.compile path cce_compile (any device)."""
    mlm_full_logits: bool = False
    """Vanilla MLM: apply the head at every position (the paper's baseline) instead of masked
    positions only (the stronger baseline)."""
    cwt_weight: float = 1.0
    ce_weight: float = 1.0


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    decay_bias_and_norm: bool = False
    """Apply weight decay to biases and norm weights too (the paper's code did, by accident)."""
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    """After warm-up: linear decay to 0, cosine decay to 0, or constant."""
    warmup_steps: int = 0
    max_steps: int = 100
    grad_clip: float | None = 1.0
    global_batch_size: int = 16
    """Sequences per optimizer step, over all workers and accumulation steps."""
    micro_batch_size: int = 16
    """Sequences per forward pass on one device: K for the CWT loss comes from this."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """auto: bf16 autocast on a CUDA device that supports it, fp32 otherwise."""
    embedding_update: Literal["dense", "lazy"] = "dense"
    """dense: AdamW over the whole input-embedding table every step (the paper's optimizer).
    lazy: sparse gradients for the table and a row-wise AdamW over the rows a step touches, so
    the step's cost no longer grows with the vocabulary; untouched rows pause their momentum and
    weight decay, so results differ from dense (see hlm_ray/train/optim.py). Needs a table no
    vocabulary head reads: headless models, or vanilla gpt_neox (untied head)."""
    compile: bool = False
    """torch.compile the training step's model + loss forward (either objective)."""

    def grad_accum_steps(self, world_size: int) -> int:
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:
            raise HLMError(
                f"optim.global_batch_size={self.global_batch_size} is not divisible by "
                f"micro_batch_size × workers = {self.micro_batch_size} × {world_size}; "
                "choose a global batch that is a multiple of it"
            )
        return self.global_batch_size // per_step


@dataclass(frozen=True)
class RunConfig:
    output_dir: str = "runs/default"
    seed: int = 0
    device: str = "auto"
    """auto (CUDA if available), cpu, cuda."""
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    fail_at_step: int | None = None
    """Fault injection for tests: raise once at this step (the worker dies mid-run)."""


@dataclass(frozen=True)
class InitConfig:
    """Where the weights start. Empty: random initialisation (pretraining)."""

    model_dir: str | None = None
    """A model folder to start from (`hlm finetune` sets it); its architecture must match
    `model`."""
    new_head: bool = False
    """Give the decoder a language-modelling head that is an untied copy of the input embedding
    (the paper's recipe for turning a headless decoder into a generator)."""
    train: Literal["all", "head"] = "all"
    """Which parameters learn: everything, or only the new head (a linear probe)."""


@dataclass(frozen=True)
class BudgetConfig:
    """How much compute a run may use, so arms compare at equal compute (`hlm_ray.budget`).
    At most one is set; the steps it becomes replace `optim.max_steps` (the learning-rate
    schedule spans them) and are logged as `budget/steps`. None everywhere: `optim.max_steps`."""

    tokens: int | None = None
    """Training tokens: steps = floor(tokens / (global_batch_size × seq_len)), never more."""
    flops: float | None = None
    """Training FLOPs by `hlm_ray.flops` (forward + backward matmuls of every micro-batch):
    steps = floor(flops / FLOPs per optimizer step), never more."""
    seconds: float | None = None
    """Wall time of the optimizer steps (setup, validation and checkpoints not counted): the run
    stops at the first step that ends past it and saves a checkpoint there. `optim.max_steps`
    stays the cap and the schedule's length."""
    unique_columns: int | None = None
    """budget.flops with the de-duplicated CWT: the U (distinct target ids per micro-batch)
    its FLOPs per step are computed with. None: measured on the run's first micro-batch (the
    measured `train/U` of the whole run is logged beside it)."""


@dataclass(frozen=True)
class ClassifyConfig:
    """How an encoder is fine-tuned as a sequence classifier (`hlm finetune --task glue:...`);
    the recipes (tiny, paper, paper-XNLI) are in `hlm_ray.classify.finetune`."""

    seeds: tuple[int, ...] = (0, 1, 2)
    """One fine-tune per seed (the classifier head's initialisation and the data order); the
    summary is the mean / std over seeds at each seed's best epoch."""
    epochs: int = 10
    """Passes over the training set, evaluating after each."""
    lr: float = 1e-5
    """AdamW learning rate, constant after the warm-up."""
    batch_size: int = 32
    warmup_fraction: float = 0.1
    """Share of all steps spent warming the learning rate up linearly from 0."""
    weight_decay: float = 0.01
    loss: Literal["balanced", "ce"] = "balanced"
    """balanced: each class's cross-entropy divided by its frequency in the batch (the paper's
    GLUE default); ce: plain cross-entropy. Regression tasks (STS-B) use MSE either way."""
    max_length: int = 128
    """Tokens per (pair of) input(s), truncated longest-first; capped by the model's positions."""
    train_limit: int | None = None
    """Use only the first N training examples (None: all)."""
    eval_limit: int | None = None
    """Evaluate on only the first N examples of each evaluation set (None: all)."""


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    init: InitConfig = field(default_factory=InitConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    preset: str = "custom"
    """The preset this config started from (recorded, not used)."""

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        return validate(build(cls, data, prefix=""))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())


def _to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_to_plain(v) for v in value]
    return value


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """A dataclass from a nested dict, coercing values to the annotated types; an unknown key
    or a value of the wrong type raises `HLMError` naming `prefix` + the field."""
    if not isinstance(data, dict):
        raise HLMError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise HLMError(
            f"unknown config field {prefix}{unknown[0]}; allowed: {', '.join(sorted(known))}"
        )
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint) and isinstance(value, hint):
            kwargs[name] = value  # already built (a sweep's axis record)
        elif dataclasses.is_dataclass(hint):
            kwargs[name] = build(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Turn YAML / command-line values into the field's type, or fail naming the field."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except HLMError as err:
                errors.append(str(err))
        raise HLMError(errors[0] if errors else f"{name}={value!r} is not allowed")
    if origin is Literal:
        if value not in args:
            allowed = " | ".join(map(str, args))
            raise HLMError(f"{name}={value!r} is not allowed; choose one of: {allowed}")
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.strip("()[]").split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise HLMError(f"{name}={value!r} is not allowed; expected a list")
        item_types = args if args and args[-1] is not Ellipsis else (args[0],) * len(value)
        if len(item_types) != len(value):
            raise HLMError(f"{name}={value!r} is not allowed; expected {len(item_types)} values")
        return tuple(_coerce(v, t, name) for v, t in zip(value, item_types, strict=True))
    try:
        if hint is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return value.lower() in ("true", "1", "yes")
            if not isinstance(value, bool | int):
                raise ValueError
            return bool(value)
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value else int(value)
        if hint is float:
            return float(value)
        if hint is str:
            if not isinstance(value, str | int | float):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        raise HLMError(f"{name}={value!r} is not allowed; expected {hint.__name__}") from None
    return value


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise HLMError(f"{name}={value!r} is not allowed; {allowed}")


def validate(cfg: Config) -> Config:
    """Checks that span fields; returns `cfg` unchanged or raises a one-line HLMError."""
    m, t, d, o, p, r = cfg.model, cfg.tokenizer, cfg.data, cfg.objective, cfg.optim, cfg.run
    for name in ("hidden_size", "num_layers", "num_heads", "max_positions"):
        _check(getattr(m, name) > 0, f"model.{name}", getattr(m, name), "must be > 0")
    _check(
        m.hidden_size % m.num_heads == 0,
        "model.num_heads",
        m.num_heads,
        f"must divide model.hidden_size={m.hidden_size}",
    )
    _check(0 <= m.dropout < 1, "model.dropout", m.dropout, "must be in [0, 1)")
    _check(t.kind != "file" or bool(t.path), "tokenizer.path", t.path, "required when kind=file")
    _check(t.vocab_size > 0, "tokenizer.vocab_size", t.vocab_size, "must be > 0")
    _check(bool(d.sources), "data.sources", d.sources, "give at least one corpus")
    _check(d.seq_len >= 2, "data.seq_len", d.seq_len, "must be >= 2")
    _check(
        d.seq_len <= m.max_positions,
        "data.seq_len",
        d.seq_len,
        f"must not exceed model.max_positions={m.max_positions}; lower the sequence length "
        "or raise model.max_positions",
    )
    _check(d.shard_tokens > 0, "data.shard_tokens", d.shard_tokens, "must be > 0")
    _check(
        t.train_sample_bytes is None or t.train_sample_bytes > 0,
        "tokenizer.train_sample_bytes",
        t.train_sample_bytes,
        "must be > 0 (or none for all the training text)",
    )
    _check(0 < d.val_fraction < 0.5, "data.val_fraction", d.val_fraction, "must be in (0, 0.5)")
    _check(0 < d.mlm_probability < 1, "data.mlm_probability", d.mlm_probability, "in (0, 1)")
    _check(o.temperature > 0, "objective.temperature", o.temperature, "must be > 0")
    n = o.num_negatives
    _check(n is None or n >= 1, "objective.num_negatives", n, "must be >= 1 (or null: all)")
    _check(
        n is None or not (o.cross_worker_negatives or o.cwt_variant == "mask_same"),
        "objective.num_negatives",
        n,
        "samples the worker's own targets: not with cross_worker_negatives or mask_same",
    )
    _check(p.lr > 0, "optim.lr", p.lr, "must be > 0")
    _check(p.max_steps > 0, "optim.max_steps", p.max_steps, "must be > 0")
    _check(p.warmup_steps >= 0, "optim.warmup_steps", p.warmup_steps, "must be >= 0")
    _check(p.micro_batch_size > 0, "optim.micro_batch_size", p.micro_batch_size, "must be > 0")
    p.grad_accum_steps(world_size=1)
    _check(
        p.embedding_update == "dense" or o.name == "headless" or m.arch == "gpt_neox",
        "optim.embedding_update",
        p.embedding_update,
        "lazy needs an input embedding no vocabulary head reads: the headless objective, or "
        "arch gpt_neox (untied head); use dense",
    )
    for name in ("log_every", "eval_every", "checkpoint_every", "eval_batches"):
        _check(getattr(r, name) > 0, f"run.{name}", getattr(r, name), "must be > 0")
    _check(r.keep_checkpoints >= 1, "run.keep_checkpoints", r.keep_checkpoints, "must be >= 1")
    _check(r.device in ("auto", "cpu", "cuda"), "run.device", r.device, "auto | cpu | cuda")
    _check_budget(cfg.budget)
    i = cfg.init
    _check(
        not (i.new_head or i.train == "head") or bool(i.model_dir),
        "init.model_dir",
        i.model_dir,
        "required with init.new_head or init.train=head",
    )
    _check(
        i.train == "all" or i.new_head,
        "init.train",
        i.train,
        "head needs init.new_head=true (only a new head can be probed)",
    )
    return cfg


def _check_budget(b: BudgetConfig) -> None:
    given = [k for k in ("tokens", "flops", "seconds") if getattr(b, k) is not None]
    _check(
        len(given) <= 1,
        f"budget.{given[-1] if given else 'tokens'}",
        getattr(b, given[-1]) if given else None,
        f"give one budget, not {' and '.join('budget.' + k for k in given)}",
    )
    for name in given:
        _check(getattr(b, name) > 0, f"budget.{name}", getattr(b, name), "must be > 0")
    u = b.unique_columns
    _check(u is None or u >= 1, "budget.unique_columns", u, "must be >= 1 (or null: measured)")
    _check(
        u is None or b.flops is not None,
        "budget.unique_columns",
        u,
        "only applies with budget.flops",
    )


def apply_overrides(cfg: Config, overrides: list[str] | dict[str, Any]) -> Config:
    """Apply dotted overrides (``optim.lr=3e-4`` strings or a ``{"optim.lr": 3e-4}`` dict)."""
    items = overrides.items() if isinstance(overrides, dict) else map(_split_override, overrides)
    data = cfg.to_dict()
    for key, value in items:
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise HLMError(f"unknown config field {key}; sections: {', '.join(data)}")
            node = node[part]
        if leaf not in node:
            raise HLMError(f"unknown config field {key}; allowed: {', '.join(sorted(node))}")
        node[leaf] = yaml.safe_load(value) if isinstance(value, str) else value
    return Config.from_dict(data)


def _split_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise HLMError(f"override {text!r} must look like section.field=value, e.g. optim.lr=3e-4")
    return key.strip(), value.strip()


def flatten(data: dict[str, Any], prefix: str = ""):
    """Nested dict -> (dotted key, value) pairs."""
    for key, value in data.items():
        if isinstance(value, dict):
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


__all__ = [
    "BudgetConfig",
    "ClassifyConfig",
    "Config",
    "DataConfig",
    "InitConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "OptimConfig",
    "RunConfig",
    "TokenizerConfig",
    "OBJECTIVES",
    "apply_overrides",
    "build",
    "flatten",
    "replace",
    "validate",
]
