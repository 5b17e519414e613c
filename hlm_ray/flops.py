"""FLOPs of one training step, split into the transformer body and the loss head.

A headless model (CWT) removes the vocabulary head; what that can save is the head's share of
the step's FLOPs. This module counts it, so throughput can be logged as FLOPs/s and MFU, and a
run's measured speed-up can be set against the predicted one.

    from hlm_ray.config import ModelConfig
    from hlm_ray.flops import (config_step_flops, describe, device_peak_flops, mfu,
                               predicted_speedup, step_flops)

    pythia = ModelConfig(arch="gpt_neox", hidden_size=512, num_layers=6, num_heads=8)
    shape = dict(vocab_size=50277, micro_batch=8, seq_len=2048)
    van = step_flops(pythia, objective="vanilla", **shape)
    cwt = step_flops(pythia, objective="headless", **shape)
    van.head_share, predicted_speedup(van, cwt)      # ≈ 0.45, ≈ 1.44

    step = config_step_flops(cfg, vocab_size=len(tokenizer))   # one micro-batch of a run
    mlflow.log_metrics(describe(step))
    achieved = mfu(step.total * micro_batches_per_s, device_peak_flops())  # None on CPU

The model (what is counted, and why)
------------------------------------
Only matmuls. A multiply-add is 2 FLOPs, so an (M×K)·(K×N) product costs 2·M·K·N. Every matmul
in a step runs once forward and twice backward (the gradient with respect to each operand costs
as much as the forward product), so a step is 3 × the forward count. This holds for the first
layer too: the input embeddings are trained, so the gradient w.r.t. the layer's input is needed.

Per input token and layer, with width D, MLP width I (default 4D) and context L:

    dense:      QKV 2·D·3D + output 2·D·D + MLP 2·D·I + 2·I·D = 2·(4·D² + 2·D·I)
    attention:  scores q·Kᵀ 2·L·D + weighted sum A·V 2·L·D    = 4·L·D · causal_attention_factor

The attention term counts the full L×L square (factor 1.0): eager and SDPA math kernels compute
it whole and mask afterwards, and this is what `torch.utils.flop_counter` counts. A causal
flash kernel skips the upper triangle: pass 0.5 for it (Kaplan et al. 2020's 6N + 6·n_layer·L·D
per token also halves it). Encoders always use the full square.

Heads, forward FLOPs per head row:

    vanilla decoder:   logits 2·D·V                  rows = K = B·(L−1) (targets input[:, 1:])
    vanilla encoder:   transform 2·D·D + logits 2·D·V
                       rows = K = round(p·B·L) masked positions, or B·L with full logits
    headless (CWT):    logits O·Eᵀ, K×D by D×U        2·U·D per row, rows = K
                       U = K columns (plain), U ≤ min(K, V) unique ids (dedup),
                       × world size with cross-worker negatives; no V term at all
    mixed:             vanilla + headless

Not counted, on purpose: embedding look-ups and CWT's gather of target rows (index ops, no
matmul; their backward is a scatter-add), layer norms, activations, rotary embeddings, softmax,
cross-entropy, dropout, the optimizer update (all O(tokens·D) or O(params) elementwise work, or
O(K·V) for the softmax: memory-bound, not FLOP-bound; they can still dominate wall time, see
NOTES.md on the V×D embedding gradient). Counting the tokens a run trains on (a scatter-add of
each micro-batch's K target ids into a (V,) vector: the unigram prior of `hlm_ray.readout`) and
the head bias of `init.prior_bias` (K·V additions) are not matmuls either: both are free here,
so the prior readout and the vanilla arm's prior bias cost no budget FLOPs. Recomputation is not counted either (activation
checkpointing, chunked CWT, fused linear cross-entropy that recomputes logits): these are model
FLOPs, the numerator of MFU as defined by Chowdhery et al. 2022, not hardware FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from hlm_ray.config import DECODERS, ENCODERS, OBJECTIVES, Config, ModelConfig
from hlm_ray.errors import HLMError

# Forward + backward: each matmul's backward computes two products of the forward's size.
STEP_MULTIPLIER = 3.0


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one micro-batch forward + backward, for `tokens` input tokens and
    `target_rows` loss rows (K)."""

    body: float
    head: float
    tokens: int
    target_rows: int

    @property
    def total(self) -> float:
        return self.body + self.head

    @property
    def head_share(self) -> float:
        """The fraction of the step's FLOPs spent in the loss head."""
        return self.head / self.total if self.total else 0.0

    @property
    def per_token(self) -> float:
        return self.total / self.tokens if self.tokens else 0.0


