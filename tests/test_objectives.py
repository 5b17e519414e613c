"""Tests for hlm_ray.objectives: CWT against float64 references, its exact variants, and the
vocabulary cross-entropy head implementations."""

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

from hlm_ray.objectives import (
    LMHead,
    LossOutput,
    cross_entropy_head,
    cwt_loss,
    cwt_loss_from_ids,
    cwt_loss_sampled,
    headless_causal_loss,
    headless_masked_loss,
    mixed_loss,
    sample_negative_rows,
    vanilla_causal_loss,
    vanilla_masked_loss,
)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def ref_cwt(pred_KD: Tensor, targ_KD: Tensor, temperature: float = 1.0) -> Tensor:
    """Per-row -log(exp(o_i·e_i/τ) / Σ_j exp(o_i·e_j/τ)), straight from the formula, float64."""
    z_KK = pred_KD.double() @ targ_KD.double().T / temperature
    return torch.logsumexp(z_KK, dim=1) - z_KK.diagonal()


def ref_mask_same(pred_KD: Tensor, ids_K: Tensor, emb_VD: Tensor) -> Tensor:
    """Per-row loss with same-id negatives removed: denominator exp(pos) + other ids only."""
    z_KK = pred_KD.double() @ emb_VD[ids_K].double().T
    other_KK = ids_K[:, None] != ids_K[None, :]
    pos_K = z_KK.diagonal()
    neg_KK = z_KK.masked_fill(~other_KK, float("-inf"))
    return torch.logsumexp(torch.cat([pos_K[:, None], neg_KK], dim=1), dim=1) - pos_K


def grads(loss: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    return torch.autograd.grad(loss, tensors)


def repeated_ids_problem(
    K: int = 40, V: int = 12, D: int = 8, id_range: int = 5, dtype=torch.float64
) -> tuple[Tensor, Tensor, Tensor]:
    """Predictions (K×D), ids (K,) drawn from few tokens so most repeat, table (V×D)."""
    pred_KD = torch.randn(K, D, dtype=dtype, requires_grad=True)
    ids_K = torch.randint(0, id_range, (K,))
    emb_VD = torch.randn(V, D, dtype=dtype, requires_grad=True)
    return pred_KD, ids_K, emb_VD


# ---- cwt_loss -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("K", "D", "tau"), [(1, 4, 1.0), (7, 16, 1.0), (33, 8, 0.5), (64, 32, 2.0)]
)
def test_cwt_loss_matches_float64_reference(K: int, D: int, tau: float) -> None:
    pred, targ = torch.randn(K, D), torch.randn(K, D)
    loss = cwt_loss(pred, targ, tau)
    assert loss.dtype == torch.float32
    assert_close(loss.double(), ref_cwt(pred, targ, tau).mean(), rtol=1e-5, atol=1e-5)
    # float64 inputs stay float64: exact up to summation order.
    pred64, targ64 = pred.double(), targ.double()
    assert_close(cwt_loss(pred64, targ64, tau), ref_cwt(pred64, targ64, tau).mean())


def test_cwt_loss_with_duplicated_targets() -> None:
    emb = torch.randn(4, 8)
    ids = torch.tensor([0, 1, 0, 2, 0, 1, 3, 3, 0])
    pred = torch.randn(len(ids), 8)
    loss_K = cwt_loss(pred, emb[ids], reduction="none")
    assert_close(loss_K.double(), ref_cwt(pred, emb[ids]), rtol=1e-5, atol=1e-5)
    # A token occurring c times cannot go below log c: its copies are negatives too.
    counts = torch.bincount(ids)[ids].double()
    assert (loss_K.double() >= counts.log() - 1e-5).all()


def test_cwt_loss_reductions() -> None:
    pred, targ = torch.randn(10, 6), torch.randn(10, 6)
    per_row = cwt_loss(pred, targ, reduction="none")
    assert per_row.shape == (10,)
    assert_close(per_row.double(), ref_cwt(pred, targ), rtol=1e-5, atol=1e-5)
    assert_close(cwt_loss(pred, targ, reduction="sum"), per_row.sum())
    assert_close(cwt_loss(pred, targ, reduction="mean"), per_row.mean())
    with pytest.raises(ValueError, match="mean, sum, none"):
        cwt_loss(pred, targ, reduction="avg")


