"""Fused linear cross-entropy kernels for the vanilla head: Liger Kernel and Cut Cross-Entropy.

On a GPU, users train softmax heads with kernels that never hold the N×V logits: Liger Kernel's
``LigerFusedLinearCrossEntropyLoss`` (chunked matmul + Triton cross-entropy) and Apple's Cut
Cross-Entropy (``cut_cross_entropy.linear_cross_entropy``, Wijmans et al. 2025: the logits live
in on-chip memory only). Headless training must be compared against them. Both are optional (the
``gpu`` extra: ``pip install 'hlm_ray[gpu]'``); this module imports them only when called.

    from hlm_ray.fused_ce import check_vanilla_impl, fused_linear_cross_entropy

    check_vanilla_impl("cce", torch.device("cuda"))        # raises one line if unusable
    loss = fused_linear_cross_entropy(hidden_ND, weight_VD, None, labels_N, impl="cce")

``impl``: ``"liger"`` and ``"cce"`` are Triton kernels (CUDA only); ``"cce_compile"`` is Cut
Cross-Entropy's ``impl="torch_compile"`` path (``F.cross_entropy(e @ c.T)`` under
``torch.compile``), which also runs on a CPU. All three take ignore_index and average over the
non-ignored rows like ``F.cross_entropy``; the softmax is computed in float32. Under bf16 the
matmul runs in bf16 as users run these kernels: CCE accumulates each logit in float32 on chip,
Liger rounds a chunk's logits to bf16 before its float32 softmax. Cut Cross-Entropy has no bias
argument: a head with a bias (BERT's decoder) must use liger or torch.
"""

from __future__ import annotations

import importlib.util
from typing import get_args

import torch
from torch import Tensor

from hlm_ray.config.schema import VanillaImpl
from hlm_ray.errors import HLMError

VANILLA_IMPLS: tuple[str, ...] = get_args(VanillaImpl)
FUSED_IMPLS = VANILLA_IMPLS[1:]  # all but torch
_PACKAGE = {"liger": "liger_kernel", "cce": "cut_cross_entropy", "cce_compile": "cut_cross_entropy"}
_PIP = {"liger_kernel": "liger-kernel", "cut_cross_entropy": "cut-cross-entropy"}


def unavailable_reason(impl: str, device_type: str, *, has_bias: bool = False) -> str | None:
    """Why ``impl`` cannot run here (one line naming what to install or pick), or None."""
    if impl not in VANILLA_IMPLS:
        return f"objective.vanilla_impl={impl!r}; use one of {', '.join(VANILLA_IMPLS)}"
    if impl == "torch":
        return None
    if has_bias and impl.startswith("cce"):
        return (
            f"objective.vanilla_impl={impl} cannot apply the head's bias (Cut Cross-Entropy has "
            "no bias argument; BERT's decoder has one): use vanilla_impl=liger or torch"
        )
    # The device first: on a CPU, installing the package would not help.
    if impl != "cce_compile" and device_type != "cuda":
        alt = "cce_compile or torch" if impl == "cce" else "torch"
        return (
            f"objective.vanilla_impl={impl} is a Triton kernel for CUDA GPUs, not {device_type}: "
            f"use vanilla_impl={alt} there"
        )
    package = _PACKAGE[impl]
    if importlib.util.find_spec(package) is None:
        return (
            f"objective.vanilla_impl={impl} needs the {_PIP[package]} package: "
            "pip install 'hlm_ray[gpu]' (or pick vanilla_impl=torch)"
        )
    return None


def check_vanilla_impl(impl: str, device: torch.device | str, *, has_bias: bool = False) -> None:
    """Raise a one-line HLMError if ``impl`` cannot run on ``device`` (at setup, not mid-run)."""
    reason = unavailable_reason(impl, torch.device(device).type, has_bias=has_bias)
    if reason is not None:
        raise HLMError(reason)


def _one_dtype(hidden_ND: Tensor, weight_VD: Tensor) -> torch.dtype:
    # Under autocast the hidden states are bf16/fp16 and the head's weight a float32 parameter:
    # the kernels want one dtype, and users run them in the half dtype (the weight's gradient
    # flows back through the cast in float32). Otherwise the wider of the two.
    if hidden_ND.dtype in (torch.bfloat16, torch.float16):
        return hidden_ND.dtype
    return torch.promote_types(hidden_ND.dtype, weight_VD.dtype)


def fused_linear_cross_entropy(
    hidden_ND: Tensor,
    weight_VD: Tensor,
    bias_V: Tensor | None,
    labels_N: Tensor,
    *,
    impl: str,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), labels)`` through a fused kernel.

    Returns a float32 loss; "mean" averages over the rows whose label is not ignore_index.
    """
    if impl not in FUSED_IMPLS:
        raise ValueError(f"impl={impl!r}; use one of {', '.join(FUSED_IMPLS)}")
    dtype = _one_dtype(hidden_ND, weight_VD)
    hidden_ND, weight_VD = hidden_ND.to(dtype), weight_VD.to(dtype)
    # The kernels are autograd Functions: autocast must not re-cast their inputs.
    with torch.autocast(hidden_ND.device.type, enabled=False):
        if impl == "liger":
            from liger_kernel.transformers.fused_linear_cross_entropy import (
                LigerFusedLinearCrossEntropyLoss,
            )

            # accum_dtype: sum the weight gradient over row chunks in float32, not in bf16.
            loss_fn = LigerFusedLinearCrossEntropyLoss(
                ignore_index=ignore_index, reduction=reduction, accum_dtype=torch.float32
            )
            bias = None if bias_V is None else bias_V.to(dtype)
            loss = loss_fn(weight_VD, hidden_ND, labels_N, bias)
        else:
            if bias_V is not None:
                raise HLMError(unavailable_reason(impl, "cuda", has_bias=True))
            from cut_cross_entropy import linear_cross_entropy

            kernel = "cce" if impl == "cce" else "torch_compile"
            loss = linear_cross_entropy(
                hidden_ND,
                weight_VD,
                labels_N,
                ignore_index=ignore_index,
                reduction=reduction,
                impl=kernel,
            )
    return loss.float()
