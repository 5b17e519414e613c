"""The Contrastive Weight Tying (CWT) loss itself: predictions scored against embedding rows.

CWT (Godey et al. 2024, "Headless Language Models") scores each of K target positions against the
*input-embedding rows* of the micro-batch's true tokens instead of against the whole vocabulary:
with predictions O (K×D, last hidden states) and targets E (K×D, embedding rows of the true
tokens, not detached), ``loss_i = -log softmax(O Eᵀ / τ)[i, i]``. The model-level objectives
(which rows of a decoder or encoder are predictions) are in `hlm_ray.objectives`.

Shape suffixes: K target rows, D hidden width, V vocabulary, U distinct target ids
(U <= min(K, V)), N negatives, C a chunk of rows.

    from hlm_ray.cwt import cwt_loss, cwt_loss_from_ids, cwt_loss_sampled, sample_negative_rows

    loss = cwt_loss(predictions_KD, targets_KD)                       # the paper's form
    loss, acc = cwt_loss_from_ids(predictions_KD, ids_K, emb_VD, return_accuracy=True)
    rows_N = sample_negative_rows(K, 64, torch.Generator().manual_seed(0))
    loss = cwt_loss_sampled(predictions_KD, ids_K, emb_VD, rows_N)    # a separate negative set

Every logit is computed in float32 (bf16/fp16 inputs are upcast first) and reduced with
``F.cross_entropy``, never exp→sum→log: the authors' code did the latter and produced NaN as soon
as a logit passed ~88.7.
"""

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from hlm_ray.cross_entropy import reduce_loss as _reduce
from hlm_ray.cross_entropy import upcast as _upcast
from hlm_ray.device import float32_region

CWT_VARIANTS = ("plain", "dedup", "mask_same")