def test_extreme_logits_stay_finite() -> None:
    # Logits around 1e3-1e4: exp overflows float32 past ~88.7.
    pred, targ = 30 * torch.randn(16, 32), 30 * torch.randn(16, 32)
    z = pred @ targ.T
    assert z.abs().max() > 1e3
    naive = -torch.log(z.diagonal().exp() / z.exp().sum(dim=1)).mean()
    assert not torch.isfinite(naive)
    loss_K = cwt_loss(pred, targ, reduction="none")
    assert torch.isfinite(loss_K).all()
    assert_close(loss_K.double(), ref_cwt(pred, targ), rtol=1e-4, atol=1e-2)
    # Gradients too.
    pred.requires_grad_(True)
    (g,) = grads(cwt_loss(pred, targ), pred)
    assert torch.isfinite(g).all()


def test_bf16_inputs_give_float32_loss() -> None:
    pred = torch.randn(32, 16).bfloat16().requires_grad_(True)
    targ = torch.randn(32, 16).bfloat16().requires_grad_(True)
    loss = cwt_loss(pred, targ, 0.7)
    assert loss.dtype == torch.float32
    assert torch.isfinite(loss)
    assert_close(
        loss.double(), ref_cwt(pred.detach(), targ.detach(), 0.7).mean(), rtol=1e-3, atol=0
    )
    g_pred, g_targ = grads(loss, pred, targ)
    assert g_pred.dtype == torch.bfloat16 and torch.isfinite(g_pred).all()
    assert g_targ.dtype == torch.bfloat16 and torch.isfinite(g_targ).all()


def test_cwt_loss_chunked_equals_unchunked() -> None:
    pred = torch.randn(37, 8, dtype=torch.float64, requires_grad=True)
    targ = torch.randn(37, 8, dtype=torch.float64, requires_grad=True)
    full = cwt_loss(pred, targ, 0.5)
    chunked = cwt_loss(pred, targ, 0.5, chunk_size=8)
    assert_close(chunked, full)
    for g_chunked, g_full in zip(grads(chunked, pred, targ), grads(full, pred, targ), strict=True):
        assert_close(g_chunked, g_full)


def test_chunking_never_saves_the_square_logits() -> None:
    K, D, chunk = 64, 4, 8
    pred = torch.randn(K, D, requires_grad=True)
    ids = torch.randperm(K)
    emb = torch.randn(K, D, requires_grad=True)

    def largest_saved(**kw) -> int:
        sizes = [0]

        def pack(t: Tensor) -> Tensor:
            sizes.append(t.numel())
            return t

        # Tensors saved inside a checkpointed region go to checkpoint's own hooks, not these.
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            cwt_loss_from_ids(pred, ids, emb, **kw).backward()
        return max(sizes)

    assert largest_saved() >= K * K
    assert largest_saved(chunk_size=chunk) <= K * D


# ---- cwt_loss_from_ids --------------------------------------------------------------------


def test_plain_from_ids_is_cwt_loss() -> None:
    pred, ids, emb = repeated_ids_problem()
    assert_close(cwt_loss_from_ids(pred, ids, emb, variant="plain"), cwt_loss(pred, emb[ids]))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dedup_equals_plain(reduction: str, dtype: torch.dtype) -> None:
    pred, ids, emb = repeated_ids_problem(dtype=dtype)
    assert len(ids.unique()) < len(ids) // 4
    plain = cwt_loss_from_ids(pred, ids, emb, 0.8, variant="plain", reduction=reduction)
    dedup = cwt_loss_from_ids(pred, ids, emb, 0.8, variant="dedup", reduction=reduction)
    # float64 inputs: exact up to summation order (the log counts too are float64).
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else {}
    assert_close(dedup, plain, **tol)
    g_plain = grads(plain.sum(), pred, emb)
    g_dedup = grads(dedup.sum(), pred, emb)
    for g_d, g_p in zip(g_dedup, g_plain, strict=True):
        assert_close(g_d, g_p)


@pytest.mark.parametrize("variant", ["plain", "dedup", "mask_same"])
def test_from_ids_chunked_equals_unchunked(variant: str) -> None:
    pred, ids, emb = repeated_ids_problem(K=45)
    full, acc_full = cwt_loss_from_ids(pred, ids, emb, variant=variant, return_accuracy=True)
    chunked, acc_chunked = cwt_loss_from_ids(
        pred, ids, emb, variant=variant, chunk_size=7, return_accuracy=True
    )
    assert_close(chunked, full)
    assert_close(acc_chunked, acc_full)
    for g_c, g_f in zip(grads(chunked, pred, emb), grads(full, pred, emb), strict=True):
        assert_close(g_c, g_f)


