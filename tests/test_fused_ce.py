"""The fused vanilla kernels (Liger, Cut Cross-Entropy) against plain cross-entropy on full logits,
and the compiled CWT / training-step paths against eager.

Liger and CCE's Triton kernel need the `gpu` extra and a CUDA device: skipped with the reason
elsewhere. CCE's torch.compile path (cce_compile) runs on the CPU whenever cut-cross-entropy
imports. CI installs none of them, so only the availability checks and the compile tests run there.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from hlm_ray.config import ObjectiveConfig
from hlm_ray.errors import HLMError
from hlm_ray.fused_ce import FUSED_IMPLS, unavailable_reason
from hlm_ray.models import build_model
from hlm_ray.objectives import (
    LMHead,
    cross_entropy_head,
    headless_causal_loss,
    headless_masked_loss,
    vanilla_masked_loss,
)
from hlm_ray.presets import load_config
from hlm_ray.train.compile import compiled
from hlm_ray.train.lm_objective import LMObjective

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _skip_reason(impl: str, has_bias: bool = False) -> str | None:
    return unavailable_reason(impl, DEVICE, has_bias=has_bias)


def _inputs(dtype, scale, N=96, D=48, V=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, D, generator=g) * scale).to(DEVICE, dtype)
    weight = (torch.randn(V, D, generator=g) / D**0.5).to(DEVICE, dtype)
    bias = (torch.randn(V, generator=g)).to(DEVICE, dtype)
    labels = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    labels[::7] = -100  # ignored rows: excluded from the mean's count
    return hidden, weight, bias, labels


def _loss_and_grads(fn, hidden, weight, bias):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    b = None if bias is None else bias.detach().clone().requires_grad_()
    loss = fn(h, w, b)
    loss.backward()
    return loss.detach().float(), h.grad.float(), w.grad.float(), None if b is None else b.grad


@pytest.mark.parametrize("impl", FUSED_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 300.0], ids=["normal", "extreme"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_fused_kernel_matches_full_logits_cross_entropy(impl, dtype, scale, with_bias):
    reason = _skip_reason(impl, has_bias=with_bias)
    if reason:
        pytest.skip(reason)
    hidden, weight, bias, labels = _inputs(dtype, scale)
    bias = bias if with_bias else None

    def fused(h, w, b):
        return cross_entropy_head(h, w, b, labels, vanilla_impl=impl)

    def reference(h, w, b):  # float32 logits of the same (rounded) inputs
        logits = F.linear(h.float(), w.float(), None if b is None else b.float())
        return F.cross_entropy(logits, labels, ignore_index=-100)

    got = _loss_and_grads(fused, hidden, weight, bias)
    want = _loss_and_grads(reference, hidden, weight, bias)
    assert got[0].dtype == torch.float32 and torch.isfinite(got[0])
    if dtype == torch.float32:
        # extreme: logits of several hundred, where exp→sum→log would overflow.
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5 * scale)
        for g, w in zip(got[1:], want[1:], strict=True):
            if w is not None:
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * scale)
        return
    # bf16: the kernel's bf16 matmul rounds logits by ~|logit|·2^-8 (about 1 at the extreme
    # scale), which moves single softmax entries; the loss and each gradient as a whole stay
    # close (relative norm of the difference; measured 0.055 for CCE's at the extreme scale).
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2 * scale)
    bound = 2e-2 if scale == 1.0 else 1e-1
    for g, w in zip(got[1:], want[1:], strict=True):
        if w is not None:
            assert torch.isfinite(g).all()
            assert (g - w).norm() <= bound * w.norm(), ((g - w).norm(), w.norm())


def test_unavailable_kernels_are_refused_with_what_to_do(monkeypatch):
    assert unavailable_reason("torch", "cpu") is None
    assert "use one of torch, liger, cce, cce_compile" in unavailable_reason("fast", "cuda")
    assert "no bias argument" in unavailable_reason("cce", "cuda", has_bias=True)
    assert "no bias argument" in unavailable_reason("cce_compile", "cpu", has_bias=True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "pip install 'hlm_ray[gpu]'" in unavailable_reason("liger", "cuda")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert unavailable_reason("liger", "cuda") is None and unavailable_reason("cce", "cuda") is None
    assert "Triton kernel for CUDA GPUs, not cpu" in unavailable_reason("cce", "cpu")
    assert unavailable_reason("cce_compile", "cpu") is None


def _tiny(preset: str):
    cfg = load_config(preset, objective="vanilla")
    ids = {"eos_token": 0, "pad_token": 1, "mask_token": 2}
    return build_model(cfg.model, vocab_size=300, objective="vanilla", special_ids=ids)


@pytest.mark.parametrize(
    ("preset", "impl", "needle"),
    [
        ("tiny-decoder", "liger", "vanilla_impl=liger"),  # no package, or no GPU on CPU runs
        ("tiny-encoder", "cce", "no bias argument"),  # BERT's decoder bias
    ],
)
def test_objective_refuses_an_unusable_kernel_at_setup(preset, impl, needle):
    if DEVICE == "cuda" and _skip_reason(impl) is None and preset == "tiny-decoder":
        pytest.skip("liger runs here")
    model = _tiny(preset)
    with pytest.raises(HLMError, match=needle):
        LMObjective(model, ObjectiveConfig(name="vanilla", vanilla_impl=impl))
    LMObjective(model, ObjectiveConfig(name="headless", vanilla_impl=impl))  # not used: fine


def test_vanilla_losses_dispatch_to_the_chosen_kernel(monkeypatch):
    import hlm_ray.cross_entropy as ce

    calls = []

    def spy(hidden, weight, bias, labels, *, impl, ignore_index, reduction):
        calls.append((impl, hidden.shape[0], ignore_index, reduction))
        return F.cross_entropy(F.linear(hidden, weight, bias), labels)

    monkeypatch.setattr(ce, "fused_linear_cross_entropy", spy)
    hidden = torch.randn(2, 5, 8)
    labels = torch.full((2, 5), -100)
    labels[0, 1], labels[1, 3] = 4, 7
    head = LMHead(transform=None, weight=torch.randn(10, 8), bias=None)
    vanilla_masked_loss(hidden, labels, head, vanilla_impl="cce")
    assert calls == [("cce", 2, -100, "mean")]  # the masked rows only


# ---- compiled CWT ----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["dedup", "plain"])
def test_compiled_cwt_equals_eager(variant):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 9, 16, generator=g) * 4
    ids = torch.randint(0, 20, (3, 9), generator=g)
    table = torch.randn(50, 16, generator=g)
    labels = torch.where(torch.rand(3, 9, generator=g) < 0.3, ids, -100)

    def run(fn, *args):
        h, t = hidden.clone().requires_grad_(), table.clone().requires_grad_()
        loss = fn(h, args[0], t, variant=variant).loss
        loss.backward()
        return loss.detach(), h.grad, t.grad

    for loss_fn, targets in [(headless_causal_loss, ids), (headless_masked_loss, labels)]:
        got, want = run(compiled(loss_fn), targets), run(loss_fn, targets)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("preset", "objective"),
    [("tiny-decoder", "vanilla"), ("tiny-decoder", "mixed"), ("tiny-encoder", "vanilla")],
)
def test_every_vanilla_loss_goes_through_the_chosen_kernel(preset, objective, monkeypatch):
    """Causal, masked and mixed: LMObjective hands the head to the kernel of vanilla_impl."""
    import hlm_ray.cross_entropy as ce
    import hlm_ray.train.lm_objective as lm

    calls = []

    def spy(hidden, weight, bias, labels, *, impl, ignore_index, reduction):
        calls.append((impl, bias is not None))
        return F.cross_entropy(F.linear(hidden.float(), weight.float(), bias), labels)

    monkeypatch.setattr(ce, "fused_linear_cross_entropy", spy)
    monkeypatch.setattr(lm, "check_vanilla_impl", lambda *a, **k: None)  # no package needed
    model = _tiny(preset)
    ids = torch.randint(5, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.arange(12) % 4 == 0, ids, -100) if preset == "tiny-encoder" else None
    torch_cfg = ObjectiveConfig(name=objective)
    want = LMObjective(model, torch_cfg)(ids, labels)["loss"].loss
    got = LMObjective(model, ObjectiveConfig(name=objective, vanilla_impl="liger"))(ids, labels)
    assert calls == [("liger", preset == "tiny-encoder")]  # BERT's decoder bias is passed on
    torch.testing.assert_close(got["loss"].loss, want)


def test_cce_compile_in_the_objective_equals_torch():
    """A whole vanilla decoder forward + backward through Cut Cross-Entropy's compile path."""
    if reason := _skip_reason("cce_compile"):
        pytest.skip(reason)
    model = _tiny("tiny-decoder")
    ids = torch.randint(5, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    grads = []
    for impl in ("torch", "cce_compile"):
        model.zero_grad()
        out = LMObjective(model, ObjectiveConfig(name="vanilla", vanilla_impl=impl))(ids)
        out["loss"].loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