def _cwt_rows(
    pred_KD: Tensor,
    cols_UD: Tensor,
    pos_K: Tensor,
    log_count_U: Tensor | None,
    temperature: float,
    mask_same: bool,
    col_ids_U: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """Per-row CWT loss of K predictions against U columns; pos_K = each row's own column.

    log_count_U (dedup form): each column stands for count_u identical negatives, so
    log(count_u) is added to its logit; the positive still counts once. Returns the loss (K,)
    and, when col_ids_U is given, whether each row's top-scoring column has its own id (K,).
    """
    # Scaling the K×D side is cheaper than dividing the K×U logits; float32 even under autocast.
    with float32_region(pred_KD.device.type):
        logits_KU = (pred_KD / temperature) @ cols_UD.T
    correct_K = None
    if col_ids_U is not None:
        with torch.no_grad():
            # Before the log-count term: accuracy ranks the distinct tokens by score alone.
            correct_K = col_ids_U[logits_KU.argmax(dim=1)] == col_ids_U[pos_K]
    if log_count_U is None:
        return F.cross_entropy(logits_KU, pos_K, reduction="none"), correct_K
    logits_KU = logits_KU + log_count_U
    if mask_same:
        # Same-id negatives are dropped: the own column keeps weight 1 (log 1 = 0), so the
        # denominator is exp(pos) + the columns of other ids, and cross-entropy is exact.
        # In place is safe: nothing saved for backward holds this sum.
        rows_K = torch.arange(len(pos_K), device=pos_K.device)
        logits_KU[rows_K, pos_K] -= log_count_U[pos_K]
        return F.cross_entropy(logits_KU, pos_K, reduction="none"), correct_K
    # cross_entropy's positive term carries the own column's log count: add it back, since the
    # positive is one copy (the other c-1 copies stay in the denominator as negatives).
    loss_K = F.cross_entropy(logits_KU, pos_K, reduction="none") + log_count_U[pos_K]
    return loss_K, correct_K


def _cwt_per_row(
    chunk_size: int | None, pred_KD: Tensor, cols_UD: Tensor, pos_K: Tensor, *args
) -> tuple[Tensor, Tensor | None]:
    """``_cwt_rows(pred_KD, cols_UD, pos_K, *args)``, optionally over row chunks of
    ``chunk_size`` so only chunk×U logits ever exist."""
    K = pred_KD.shape[0]
    if chunk_size is None or chunk_size >= K:
        return _cwt_rows(pred_KD, cols_UD, pos_K, *args)
    losses, corrects = [], []
    for start in range(0, K, chunk_size):
        rows = slice(start, start + chunk_size)
        # Checkpointing drops the chunk's logits after forward and recomputes them in backward,
        # so the K×U matrix is neither materialised nor saved. No randomness: skip RNG state.
        loss_C, correct_C = checkpoint(
            _cwt_rows,
            pred_KD[rows],
            cols_UD,
            pos_K[rows],
            *args,
            use_reentrant=False,
            preserve_rng_state=False,
        )
        losses.append(loss_C)
        corrects.append(correct_C)
    return torch.cat(losses), None if corrects[0] is None else torch.cat(corrects)


def cwt_loss(
    predictions: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
    reduction: str = "mean",
) -> Tensor:
    """Contrastive Weight Tying loss: mean_i of ``-log softmax(O Eᵀ / τ)[i, i]``.

    predictions O (K×D) and targets E (K×D, embedding rows of the true tokens) both get
    gradient. Repeated tokens count as negatives of each other (the paper's objective); see
    `cwt_loss_from_ids` for the cheaper exact de-duplicated form. ``chunk_size`` bounds the
    logits held at once to chunk_size×K rows (same value and gradients).
    """
    pos_K = torch.arange(predictions.shape[0], device=predictions.device)
    loss_K, _ = _cwt_per_row(
        chunk_size, _upcast(predictions), _upcast(targets), pos_K, None, temperature, False, None
    )
    return _reduce(loss_K, reduction)


def _locate(ids_K: Tensor, sorted_ids_N: Tensor) -> Tensor:
    """Index into sorted_ids_N of each id; ValueError if one is absent."""
    idx_K = torch.searchsorted(sorted_ids_N, ids_K).clamp_(max=len(sorted_ids_N) - 1)
    found_K = sorted_ids_N[idx_K] == ids_K
    if not bool(found_K.all()):
        missing = ids_K[~found_K].unique()[:10].tolist()
        raise ValueError(
            f"negative_ids must contain every target id (each row's own positive); "
            f"missing {missing}"
        )
    return idx_K


def cwt_loss_from_ids(
    predictions: Tensor,
    target_ids: Tensor,
    embedding_weight: Tensor,
    temperature: float = 1.0,
    *,
    variant: str = "dedup",
    negative_ids: Tensor | None = None,
    chunk_size: int | None = None,
    reduction: str = "mean",
    return_accuracy: bool = False,
    sparse_grad: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """CWT loss of predictions (K×D) for target token ids (K,) with the embedding table (V×D).

    Gradient flows into ``embedding_weight`` through the gathered rows. Variants:

    - ``"plain"``: exactly ``cwt_loss(predictions, embedding_weight[target_ids])`` (K×K logits).
    - ``"dedup"`` (default): the same value and gradients, computed against the U unique ids
      with log(count) added to each column (K×U logits, U <= min(K, V)).
    - ``"mask_same"``: a different objective (ablation): negatives with the row's own id are
      removed, so a token repeated c times is no longer held to a loss >= log c.

    ``negative_ids`` (N,): build the columns from these ids instead of ``target_ids``, e.g. all
    workers' target ids concatenated (repeats kept: each occurrence is one negative, as in the
    plain loss over the concatenated rows). Each target must be among them (ValueError if not).

    With ``return_accuracy``, returns ``(loss, accuracy)``: the fraction of rows whose
    top-scoring distinct column (plain dot products) is their own id, without gradient.

    ``sparse_grad``: the table's gradient from the gathered rows is a sparse (COO) tensor of U
    rows instead of a dense V×D one (for a row-wise optimizer update; same values).
    """
    if variant not in CWT_VARIANTS:
        raise ValueError(f"variant={variant!r}; use one of {', '.join(CWT_VARIANTS)}")
    log_count_U = None
    if variant == "plain":
        if negative_ids is None:
            col_ids_U = target_ids
            pos_K = torch.arange(len(target_ids), device=target_ids.device)
        else:
            # Any copy of the own id is a correct positive column: copies have equal embeddings.
            col_ids_U = negative_ids
            sorted_ids_N, order_N = negative_ids.sort()
            pos_K = order_N[_locate(target_ids, sorted_ids_N)]
    else:
        if negative_ids is None:
            col_ids_U, pos_K, count_U = torch.unique(
                target_ids, return_inverse=True, return_counts=True
            )
        else:
            col_ids_U, count_U = torch.unique(negative_ids, return_counts=True)
            pos_K = _locate(target_ids, col_ids_U)  # torch.unique sorts
    pred_KD = _upcast(predictions)
    # Gather before upcasting: only U rows of the table are converted, not all V.
    cols_UD = _upcast(F.embedding(col_ids_U, embedding_weight, sparse=sparse_grad))
    if variant != "plain":
        log_count_U = count_U.to(pred_KD.dtype).log()
    loss_K, correct_K = _cwt_per_row(
        chunk_size,
        pred_KD,
        cols_UD,
        pos_K,
        log_count_U,
        temperature,
        variant == "mask_same",
        col_ids_U if return_accuracy else None,
    )
    loss = _reduce(loss_K, reduction)
    if not return_accuracy:
        return loss
    return loss, correct_K.float().mean()


def sample_negative_rows(num_rows: int, num_negatives: int, generator: torch.Generator) -> Tensor:
    """Positions (N,) of a seeded random subset of N of the K rows (all K when N >= K), on CPU."""
    return torch.randperm(num_rows, generator=generator)[:num_negatives]


def cwt_loss_sampled(
    predictions: Tensor,
    target_ids: Tensor,
    embedding_weight: Tensor,
    negative_rows: Tensor,
    temperature: float = 1.0,
    *,
    reduction: str = "mean",
    return_accuracy: bool = False,
    sparse_grad: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """CWT against a separate negative set S_N (the paper's footnote): row i scores its own
    target's embedding against the targets at ``negative_rows`` (N,) other than row i itself,
    ``loss_i = -log(exp(s_ii) / (exp(s_ii) + Σ_{j∈S, j≠i} exp(s_ij)))`` with s = O Eᵀ / τ.
    Repeated tokens count as negatives, as in the plain loss; with S = all K rows this *is* the
    plain loss. Accuracy: the top-scoring column carries the row's own id."""
    pred_KD = _upcast(predictions) / temperature
    rows_N = negative_rows.to(target_ids.device)
    targets_KD = _upcast(F.embedding(target_ids, embedding_weight, sparse=sparse_grad))
    positive_K = (pred_KD * targets_KD).sum(dim=1)
    negative_KN = pred_KD @ targets_KD[rows_N].T
    own_KN = rows_N[None, :] == torch.arange(len(target_ids), device=rows_N.device)[:, None]
    logits_K1N = torch.cat([positive_K[:, None], negative_KN.masked_fill(own_KN, -torch.inf)], 1)
    zeros_K = torch.zeros(len(target_ids), dtype=torch.long, device=target_ids.device)
    loss = _reduce(F.cross_entropy(logits_K1N, zeros_K, reduction="none"), reduction)
    if not return_accuracy:
        return loss
    with torch.no_grad():
        col_ids = torch.cat([target_ids.new_full((1,), -1), target_ids[rows_N]])
        top_K = logits_K1N.argmax(dim=1)
        correct_K = (top_K == 0) | (col_ids[top_K] == target_ids)
    return loss, correct_K.float().mean()