def test_mask_same_is_a_different_objective_with_duplicates() -> None:
    pred, ids, emb = repeated_ids_problem()
    mask_same = cwt_loss_from_ids(pred, ids, emb, variant="mask_same", reduction="none")
    assert_close(mask_same, ref_mask_same(pred.detach(), ids, emb.detach()))
    plain = cwt_loss_from_ids(pred, ids, emb, variant="plain", reduction="none")
    # Removing negatives can only lower each row's loss, strictly where the id repeats.
    repeated = torch.bincount(ids)[ids] > 1
    assert (mask_same[repeated] < plain[repeated]).all()
    assert_close(mask_same[~repeated], plain[~repeated])


def test_mask_same_equals_plain_when_ids_are_unique() -> None:
    pred = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    emb = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    ids = torch.randperm(30)[:20]
    mask_same = cwt_loss_from_ids(pred, ids, emb, variant="mask_same")
    plain = cwt_loss_from_ids(pred, ids, emb, variant="plain")
    assert_close(mask_same, plain)
    for g_m, g_p in zip(grads(mask_same, pred, emb), grads(plain, pred, emb), strict=True):
        assert_close(g_m, g_p)


@pytest.mark.parametrize("variant", ["plain", "dedup"])
def test_negative_ids_match_plain_loss_over_concatenated_batches(variant: str) -> None:
    # Two "workers" A and B sharing negatives: rows of A against all ids of A‖B must score as
    # the A rows of the plain loss over the concatenated batch.
    pred, ids, emb = repeated_ids_problem(K=30)
    ids_a, ids_b = ids[:18], ids[18:]
    pred_a = pred[:18]
    joint = cwt_loss_from_ids(pred, ids, emb, variant="plain", reduction="none")[:18]
    shared = cwt_loss_from_ids(
        pred_a,
        ids_a,
        emb,
        variant=variant,
        negative_ids=torch.cat([ids_a, ids_b]),
        reduction="none",
    )
    assert_close(shared, joint)
    for g_s, g_j in zip(grads(shared.sum(), pred, emb), grads(joint.sum(), pred, emb), strict=True):
        assert_close(g_s, g_j)


def test_missing_target_in_negative_ids_raises() -> None:
    pred, _, emb = repeated_ids_problem(K=4)
    ids = torch.tensor([1, 2, 3, 9])
    for variant in ("plain", "dedup", "mask_same"):
        with pytest.raises(ValueError, match=r"missing \[9\]"):
            cwt_loss_from_ids(pred, ids, emb, variant=variant, negative_ids=torch.arange(5))
    pred, _, emb = repeated_ids_problem(K=14, V=20)
    with pytest.raises(ValueError, match=r"missing \[2, 3, 4, 5, 6, 7, 8, 9, 10, 11\]$"):
        cwt_loss_from_ids(pred, torch.arange(14), emb, negative_ids=torch.tensor([0, 1]))


def test_unknown_variant_lists_the_allowed_ones() -> None:
    pred, ids, emb = repeated_ids_problem(K=4)
    with pytest.raises(ValueError, match="plain, dedup, mask_same"):
        cwt_loss_from_ids(pred, ids, emb, variant="cosine")


@pytest.mark.parametrize("variant", ["plain", "dedup", "mask_same"])
def test_embedding_table_gets_gradient_as_input_and_as_target(variant: str) -> None:
    emb = nn.Embedding(12, 6)
    proj = torch.randn(6, 6)
    inputs = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1])  # rows 0-5: inputs only
    targets = torch.tensor([6, 7, 8, 9, 10, 11, 6, 6])  # rows 6-11: targets only
    pred = emb(inputs) @ proj
    cwt_loss_from_ids(pred, targets, emb.weight, variant=variant).backward()
    assert (emb.weight.grad.abs().sum(dim=1) > 0).all()


def test_cwt_loss_gives_gradient_to_targets() -> None:
    emb = nn.Embedding(8, 4)
    pred = emb(torch.tensor([0, 1, 2, 3])) @ torch.randn(4, 4)
    cwt_loss(pred, emb(torch.tensor([4, 5, 6, 7]))).backward()
    assert (emb.weight.grad.abs().sum(dim=1) > 0).all()


