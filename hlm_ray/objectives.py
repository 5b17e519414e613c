"""Training objectives over a model's hidden states: headless (CWT) and vanilla (cross-entropy).

Which rows are predictions, and of what: a decoder's hidden[:, :-1] predicts input[:, 1:]; an
encoder's raw last layer predicts the original token at masked positions. The CWT loss over those
rows is `hlm_ray.cwt`; the vocabulary head and its cross-entropy (with the optional fused GPU
kernels) are `hlm_ray.cross_entropy`. Both are re-exported here, so `hlm_ray.objectives` is the
one import for every loss.

Shape suffixes on tensor names: B batch (sequences), L sequence length, D hidden width,
V vocabulary, K target rows of one loss (K = B·(L−1) for a decoder, the masked positions of an
encoder).

Usage::

    from hlm_ray.objectives import headless_causal_loss, vanilla_masked_loss

    hidden_BLD = model(input_ids_BL).last_hidden_state
    out = headless_causal_loss(
        hidden_BLD, input_ids_BL, model.get_input_embeddings().weight, return_accuracy=True
    )
    out.loss.backward()  # the embedding table gets gradient as input and as target
    print(out.num_rows, out.accuracy)

    # Vanilla baseline: softmax head, logits at masked positions only.
    head = LMHead(transform=bert_head_transform, weight=decoder.weight, bias=decoder.bias)
    out = vanilla_masked_loss(hidden_BLD, labels_BL, head, impl="chunked")

The losses look up `cwt_loss_from_ids`, `cwt_loss_sampled` and `cross_entropy_head` in this
module when called, so a test that patches `hlm_ray.objectives.<name>` sees every call.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

# The vocabulary head and its cross-entropy live in hlm_ray.cross_entropy, the CWT loss in
# hlm_ray.cwt (both re-exported here).
from hlm_ray.cross_entropy import (  # noqa: F401
    CE_IMPLS,
    IGNORE_INDEX,
    REDUCTIONS,
    LMHead,
    cross_entropy_head,
)
from hlm_ray.cwt import (  # noqa: F401
    CWT_VARIANTS,
    cwt_loss,
    cwt_loss_from_ids,
    cwt_loss_sampled,
    sample_negative_rows,
)


# eq=False: the generated __eq__ would compare tensors, whose truth value is ambiguous.
@dataclass(frozen=True, eq=False)
class LossOutput:
    """A loss with the number of rows (target positions) it averages over.

    ``num_rows`` is a Python int where it is known without a device sync, a 0-d tensor otherwise.
    ``accuracy`` is the in-batch top-1 accuracy for CWT when requested, else None.
    """

    loss: Tensor
    num_rows: int | Tensor
    accuracy: Tensor | None = None


def _causal_rows(
    hidden_BLD: Tensor, input_ids_BL: Tensor, target_mask_BL: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Predictions (K×D) at positions 0..L-2 and their next-token targets (K,)."""
    pred_BKD, ids_BK = hidden_BLD[:, :-1], input_ids_BL[:, 1:]
    if target_mask_BL is None:
        return pred_BKD.reshape(-1, hidden_BLD.shape[-1]), ids_BK.reshape(-1)
    keep_BK = target_mask_BL[:, 1:].bool()  # drop rows whose target is padding
    return pred_BKD[keep_BK], ids_BK[keep_BK]


def _masked_rows(hidden_BLD: Tensor, labels_BL: Tensor) -> tuple[Tensor, Tensor]:
    """Hidden states (K×D) and original token ids (K,) at the masked positions."""
    masked_BL = labels_BL != IGNORE_INDEX
    return hidden_BLD[masked_BL], labels_BL[masked_BL]


# The keywords of cwt_loss_from_ids that the sampled-negatives loss takes too.
_SAMPLED_OPTIONS = ("temperature", "reduction", "return_accuracy", "sparse_grad")


def headless_loss(
    pred_KD: Tensor,
    ids_K: Tensor,
    embedding_weight_VD: Tensor,
    *,
    num_negatives: int | None = None,
    generator: torch.Generator | None = None,
    **cwt_options,
) -> LossOutput:
    """CWT of K prediction rows (K×D) for their target ids (K,), whichever model made them.

    ``cwt_options`` are `cwt_loss_from_ids`'s keywords (temperature, variant, negative_ids,
    chunk_size, return_accuracy, sparse_grad). ``num_negatives`` N: score against N sampled
    targets instead (`cwt_loss_sampled`, drawn with ``generator``; it counts repeats plainly and
    holds N columns, so variant, negative_ids and chunk_size do not apply to it).
    """
    if num_negatives is not None:
        rows_N = sample_negative_rows(len(ids_K), num_negatives, generator)
        sampled = {k: v for k, v in cwt_options.items() if k in _SAMPLED_OPTIONS}
        out = cwt_loss_sampled(pred_KD, ids_K, embedding_weight_VD, rows_N, **sampled)
    else:
        out = cwt_loss_from_ids(pred_KD, ids_K, embedding_weight_VD, **cwt_options)
    if cwt_options.get("return_accuracy"):
        return LossOutput(loss=out[0], num_rows=len(ids_K), accuracy=out[1])
    return LossOutput(loss=out, num_rows=len(ids_K))


