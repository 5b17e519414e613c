"""The vocabulary softmax head's cross-entropy, in the implementations a user would pick.

``cross_entropy_head(hidden_ND, weight_VD, bias_V, labels_N)`` equals
``F.cross_entropy(F.linear(hidden, weight, bias), labels)`` with float32 logits, ignore_index
-100 and "mean" over the non-ignored rows, whichever way it is computed:

    from hlm_ray.cross_entropy import cross_entropy_head

    loss = cross_entropy_head(hidden_ND, weight_VD, None, labels_N)                 # full logits
    loss = cross_entropy_head(hidden_ND, weight_VD, None, labels_N, impl="linear")  # torch fused
    loss = cross_entropy_head(hidden_ND, weight_VD, None, labels_N, vanilla_impl="cce")  # GPU

``vanilla_impl="torch"`` (default) uses torch only, with ``impl`` full / chunked / linear;
``"liger"``, ``"cce"`` and ``"cce_compile"`` call the optional kernels in `hlm_ray.fused_ce`
(``impl`` and ``chunk_size`` do not apply to them). Shape suffixes: N rows, D hidden width,
V vocabulary.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from hlm_ray.device import float32_region, require_torch_feature
from hlm_ray.fused_ce import fused_linear_cross_entropy

IGNORE_INDEX = -100
CE_IMPLS = ("full", "chunked", "linear")
REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True, eq=False)  # eq=False: a generated __eq__ would compare tensors
class LMHead:
    """A vocabulary softmax head: ``logits = transform(hidden) @ weight.T + bias``.

    ``transform`` is None for a GPT-style head (identity), or e.g. BERT's dense+gelu+LayerNorm.
    """

    transform: Callable[[Tensor], Tensor] | None
    weight: Tensor  # V×D
    bias: Tensor | None  # V

    def features(self, hidden: Tensor) -> Tensor:
        return hidden if self.transform is None else self.transform(hidden)


def upcast(x: Tensor) -> Tensor:
    # Half-precision logits overflow (fp16 past 65504) and blur the ranking of close scores.
    # float64 is kept as is so that exact references stay exact.
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def reduce_loss(loss_N: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return loss_N.mean()
    if reduction == "sum":
        return loss_N.sum()
    if reduction == "none":
        return loss_N
    raise ValueError(f"reduction={reduction!r}; use one of {', '.join(REDUCTIONS)}")


def _ce_rows(
    hidden_ND: Tensor, weight_VD: Tensor, bias_V: Tensor | None, labels_N: Tensor, ignore: int
) -> Tensor:
    with float32_region(hidden_ND.device.type):  # float32 logits, also under autocast
        logits_NV = F.linear(hidden_ND, weight_VD, bias_V)
    return F.cross_entropy(logits_NV, labels_N, ignore_index=ignore, reduction="none")


def cross_entropy_head(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    *,
    impl: str = "full",
    chunk_size: int = 4096,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    vanilla_impl: str = "torch",
) -> Tensor:
    """Cross-entropy of ``F.linear(hidden, weight, bias)`` (hidden N×D, weight V×D) vs labels (N,).

    ``impl``: ``"full"`` materialises the N×V float32 logits; ``"chunked"`` holds only
    chunk_size×V logits at a time (row chunks with activation checkpointing, same result);
    ``"linear"`` calls torch's fused ``F.linear_cross_entropy`` with the same ``chunk_size``
    rows per chunk (``LinearCrossEntropyOptions(batch_chunk_size=...)``: torch's own heuristic
    picks 1-2 rows a chunk on CPU, an unfairly slow baseline). All three compute float32 logits,
    also under autocast. "mean" averages over non-ignored rows.

    ``vanilla_impl``: "torch" (the above), or a kernel of `hlm_ray.fused_ce` (liger, cce,
    cce_compile), which then ignores ``impl`` and ``chunk_size``.
    """
    if vanilla_impl != "torch":
        kwargs = dict(impl=vanilla_impl, ignore_index=ignore_index, reduction=reduction)
        return fused_linear_cross_entropy(hidden, weight, bias, labels, **kwargs)
    if impl not in CE_IMPLS:
        raise ValueError(f"impl={impl!r}; use one of {', '.join(CE_IMPLS)}")
    if impl == "linear":
        args = (ignore_index, reduction, chunk_size)
        return _fused_linear_cross_entropy(hidden, weight, bias, labels, *args)
    hidden, weight = upcast(hidden), upcast(weight)
    bias = None if bias is None else upcast(bias)
    N = hidden.shape[0]
    if impl == "full" or chunk_size >= N:
        with float32_region(hidden.device.type):  # float32 logits, also under autocast
            logits_NV = F.linear(hidden, weight, bias)
        return F.cross_entropy(logits_NV, labels, ignore_index=ignore_index, reduction=reduction)
    # Chunked: the (upcast) weight is an input of every chunk, saved once by reference.
    loss_N = torch.cat(
        [
            checkpoint(
                _ce_rows,
                hidden[start : start + chunk_size],
                weight,
                bias,
                labels[start : start + chunk_size],
                ignore_index,
                use_reentrant=False,
                preserve_rng_state=False,
            )
            for start in range(0, N, chunk_size)
        ]
    )
    if reduction == "mean":
        # Ignored rows contribute 0 to the sum and nothing to the count, as in F.cross_entropy.
        return loss_N.sum() / (labels != ignore_index).sum()
    return reduce_loss(loss_N, reduction)


def _fused_linear_cross_entropy(
    hidden_ND: Tensor,
    weight_VD: Tensor,
    bias_V: Tensor | None,
    labels_N: Tensor,
    ignore_index: int,
    reduction: str,
    chunk_size: int,
) -> Tensor:
    # One dtype for the op, at least float32 as the other impls (`upcast`): promote (bf16
    # hidden states under autocast, float32 weight; a bf16 weight too would give bf16 logits
    # and a bf16-rounded loss), and keep autocast from rounding the float32 chunks back to
    # bf16 inside it. Explicit rows per chunk (as impl="chunked"); options=None would be the
    # unfused reference (full logits).
    require_torch_feature(torch.nn, "LinearCrossEntropyOptions", "objective.ce_impl=linear", "2.13")
    dtype = torch.promote_types(
        torch.promote_types(hidden_ND.dtype, weight_VD.dtype), torch.float32
    )
    rows = max(1, min(chunk_size, hidden_ND.shape[0]))
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=rows, chunking_method=None)
    kwargs = dict(ignore_index=ignore_index, reduction=reduction, options=options)
    bias = None if bias_V is None else bias_V.to(dtype)  # (V,): supported natively
    with float32_region(hidden_ND.device.type):
        loss = F.linear_cross_entropy(
            hidden_ND.to(dtype), weight_VD.to(dtype), labels_N, linear_bias=bias, **kwargs
        )
    return upcast(loss)