def test_in_batch_accuracy() -> None:
    # Orthonormal embeddings: o_i = 5·e_i scores 5 on its own column and 0 on the others.
    emb = torch.linalg.qr(torch.randn(16, 16))[0]
    ids = torch.tensor([3, 7, 1, 0, 12, 9])
    _, acc = cwt_loss_from_ids(5 * emb[ids], ids, emb, return_accuracy=True)
    assert acc.dtype == torch.float32 and acc.item() == 1.0
    # Repeated ids still count as correct: the top *distinct* column is the own id.
    ids = torch.tensor([3, 3, 3, 1, 1, 0])
    for variant in ("plain", "dedup", "mask_same"):
        _, acc = cwt_loss_from_ids(5 * emb[ids], ids, emb, variant=variant, return_accuracy=True)
        assert acc.item() == 1.0
    _, acc = cwt_loss_from_ids(-5 * emb[ids], ids, emb, return_accuracy=True)
    assert acc.item() == 0.0
    pred = emb[ids].clone()
    pred[0] = emb[1]  # row 0 (target 3) now points at token 1
    _, acc = cwt_loss_from_ids(pred, ids, emb, return_accuracy=True)
    assert acc.item() == pytest.approx(5 / 6)


# ---- cross_entropy_head -------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["full", "chunked", "linear"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_head_matches_reference(impl: str, with_bias: bool, reduction: str) -> None:
    N, D, V = 37, 8, 50
    hidden = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, dtype=torch.float64, requires_grad=True) if with_bias else None
    labels = torch.randint(0, V, (N,))
    labels[::4] = -100
    ref = F.cross_entropy(F.linear(hidden, weight, bias), labels, reduction=reduction)
    loss = cross_entropy_head(
        hidden, weight, bias, labels, impl=impl, chunk_size=8, reduction=reduction
    )
    assert_close(loss, ref)
    params = [t for t in (hidden, weight, bias) if t is not None]
    for g, g_ref in zip(grads(loss.sum(), *params), grads(ref.sum(), *params), strict=True):
        assert_close(g, g_ref)


def test_cross_entropy_head_upcasts_bf16() -> None:
    hidden, weight = torch.randn(20, 8).bfloat16(), torch.randn(30, 8).bfloat16()
    labels = torch.randint(0, 30, (20,))
    ref = F.cross_entropy(F.linear(hidden.double(), weight.double()), labels)
    for impl in ("full", "chunked"):
        loss = cross_entropy_head(hidden, weight, None, labels, impl=impl, chunk_size=6)
        assert loss.dtype == torch.float32
        assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)


def test_cross_entropy_head_rejects_unknown_impl() -> None:
    with pytest.raises(ValueError, match="full, chunked, linear"):
        cross_entropy_head(
            torch.randn(2, 3), torch.randn(4, 3), None, torch.zeros(2).long(), impl="fused"
        )


# ---- model-level objectives ---------------------------------------------------------------


def bert_like_head(D: int, V: int) -> LMHead:
    transform = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.LayerNorm(D)).double()
    weight = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    return LMHead(transform=transform, weight=weight, bias=torch.randn(V, dtype=torch.float64))


def masked_batch(B: int = 3, L: int = 10, D: int = 8, V: int = 20) -> tuple[Tensor, Tensor]:
    hidden = torch.randn(B, L, D, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, L))
    labels[torch.rand(B, L) > 0.3] = -100
    return hidden, labels


@pytest.mark.parametrize("impl", ["full", "chunked"])
def test_vanilla_masked_full_logits_equals_masked_only(impl: str) -> None:
    hidden, labels = masked_batch()
    head = bert_like_head(8, 20)
    masked_only = vanilla_masked_loss(hidden, labels, head, impl=impl, chunk_size=4)
    full = vanilla_masked_loss(hidden, labels, head, full_logits=True, impl=impl, chunk_size=4)
    n_masked = int((labels != -100).sum())
    assert masked_only.num_rows == n_masked and int(full.num_rows) == n_masked
    assert_close(full.loss, masked_only.loss)
    for g_f, g_m in zip(
        grads(full.loss, hidden, head.weight),
        grads(masked_only.loss, hidden, head.weight),
        strict=True,
    ):
        assert_close(g_f, g_m)


def test_vanilla_causal_loss_matches_reference() -> None:
    B, L, D, V = 2, 7, 8, 20
    hidden = torch.randn(B, L, D, dtype=torch.float64)
    ids = torch.randint(0, V, (B, L))
    head = LMHead(transform=None, weight=torch.randn(V, D, dtype=torch.float64), bias=None)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 4:] = False
    out = vanilla_causal_loss(hidden, ids, head, target_mask_BL=mask)
    logits = hidden[:, :-1] @ head.weight.T
    ref = F.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
    assert out.num_rows == int(mask[:, 1:].sum()) == B * (L - 1) - 3
    assert_close(out.loss, ref)