def headless_causal_loss(
    hidden_BLD: Tensor,
    input_ids_BL: Tensor,
    embedding_weight_VD: Tensor,
    *,
    target_mask_BL: Tensor | None = None,
    **cwt_options,
) -> LossOutput:
    """CWT for a decoder: hidden[:, :-1] predicts the embedding of input_ids[:, 1:].

    K = B·(L−1) rows, less those whose target is False in ``target_mask_BL`` (padding).
    ``cwt_options`` are `headless_loss`'s (temperature, variant, num_negatives, ...).
    """
    pred_KD, ids_K = _causal_rows(hidden_BLD, input_ids_BL, target_mask_BL)
    return headless_loss(pred_KD, ids_K, embedding_weight_VD, **cwt_options)


def headless_masked_loss(
    hidden_BLD: Tensor, labels_BL: Tensor, embedding_weight_VD: Tensor, **cwt_options
) -> LossOutput:
    """CWT for an encoder: at masked positions only, the raw last hidden state predicts the
    embedding of the original token. ``labels_BL`` holds that token id there and -100 elsewhere.
    ``cwt_options`` are `headless_loss`'s (temperature, variant, num_negatives, ...).
    """
    pred_KD, ids_K = _masked_rows(hidden_BLD, labels_BL)
    return headless_loss(pred_KD, ids_K, embedding_weight_VD, **cwt_options)


def vanilla_causal_loss(
    hidden_BLD: Tensor,
    input_ids_BL: Tensor,
    head: LMHead,
    *,
    target_mask_BL: Tensor | None = None,
    impl: str = "full",
    chunk_size: int = 4096,
    vanilla_impl: str = "torch",
) -> LossOutput:
    """Next-token cross-entropy through a vocabulary head (see `cross_entropy_head` for impl
    and vanilla_impl)."""
    pred_KD, ids_K = _causal_rows(hidden_BLD, input_ids_BL, target_mask_BL)
    kwargs = dict(impl=impl, chunk_size=chunk_size, vanilla_impl=vanilla_impl)
    loss = cross_entropy_head(head.features(pred_KD), head.weight, head.bias, ids_K, **kwargs)
    return LossOutput(loss=loss, num_rows=len(ids_K))


def vanilla_masked_loss(
    hidden_BLD: Tensor,
    labels_BL: Tensor,
    head: LMHead,
    *,
    full_logits: bool = False,
    impl: str = "full",
    chunk_size: int = 4096,
    vanilla_impl: str = "torch",
) -> LossOutput:
    """Masked-LM cross-entropy; ``labels_BL`` = original token id at masked positions, else -100.

    By default the head (transform and logits) runs at the masked positions only: the strong
    baseline. ``full_logits=True`` runs it on every position and then ignores the unmasked ones,
    as the paper's baseline did; same loss, several times the head's cost.
    """
    kwargs = dict(impl=impl, chunk_size=chunk_size, vanilla_impl=vanilla_impl)
    if not full_logits:
        pred_KD, ids_K = _masked_rows(hidden_BLD, labels_BL)
        loss = cross_entropy_head(head.features(pred_KD), head.weight, head.bias, ids_K, **kwargs)
        return LossOutput(loss=loss, num_rows=len(ids_K))
    features_ND = head.features(hidden_BLD).flatten(0, 1)
    labels_N = labels_BL.reshape(-1)
    loss = cross_entropy_head(features_ND, head.weight, head.bias, labels_N, **kwargs)
    # A tensor count: this path never selects rows, so it stays free of device syncs.
    return LossOutput(loss=loss, num_rows=(labels_N != IGNORE_INDEX).sum())


def mixed_loss(
    cwt: LossOutput, ce: LossOutput, *, cwt_weight: float, ce_weight: float
) -> LossOutput:
    """The paper's CE + CWT ablation: ``cwt_weight·CWT + ce_weight·CE`` over the same rows.

    Keeps the CWT output's row count and in-batch accuracy.
    """
    loss = cwt_weight * cwt.loss + ce_weight * ce.loss
    return LossOutput(loss=loss, num_rows=cwt.num_rows, accuracy=cwt.accuracy)
