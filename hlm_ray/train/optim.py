"""AdamW with the usual no-decay groups, an optional lazy (row-wise) update of the embedding
table, gradient clipping that takes sparse gradients, and the learning-rate schedules.

    optimizer = build_optimizer(model, cfg.optim)   # AdamW, or LazyAdamW with embedding_update=lazy
    scheduler = build_scheduler(optimizer, cfg.optim)
    ...
    loss.backward()
    grad_norm = clip_grad_norm(model.parameters(), cfg.optim.grad_clip or float("inf"))
    optimizer.step()

Biases and norm weights (every parameter with fewer than 2 dimensions) get no weight decay
unless `optim.decay_bias_and_norm` is set: the authors' code decayed LayerNorm weights because
its exclusion matched a case-sensitive name, so this rule goes by shape, not by name.

Why a lazy embedding update (`optim.embedding_update=lazy`)
-----------------------------------------------------------
A headless step reads at most B·L + K rows of the V×D input-embedding table, yet with dense
gradients it writes a V×D gradient and AdamW then reads and writes the whole table and both of
its moments: the step grows with V although the method's FLOPs do not (NOTES.md, "Where the
speed comes from"). With `lazy`, `build_optimizer` switches the input embedding to sparse
gradients (`nn.Embedding.sparse = True`; `LMObjective` then gathers CWT's target rows with
`F.embedding(..., sparse=True)` too) and `LazyAdamW` updates only the rows present in the
gradient, exactly as AdamW would update them:

    m[r] ← β1·m[r] + (1−β1)·g[r]        v[r] ← β2·v[r] + (1−β2)·g[r]²
    θ[r] ← θ[r]·(1 − lr·wd) − lr/(1−β1ᵗ) · m[r] / (√(v[r]/(1−β2ᵗ)) + ε)

with t the optimizer's global step (the "LazyAdam" of TensorFlow Addons / torch's SparseAdam,
plus AdamW's decoupled weight decay). The first step from a fresh state equals dense AdamW on
the touched rows, and leaves the other rows unchanged. Later steps differ from dense AdamW in
two ways, for rows the step does not touch: dense AdamW keeps moving them with their decaying
momentum m/√v and shrinks them by weight decay every step; the lazy update pauses both until
the row appears again. So `dense` stays the default (the paper's optimizer), and `lazy` is an
opt-in speed-up whose effect on quality should be checked on the task (bits per byte, GLUE).

Why fused
---------
`adamw` builds torch's fused AdamW (one kernel over all tensors of a group) wherever the
parameters live on CPU or CUDA. torch's default on CPU is a Python loop of ~10 ops per tensor:
for a 50,257 × 128 table that was 59 ms a step on one core (fused: 7 ms), more than the tiny
model's forward and backward, and 60% of a GLUE fine-tune's time. Fused computes the same
update (to float rounding; tests compare it with the loop at 1e-6).

Constraints of the lazy path: no vocabulary head may read the table in the step (a tied head
gives it a dense gradient): headless models, vanilla/mixed GPT-NeoX (untied head) and models
with a new untied head qualify; vanilla GPT-2 / BERT / DistilBERT (tied heads) do not. Sparse
gradients are averaged by DDP over gloo (checked); NCCL has no sparse all-reduce here, so on
several GPUs use `dense`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from hlm_ray.config import OptimConfig
from hlm_ray.errors import HLMError


def param_groups(model: nn.Module, cfg: OptimConfig, lazy: Tensor | None = None) -> list[dict]:
    """Decay / no-decay groups; `lazy` (a parameter) gets a third group of its own, updated
    row-wise by `LazyAdamW` (it is a matrix, so it keeps the decay group's weight decay)."""
    decay, no_decay = [], []
    for param in model.parameters():  # tied parameters are yielded once
        if not param.requires_grad or param is lazy:
            continue
        (decay if param.ndim >= 2 or cfg.decay_bias_and_norm else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay, "lazy": False},
        {"params": no_decay, "weight_decay": 0.0, "lazy": False},
    ]
    if lazy is not None:
        groups.append({"params": [lazy], "weight_decay": cfg.weight_decay, "lazy": True})
    return groups