def test_vanilla_causal_loss_adds_the_heads_bias() -> None:
    B, L, D, V = 2, 5, 8, 20
    hidden = torch.randn(B, L, D, dtype=torch.float64)
    ids = torch.randint(0, V, (B, L))
    head = LMHead(transform=None, weight=torch.randn(V, D, dtype=torch.float64),
                  bias=torch.randn(V, dtype=torch.float64) * 3)  # fmt: skip
    out = vanilla_causal_loss(hidden, ids, head)
    logits = hidden[:, :-1] @ head.weight.T + head.bias
    assert_close(out.loss, F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1)))


@pytest.mark.parametrize("full_logits", [False, True])
def test_vanilla_losses_hand_the_head_its_settings_and_the_rows_they_name(
    monkeypatch, full_logits
) -> None:
    """ce_impl, ce_chunk_size and vanilla_impl reach the vocabulary head (every impl gives the
    same value, so only the call shows it); a masked LM's head runs on the masked rows only,
    or on every position with -100 elsewhere when full_logits is set."""
    from hlm_ray import objectives

    calls = []

    def head_call(hidden, weight, bias, labels, **kwargs):
        calls.append((len(labels), bias, kwargs))
        return cross_entropy_head(hidden, weight, bias, labels)

    monkeypatch.setattr(objectives, "cross_entropy_head", head_call)
    settings = dict(impl="chunked", chunk_size=7, vanilla_impl="torch")
    hidden, labels = masked_batch()
    head = bert_like_head(8, 20)
    vanilla_masked_loss(hidden, labels, head, full_logits=full_logits, **settings)
    rows = labels.numel() if full_logits else int((labels != -100).sum())
    assert calls == [(rows, head.bias, settings)]
    calls.clear()
    vanilla_causal_loss(hidden, labels.clamp_min(0), head, **settings)
    assert calls == [(3 * 9, head.bias, settings)]
    calls.clear()
    vanilla_masked_loss(hidden, labels, head)  # the default: masked rows only
    assert calls[0][0] == int((labels != -100).sum())


def test_headless_masked_loss_counts_masked_rows_only() -> None:
    hidden, labels = masked_batch()
    emb = torch.randn(20, 8, dtype=torch.float64)
    out = headless_masked_loss(hidden, labels, emb, return_accuracy=True)
    masked = labels != -100
    assert out.num_rows == int(masked.sum()) < labels.numel()
    assert_close(out.loss, ref_cwt(hidden[masked], emb[labels[masked]]).mean())
    assert out.accuracy is not None and 0.0 <= out.accuracy.item() <= 1.0


def test_headless_causal_loss_rows() -> None:
    B, L, D, V = 3, 9, 8, 15
    hidden = torch.randn(B, L, D, dtype=torch.float64)
    ids = torch.randint(0, V, (B, L))
    emb = torch.randn(V, D, dtype=torch.float64)
    out = headless_causal_loss(hidden, ids, emb)
    assert out.num_rows == B * (L - 1) and out.accuracy is None
    ref = ref_cwt(hidden[:, :-1].reshape(-1, D), emb[ids[:, 1:].reshape(-1)]).mean()
    assert_close(out.loss, ref)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, 5:] = False
    masked = headless_causal_loss(hidden, ids, emb, target_mask_BL=mask, chunk_size=5)
    keep = mask[:, 1:]
    assert masked.num_rows == B * (L - 1) - 4
    assert_close(masked.loss, ref_cwt(hidden[:, :-1][keep], emb[ids[:, 1:][keep]]).mean())


def test_mixed_loss_weights_both_terms() -> None:
    cwt = LossOutput(loss=torch.tensor(2.0), num_rows=5, accuracy=torch.tensor(0.4))
    ce = LossOutput(loss=torch.tensor(3.0), num_rows=5)
    out = mixed_loss(cwt, ce, cwt_weight=0.5, ce_weight=2.0)
    assert out.loss.item() == 7.0 and out.num_rows == 5 and out.accuracy is cwt.accuracy


# ---- a separate negative set S_N ----------------------------------------------------------