def rows_per_loss(
    model_family: str, micro_batch: int, seq_len: int, mlm_probability: float = 0.15
) -> int:
    """K, the loss rows of one micro-batch: B·(L−1) next-token targets for a decoder, the
    expected number of masked positions round(p·B·L) for an encoder.

    `model_family` is "decoder" / "encoder" or an architecture name (gpt2, bert, ...).
    """
    family = _family(model_family)
    if family == "decoder":
        return micro_batch * (seq_len - 1)
    return round(mlm_probability * micro_batch * seq_len)


def body_forward_flops_per_token(
    model: ModelConfig, seq_len: int, causal_attention_factor: float = 1.0
) -> float:
    """Forward FLOPs of the transformer body for one input token (see the module docstring)."""
    d = model.hidden_size
    inner = model.intermediate_size or 4 * d
    dense = 2 * (4 * d * d + 2 * d * inner)  # QKV 3D², output D², MLP up and down D·I each
    factor = causal_attention_factor if model.family == "decoder" else 1.0
    attention = 2 * 2 * seq_len * d * factor  # q·Kᵀ and A·V, each L·D multiply-adds
    return model.num_layers * (dense + attention)


def step_flops(
    model: ModelConfig,
    *,
    vocab_size: int,
    objective: str,
    micro_batch: int,
    seq_len: int,
    mlm_probability: float = 0.15,
    mlm_full_logits: bool = False,
    unique_columns: int | None = None,
    world_size_negatives: int = 1,
    causal_attention_factor: float = 1.0,
) -> StepFlops:
    """FLOPs of one forward + backward over `micro_batch` sequences of `seq_len` tokens.

    unique_columns: U, the CWT columns each worker scores against, all workers' negatives
    included (default W·K: the plain loss, and an upper bound for the dedup loss, whose U is the
    number of distinct ids among the negatives, at most min(W·K, V); a run logs it measured as
    `train/U`). world_size_negatives: W, the workers whose targets each worker scores against
    (cross-worker negatives).
    causal_attention_factor: 1.0 counts the full L×L attention square, 0.5 a causal kernel that
    skips the masked half (decoders only).
    """
    if objective not in OBJECTIVES:
        raise HLMError(
            f"objective={objective!r} is not allowed; choose one of: vanilla | headless | mixed"
        )
    _positive(
        vocab_size=vocab_size,
        micro_batch=micro_batch,
        seq_len=seq_len,
        world_size_negatives=world_size_negatives,
    )
    if not 0 < causal_attention_factor <= 1:
        raise HLMError(f"causal_attention_factor={causal_attention_factor} must be in (0, 1]")
    family = model.family
    tokens = micro_batch * seq_len
    rows = rows_per_loss(family, micro_batch, seq_len, mlm_probability)
    d = model.hidden_size

    body_fwd = tokens * body_forward_flops_per_token(model, seq_len, causal_attention_factor)

    head_fwd = 0.0
    if objective in ("vanilla", "mixed"):
        per_row = 2 * d * vocab_size  # logits h·Wᵀ
        head_rows = rows
        if family == "encoder":
            per_row += 2 * d * d  # BERT / DistilBERT prediction transform (dense D×D)
            if mlm_full_logits:
                head_rows = tokens  # the paper's baseline: the head at every position
        head_fwd += head_rows * per_row
    if objective in ("headless", "mixed"):
        negatives = rows * world_size_negatives
        cols = negatives if unique_columns is None else unique_columns
        if cols < 0 or cols > negatives:
            raise HLMError(
                f"unique_columns={unique_columns} must be in [0, W·K={negatives}] "
                f"(W={world_size_negatives} workers' negatives, K={rows})"
            )
        # O (K×D) · Eᵀ (D×U); E's rows are gathered from the table: no matmul for them.
        head_fwd += 2 * rows * cols * d

    return StepFlops(
        body=STEP_MULTIPLIER * body_fwd,
        head=STEP_MULTIPLIER * head_fwd,
        tokens=tokens,
        target_rows=rows,
    )


