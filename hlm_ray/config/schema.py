"""The typed config tree (model, tokenizer, data, objective, optim, run, init, budget): the schema.

Frozen dataclasses, a docstring under each field. Parsing a dict or dotted overrides into them is
`hlm_ray.config.parse`; the checks that span fields are `hlm_ray.config.checks`.

    cfg = Config()                               # every default
    cfg.optim.grad_accum_steps(world_size=2)     # derived from the global batch, checked
    cfg = Config.from_dict(cfg.to_dict())        # what a Ray worker does on its first line
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from hlm_ray.config.checks import validate
from hlm_ray.config.parse import build, to_plain
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
VanillaImpl = Literal["torch", "liger", "cce", "cce_compile"]
"""The vanilla head's kernels (`objective.vanilla_impl`): torch, then the fused ones."""
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
    vanilla_impl: VanillaImpl = "torch"
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
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradient is NaN or inf. stop: the run stops at the log step that sees
    it (FAILED, its last good checkpoint kept, nothing registered). skip: the step's update is
    dropped (one host sync per step to decide) and the run stops only after
    `max_skipped_steps` skipped steps in a row."""
    max_skipped_steps: int = 10
    """With on_nonfinite=skip: how many steps in a row may be skipped before the run stops."""

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
    prior_bias: bool = False
    """A decoder with a vocabulary head (vanilla, mixed): give the head a trainable bias (V,)
    that starts at log q(w), the log unigram prior of the training split (add-alpha, alpha
    fitted on the validation split), so its logits start from the token frequencies: what the
    headless arm's prior readout knows, offered to the vanilla arm (docs/readout.md). Saved in
    model.safetensors as the head's bias, which hlm_ray's loader restores."""


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
    warmup_share: float | None = None
    """With a budget: warm up over this share of the steps it becomes (at least one step),
    replacing `optim.warmup_steps`, so that runs of different budgets or arms warm up alike
    (a compute sweep's). None: `optim.warmup_steps` as it is."""


@dataclass(frozen=True)
class ClassifyConfig:
    """How an encoder is fine-tuned as a sequence classifier (`hlm finetune --task glue:...`);
    the recipes (tiny, paper, paper-XNLI) are in `hlm_ray.classify.recipes`."""

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
        return to_plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        return validate(build(cls, data, prefix=""))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())