def ref_sampled(pred_KD: Tensor, ids_K: Tensor, emb_VD: Tensor, rows_N: Tensor, tau: float):
    """Per-row loss, one row at a time: the own target against the sampled rows but itself."""
    out = []
    for i in range(len(ids_K)):
        cols = [ids_K[i]] + [ids_K[j] for j in rows_N.tolist() if j != i]
        z = torch.stack([pred_KD[i].double() @ emb_VD[c].double() for c in cols]) / tau
        out.append(torch.logsumexp(z, dim=0) - z[0])
    return torch.stack(out)


@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_sampled_negatives_match_a_row_by_row_reference(tau):
    pred_KD, ids_K, emb_VD = repeated_ids_problem(K=24, V=12, D=8, id_range=6)
    rows_N = sample_negative_rows(24, 7, torch.Generator().manual_seed(3))
    assert len(rows_N) == 7 and len(set(rows_N.tolist())) == 7
    loss = cwt_loss_sampled(pred_KD, ids_K, emb_VD, rows_N, tau)
    expected = ref_sampled(pred_KD, ids_K, emb_VD, rows_N, tau).mean()
    assert_close(loss, expected)
    assert_close(grads(loss, pred_KD, emb_VD), grads(expected, pred_KD, emb_VD))


def test_sampling_every_row_is_the_plain_loss():
    pred_KD, ids_K, emb_VD = repeated_ids_problem(K=20)
    rows_K = sample_negative_rows(20, 1000, torch.Generator().manual_seed(0))  # N >= K: all
    assert sorted(rows_K.tolist()) == list(range(20))
    (loss, acc) = cwt_loss_sampled(pred_KD, ids_K, emb_VD, rows_K, return_accuracy=True)
    plain, plain_acc = cwt_loss_from_ids(
        pred_KD, ids_K, emb_VD, variant="plain", return_accuracy=True
    )
    assert_close(loss, plain)
    assert_close(acc, plain_acc)


def test_the_negative_set_is_seeded_and_reaches_the_decoder_loss():
    hidden_BLD = torch.randn(2, 9, 8, dtype=torch.float64)
    ids_BL = torch.randint(0, 30, (2, 9))
    emb_VD = torch.randn(30, 8, dtype=torch.float64)

    def loss(seed: int) -> Tensor:
        gen = torch.Generator().manual_seed(seed)
        return headless_causal_loss(hidden_BLD, ids_BL, emb_VD, num_negatives=5, generator=gen)

    assert_close(loss(1).loss, loss(1).loss)
    assert not torch.equal(loss(1).loss, loss(2).loss)
    rows_N = sample_negative_rows(16, 5, torch.Generator().manual_seed(1))
    pred_KD, ids_K = hidden_BLD[:, :-1].reshape(-1, 8), ids_BL[:, 1:].reshape(-1)
    assert_close(loss(1).loss, cwt_loss_sampled(pred_KD, ids_K, emb_VD, rows_N))


def test_sampled_negatives_take_the_temperature_reduction_and_accuracy():
    """`headless_loss` hands the sampled loss its own options (temperature, reduction,
    return_accuracy, sparse_grad) and no other; the sampled loss reduces as asked."""
    from hlm_ray.objectives import headless_loss

    pred_KD, ids_K, emb_VD = repeated_ids_problem(K=16, V=12, D=8, id_range=6)
    rows_N = sample_negative_rows(16, 5, torch.Generator().manual_seed(2))
    per_row = ref_sampled(pred_KD, ids_K, emb_VD, rows_N, 0.5)
    for reduction, expected in (
        ("sum", per_row.sum()),
        ("none", per_row),
        ("mean", per_row.mean()),
    ):
        out = headless_loss(
            pred_KD, ids_K, emb_VD, num_negatives=5, generator=torch.Generator().manual_seed(2),
            temperature=0.5, reduction=reduction, variant="dedup", chunk_size=4,
            return_accuracy=True,
        )  # fmt: skip
        assert_close(out.loss, expected)
        _, accuracy = cwt_loss_sampled(pred_KD, ids_K, emb_VD, rows_N, 0.5, return_accuracy=True)
        assert_close(out.accuracy, accuracy)
        assert_close(cwt_loss_sampled(pred_KD, ids_K, emb_VD, rows_N, 0.5, reduction=reduction),
                     expected)  # fmt: skip
    for loss_fn in (cwt_loss_sampled, cwt_loss_from_ids):
        table = emb_VD.detach().clone().requires_grad_(True)
        args = (rows_N,) if loss_fn is cwt_loss_sampled else ()
        loss_fn(pred_KD, ids_K, table, *args, sparse_grad=True).backward()
        assert table.grad.is_sparse, loss_fn.__name__