def config_step_flops(
    cfg: Config,
    vocab_size: int,
    *,
    world_size: int = 1,
    unique_columns: int | None = None,
    causal_attention_factor: float = 1.0,
) -> StepFlops:
    """`step_flops` for one micro-batch of a run's config.

    The dedup and mask_same CWT variants score U distinct ids: pass the measured U (`train/U`,
    all workers' negatives included); without it the bound U = min(W·K, V) is used (an upper
    bound on the FLOPs: real text repeats tokens). A measured U is capped at that bound.
    `world_size` counts only when objective.cross_worker_negatives is set.
    """
    o = cfg.objective
    rows = rows_per_loss(
        cfg.model.family, cfg.optim.micro_batch_size, cfg.data.seq_len, cfg.data.mlm_probability
    )
    workers = world_size if o.cross_worker_negatives else 1
    if o.num_negatives is not None:
        # A sampled set of negatives and the positive: a measured U does not apply.
        unique_columns = min(rows, o.num_negatives + 1)
    elif o.cwt_variant == "plain":
        unique_columns = None  # every negative is a column, repeats included
    else:
        bound = unique_columns_bound(rows, vocab_size, workers)
        unique_columns = bound if unique_columns is None else min(int(unique_columns), bound)
    return step_flops(
        cfg.model,
        vocab_size=vocab_size,
        objective=o.name,
        micro_batch=cfg.optim.micro_batch_size,
        seq_len=cfg.data.seq_len,
        mlm_probability=cfg.data.mlm_probability,
        mlm_full_logits=o.mlm_full_logits,
        unique_columns=unique_columns,
        world_size_negatives=workers,
        causal_attention_factor=causal_attention_factor,
    )


def unique_columns_bound(rows: int, vocab_size: int, workers: int = 1) -> int:
    """The most distinct ids W workers' K targets each can hold: min(W·K, V)."""
    return min(rows * workers, vocab_size)


def predicted_speedup(vanilla: StepFlops, headless: StepFlops) -> float:
    """The step-time ratio if both runs reached the same FLOPs/s: vanilla / headless FLOPs."""
    return vanilla.total / headless.total


def k_tags(rows: float, vocab_size: int) -> dict[str, float]:
    """The run's `K` and `K_over_V` tags: K (loss rows per micro-batch) as the `train/K` metric
    logs it (a masked LM's is a mean), or `target_rows` before the first measurement."""
    rows = round(float(rows), 2)
    return {"K": int(rows) if rows.is_integer() else rows, "K_over_V": round(rows / vocab_size, 4)}


def describe(step: StepFlops) -> dict[str, float]:
    """MLflow-ready metrics for one step's FLOP model."""
    tokens = step.tokens or 1
    return {
        "flops/body_per_token": step.body / tokens,
        "flops/head_per_token": step.head / tokens,
        "flops/head_share": step.head_share,
        "flops/per_token": step.per_token,
    }


# Dense (no sparsity) bf16 tensor-core peaks, by a substring of torch.cuda.get_device_name();
# fp16 for V100 and RTX 8000, which have no bf16. Longer names are matched first, so "A100"
# wins over "A10" and "L40S" over "L4".
PEAK_FLOPS: dict[str, float] = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,
    "RTX 8000": 130e12,
}


def device_peak_flops(name: str | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of a device by name; with no name, the current CUDA device.

    None for an unknown device, or on CPU (MFU is not reported there).
    """
    if name is None:
        try:
            import torch
        except ImportError:
            return None
        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name()
    upper = name.upper()
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key.upper() in upper:
            return PEAK_FLOPS[key]
    return None


def mfu(flops_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the device's peak (None if unknown)."""
    if peak is None or peak <= 0:
        return None
    return flops_per_s / peak


def _family(name: str) -> str:
    if name in ("decoder", *DECODERS):
        return "decoder"
    if name in ("encoder", *ENCODERS):
        return "encoder"
    raise HLMError(
        f"model family {name!r} is not known; use decoder, encoder or an "
        f"architecture ({', '.join(DECODERS + ENCODERS)})"
    )


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise HLMError(f"{name}={value} must be > 0")


__all__ = [
    "PEAK_FLOPS",
    "StepFlops",
    "body_forward_flops_per_token",
    "config_step_flops",
    "describe",
    "device_peak_flops",
    "mfu",
    "predicted_speedup",
    "rows_per_loss",
    "step_flops",
    "unique_columns_bound",
]