class LazyAdamW(torch.optim.AdamW):
    """AdamW whose `lazy` parameter groups take sparse (COO) gradients and update only the rows
    they hold (see the module docstring for the exact rule and how it differs from AdamW).

    Dense gradients, in any group, get torch's AdamW update; the state has AdamW's layout
    (step, exp_avg, exp_avg_sq), so `state_dict` / `load_state_dict` work as for AdamW.
    """

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.defaults.setdefault("lazy", False)
        for group in self.param_groups:
            group.setdefault("lazy", False)
            if group["lazy"] and (group["amsgrad"] or group["maximize"]):
                raise ValueError("lazy parameter groups support neither amsgrad nor maximize")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Sparse gradients are applied here and hidden from AdamW, which rejects them.
        hidden: list[tuple[Tensor, Tensor]] = []
        for group in self.param_groups:
            if not group["lazy"]:
                continue
            for param in group["params"]:
                if param.grad is not None and param.grad.is_sparse:
                    self._lazy_update(param, group)
                    hidden.append((param, param.grad))
                    param.grad = None
        try:
            super().step()
        finally:
            for param, grad in hidden:
                param.grad = grad
        return loss

    def _lazy_update(self, param: Tensor, group: dict) -> None:
        grad = param.grad.coalesce()  # duplicate rows (input look-up + CWT targets) summed
        rows_N, grad_ND = grad.indices()[0], grad.values()
        state = self.state[param]
        if not state:  # AdamW's layout, so a dense step or a checkpoint can take over
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        step = float(state["step"])  # a CPU scalar: no device sync
        beta1, beta2 = group["betas"]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]

        m_ND = state["exp_avg"].index_select(0, rows_N).lerp_(grad_ND, 1 - beta1)
        v_ND = state["exp_avg_sq"].index_select(0, rows_N)
        v_ND.mul_(beta2).addcmul_(grad_ND, grad_ND, value=1 - beta2)
        state["exp_avg"].index_copy_(0, rows_N, m_ND)
        state["exp_avg_sq"].index_copy_(0, rows_N, v_ND)

        theta_ND = param.index_select(0, rows_N)
        if wd:
            theta_ND.mul_(1 - lr * wd)  # decoupled weight decay, on the touched rows only
        denom_ND = (v_ND.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
        theta_ND.addcdiv_(m_ND, denom_ND, value=-lr / (1 - beta1**step))
        param.index_copy_(0, rows_N, theta_ND)


def lazy_embedding(model: nn.Module) -> nn.Embedding:
    """The input embedding, checked for the lazy update: no head may read it in a step."""
    from hlm_ray.models import lm_head, objective_of

    embedding = model.get_input_embeddings()
    if not isinstance(embedding, nn.Embedding):
        raise HLMError(
            f"optim.embedding_update=lazy needs an nn.Embedding input table, not "
            f"{type(embedding).__name__}; use optim.embedding_update=dense"
        )
    if objective_of(model) in ("vanilla", "mixed") and lm_head(model).weight is embedding.weight:
        raise HLMError(
            "optim.embedding_update=lazy: this model's vocabulary head is tied to the input "
            "embedding, so every step writes all its rows; use optim.embedding_update=dense "
            "(lazy suits headless models and vanilla gpt_neox, whose head is untied)"
        )
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if distributed and dist.get_backend() != "gloo":
        raise HLMError(
            f"optim.embedding_update=lazy sends sparse gradients, which the "
            f"{dist.get_backend()} backend cannot average; use optim.embedding_update=dense "
            "with several GPUs (gloo, on CPU workers, supports it)"
        )
    return embedding


FUSED_DEVICES = ("cpu", "cuda")  # where torch has a fused AdamW kernel


def adamw(
    groups: list[dict], *, cls: type[torch.optim.AdamW] = torch.optim.AdamW, **kwargs
) -> torch.optim.AdamW:
    """`cls` (torch's AdamW or a subclass) over `groups`, fused where every parameter's device
    has the kernel."""
    devices = {p.device.type for g in groups for p in g["params"]}
    fused = bool(devices) and devices <= set(FUSED_DEVICES)
    return cls(groups, fused=fused or None, **kwargs)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over `param_groups`; with `cfg.embedding_update == "lazy"` a `LazyAdamW` whose
    input-embedding group is updated row-wise, and the embedding switched to sparse gradients
    (call this before wrapping the model in DDP: DDP reads that flag when it is built)."""
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.embedding_update != "lazy":
        return adamw(param_groups(model, cfg), **kwargs)
    embedding = lazy_embedding(model)
    if not embedding.weight.requires_grad:  # a frozen table (head-only training): nothing to do
        return adamw(param_groups(model, cfg), **kwargs)
    embedding.sparse = True
    # The lazy group's rows are updated by _lazy_update; fused AdamW runs the dense groups.
    return adamw(param_groups(model, cfg, lazy=embedding.weight), cls=LazyAdamW, **kwargs)


def uses_sparse_embedding(model: nn.Module) -> bool:
    """Whether the input embedding produces sparse gradients (set by the lazy update)."""
    embedding = model.get_input_embeddings()
    return bool(getattr(embedding, "sparse", False))


def clip_grad_norm(parameters: Iterable[Tensor], max_norm: float) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` that also takes sparse gradients (torch's raises on
    them): sparse gradients are coalesced first, so a row counted twice (input look-up and CWT
    target) adds up before it is squared. Returns the total 2-norm, as a tensor (no sync)."""
    params = [p for p in parameters if p.grad is not None]
    if not any(p.grad.is_sparse for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    for p in params:
        if p.grad.is_sparse and not p.grad.is_coalesced():
            p.grad = p.grad.coalesce()
    # The values of a coalesced COO tensor are its non-zero rows: their norm is the tensor's.
    parts = [p.grad._values() if p.grad.is_sparse else p.grad for p in params]
    total = torch.nn.utils.get_total_norm(parts, 2.0)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch does: no data-dependent branch
    for part in parts:
        part.mul_(coef.to(part.device, part.dtype))
    return total


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
