"""hlm_ray.cross_entropy beyond its reference test (tests/test_objectives.py): each `impl` runs
the computation it names, another ignore index is honoured by every path, mixed dtypes as under
autocast, a head's transform, and the message on a torch without the fused op."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import hlm_ray.cross_entropy as ce
from hlm_ray.cross_entropy import LMHead, cross_entropy_head
from hlm_ray.errors import TorchTooOld
from hlm_ray.objectives import vanilla_masked_loss


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def problem(N=37, D=8, V=50, dtype=torch.float64):
    return (
        torch.randn(N, D, dtype=dtype),
        torch.randn(V, D, dtype=dtype),
        torch.randn(V, dtype=dtype),
        torch.randint(0, V, (N,)),
    )


@pytest.fixture
def calls(monkeypatch):
    """What each call ran: the checkpointed chunks and torch's fused op (with its options)."""
    seen = {"chunks": 0, "fused": []}
    real_checkpoint, real_fused = ce.checkpoint, F.linear_cross_entropy

    def checkpoint(*args, **kwargs):
        seen["chunks"] += 1
        return real_checkpoint(*args, **kwargs)

    def fused(*args, **kwargs):
        seen["fused"].append(kwargs["options"])
        return real_fused(*args, **kwargs)

    monkeypatch.setattr(ce, "checkpoint", checkpoint)
    monkeypatch.setattr(F, "linear_cross_entropy", fused)
    return seen


@pytest.mark.parametrize(
    ("impl", "chunk_size", "chunks", "fused_rows"),
    [
        (None, 8, 0, None),  # the default is "full": the N×V logits at once
        ("full", 8, 0, None),
        ("chunked", 8, 5, None),  # ceil(37 / 8) checkpointed chunks
        ("chunked", 37, 0, None),  # one chunk is the whole batch: nothing to chunk
        ("linear", 8, 0, 8),  # torch's fused op, chunk_size rows a chunk
        ("linear", 1, 0, 1),
        ("linear", 100, 0, 37),  # never more rows a chunk than there are rows
    ],
)
def test_each_impl_runs_the_computation_it_names(calls, impl, chunk_size, chunks, fused_rows):
    """`impl` is a memory/speed choice the value cannot show (every path equals the reference):
    full materialises the logits, chunked checkpoints `chunk_size` rows at a time, linear hands
    torch's fused op `chunk_size` rows a chunk (its own heuristic picks 1-2 rows on CPU)."""
    hidden, weight, bias, labels = problem()
    kwargs = {} if impl is None else {"impl": impl}
    loss = cross_entropy_head(hidden, weight, bias, labels, chunk_size=chunk_size, **kwargs)
    assert_close(loss, F.cross_entropy(F.linear(hidden, weight, bias), labels))
    assert calls["chunks"] == chunks
    if fused_rows is None:
        assert calls["fused"] == []
    else:
        [options] = calls["fused"]
        assert options is not None and options.batch_chunk_size == fused_rows


@pytest.mark.parametrize("impl", ["full", "chunked", "linear"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_another_ignore_index_is_ignored_by_every_impl(impl, reduction):
    """ignore_index=3: rows labelled 3 count for nothing, in the value and in the gradient
    (the default, -100, would let them count)."""
    hidden, weight, bias, labels = problem()
    labels[::3] = 3
    hidden.requires_grad_(True)
    logits = F.linear(hidden, weight, bias)
    ref = F.cross_entropy(logits, labels, ignore_index=3, reduction=reduction)
    loss = cross_entropy_head(hidden, weight, bias, labels, impl=impl, chunk_size=8,
                              ignore_index=3, reduction=reduction)  # fmt: skip
    assert_close(loss, ref)
    if reduction == "none":
        assert (loss[::3] == 0).all()
    (g,) = torch.autograd.grad(loss.sum(), hidden)
    (g_ref,) = torch.autograd.grad(ref.sum(), hidden)
    assert_close(g, g_ref)
    assert (g[::3] == 0).all()


@pytest.mark.parametrize("impl", ["full", "chunked", "linear"])
def test_bf16_hidden_states_with_a_float32_head_as_under_autocast(impl):
    """Hidden states in bf16 (an autocast forward), weight in float32, bias in bf16: one dtype
    for the op, float32 logits, the float64 reference's value."""
    hidden, weight, bias, labels = problem(N=20, D=8, V=30, dtype=torch.float32)
    hidden, bias = hidden.bfloat16(), bias.bfloat16()
    ref = F.cross_entropy(F.linear(hidden.double(), weight.double(), bias.double()), labels)
    loss = cross_entropy_head(hidden, weight, bias, labels, impl=impl, chunk_size=6)
    assert loss.dtype == torch.float32
    assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)


def test_a_heads_transform_runs_before_the_logits():
    """A BERT-style head (dense, gelu, LayerNorm, then the tied weight): the masked loss is the
    cross-entropy of weight · transform(hidden) at the masked positions."""
    B, L, D, V = 2, 6, 8, 20
    transform = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.LayerNorm(D)).double()
    head = LMHead(transform=transform, weight=torch.randn(V, D, dtype=torch.float64), bias=None)
    hidden = torch.randn(B, L, D, dtype=torch.float64)
    labels = torch.full((B, L), -100)
    labels[0, 1], labels[1, 4] = 5, 7
    out = vanilla_masked_loss(hidden, labels, head)
    rows = transform(hidden[labels != -100])
    assert_close(out.loss, F.cross_entropy(rows @ head.weight.T, labels[labels != -100]))
    assert LMHead(transform=None, weight=head.weight, bias=None).features(hidden) is hidden


def test_the_fused_op_on_an_older_torch_names_the_option_and_the_version(monkeypatch):
    monkeypatch.delattr(torch.nn, "LinearCrossEntropyOptions")
    hidden, weight, _, labels = problem()
    with pytest.raises(TorchTooOld, match=r"^objective\.ce_impl=linear needs torch >= 2\.13 "):
        cross_entropy_head(hidden, weight, None, labels, impl="linear")


@pytest.mark.parametrize("impl", ["full", "chunked", "linear"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("scale", [1.0, 300.0], ids=["normal", "extreme"])
def test_an_all_bf16_head_gets_float32_logits_from_every_impl(impl, reduction, scale):
    """Hidden states, weight and bias all bf16 (a head kept in bf16): float32 logits and loss
    from every impl, the float64 reference's value to float32 precision, also with logits in
    the thousands (exp overflows past 88.7); a bf16-computed loss would be off by ~1e-3 of it."""
    hidden, weight, bias, labels = problem(N=20, D=8, V=30, dtype=torch.float32)
    hidden, weight, bias = (scale * hidden).bfloat16(), weight.bfloat16(), bias.bfloat16()
    labels[::5] = -100
    logits = F.linear(hidden.double(), weight.double(), bias.double())
    ref = F.cross_entropy(logits, labels, reduction=reduction)
    loss = cross_entropy_head(hidden, weight, bias, labels, impl=impl, chunk_size=6,
                              reduction=reduction)  # fmt: skip
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("N", "chunks"), [(4096, 0), (4097, 2)])
def test_the_default_chunk_is_4096_rows(calls, N, chunks):
    """impl="chunked" without chunk_size: 4096 rows' logits at a time (4097 rows: 2 chunks)."""
    hidden, weight, bias, labels = problem(N=N, D=4, V=8)
    loss = cross_entropy_head(hidden, weight, bias, labels, impl="chunked")
    assert_close(loss, F.cross_entropy(F.linear(hidden, weight, bias), labels))
    assert calls["chunks"] == chunks
