"""AdamW with the usual no-decay groups, and the learning-rate schedules.

    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim)

Biases and norm weights (every parameter with fewer than 2 dimensions) get no weight decay
unless `optim.decay_bias_and_norm` is set: the authors' code decayed LayerNorm weights because
its exclusion matched a case-sensitive name, so this rule goes by shape, not by name.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hlm_ray.config import OptimConfig


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    decay, no_decay = [], []
    for param in model.parameters():  # tied parameters are yielded once
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 or cfg.decay_bias_and_norm else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        param_groups(model, cfg), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps
    )


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
