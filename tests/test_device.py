"""The one device-and-autocast helper, and float32 logits under autocast for both objectives."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from hlm_ray import device as dev
from hlm_ray.errors import HLMError
from hlm_ray.objectives import cross_entropy_head, cwt_loss, cwt_loss_from_ids


def test_auto_is_cpu_without_a_gpu(monkeypatch) -> None:
    monkeypatch.setattr(dev, "cuda_available", lambda: False)
    assert dev.resolve_device("auto") == torch.device("cpu")
    assert dev.device_name("auto") == "cpu"
    with pytest.raises(HLMError, match="run.device=cuda but no CUDA GPU"):
        dev.resolve_device("cuda", option="run.device")
    with pytest.raises(HLMError, match="cuda:1"):
        dev.resolve_device("cuda:1")


def test_auto_is_cuda_with_a_gpu(monkeypatch) -> None:
    monkeypatch.setattr(dev, "cuda_available", lambda: True)
    assert dev.resolve_device("auto") == torch.device("cuda")
    assert dev.resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(HLMError, match="use one of auto, cpu, cuda"):
        dev.resolve_device("tpu")


def test_autocast_dtype() -> None:
    cpu = torch.device("cpu")
    assert dev.autocast_dtype("auto", cpu) is None  # CPU bf16 only when asked for
    assert dev.autocast_dtype("bf16", cpu) is torch.bfloat16
    assert dev.autocast_dtype("fp16", cpu) is torch.float16
    assert dev.autocast_dtype("fp32", cpu) is None
    with pytest.raises(HLMError, match="precision"):
        dev.autocast_dtype("int8", cpu)
    with dev.autocast(cpu, None):
        assert not torch.is_autocast_enabled("cpu")
    with dev.autocast(cpu, torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")
        with dev.float32_region("cpu"):
            x = torch.randn(4, 4)
            assert (x @ x).dtype == torch.float32


def test_no_copies_of_device_resolution_left() -> None:
    """Every stage resolves devices through hlm_ray.device (one definition of "auto")."""
    from pathlib import Path

    import hlm_ray

    root = Path(hlm_ray.__file__).parent
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name != "device.py"
        and (
            '"cuda" if torch.cuda.is_available()' in p.read_text()
            or "def resolve_device" in p.read_text()
        )
    ]
    assert offenders == []


def _extreme(K=48, D=16, V=40, scale=60.0):
    g = torch.Generator().manual_seed(0)
    # |logit| up to ~scale² · D / 10: about 1,600 here, where bf16 logits lose ~0.02 of loss.
    pred = torch.randn(K, D, generator=g) * scale / 3
    table = torch.randn(V, D, generator=g) * scale / 3
    ids = torch.randint(0, V, (K,), generator=g)
    return pred, table, ids


@pytest.mark.parametrize("variant", ["plain", "dedup", "mask_same"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_cwt_logits_are_float32_under_bf16_autocast(variant: str, chunk) -> None:
    pred, table, ids = _extreme()
    assert ((pred @ table.T).abs().max() > 1000).item()
    ref = cwt_loss_from_ids(pred.double(), ids, table.double(), variant=variant, chunk_size=chunk)
    fp32 = cwt_loss_from_ids(pred, ids, table, variant=variant, chunk_size=chunk)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp = cwt_loss_from_ids(pred, ids, table, variant=variant, chunk_size=chunk)
    assert amp.dtype == torch.float32
    assert_close(amp, fp32, rtol=0, atol=0)  # the same float32 computation
    assert abs(amp.item() - ref.item()) < 1e-3 * max(1.0, abs(ref.item()))


def test_cwt_loss_float32_under_autocast_with_gradients() -> None:
    pred, table, _ = _extreme(K=20, V=20)
    targets = table[:20]
    p1, t1 = pred.clone().requires_grad_(), targets.clone().requires_grad_()
    p2, t2 = pred.clone().requires_grad_(), targets.clone().requires_grad_()
    cwt_loss(p1, t1).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cwt_loss(p2, t2)
    loss.backward()
    assert_close(p2.grad, p1.grad)
    assert_close(t2.grad, t1.grad)


@pytest.mark.parametrize("impl", ["full", "chunked", "linear"])
def test_cross_entropy_logits_are_float32_under_bf16_autocast(impl: str) -> None:
    hidden, weight, labels = _extreme(K=48, D=16, V=40)
    ref = F.cross_entropy(F.linear(hidden.double(), weight.double()), labels)
    fp32 = cross_entropy_head(hidden, weight, None, labels, impl=impl, chunk_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp = cross_entropy_head(hidden, weight, None, labels, impl=impl, chunk_size=16)
    assert amp.dtype == torch.float32
    assert_close(amp, fp32)
    assert abs(amp.item() - ref.item()) < 1e-3 * max(1.0, abs(ref.item()))


def test_linear_arm_uses_explicit_chunks(monkeypatch) -> None:
    """impl="linear" passes its chunk size to torch (not the per-device heuristic)."""
    seen = {}
    real = F.linear_cross_entropy

    def spy(*args, options=None, **kwargs):
        seen["options"] = options
        return real(*args, options=options, **kwargs)

    monkeypatch.setattr(F, "linear_cross_entropy", spy)
    hidden, weight, labels = torch.randn(64, 8), torch.randn(50, 8), torch.randint(0, 50, (64,))
    loss = cross_entropy_head(hidden, weight, None, labels, impl="linear", chunk_size=16)
    assert seen["options"].batch_chunk_size == 16
    assert seen["options"].chunking_method is None
    assert_close(loss, F.cross_entropy(F.linear(hidden, weight), labels))


def test_gpu_check_table():
    from hlm_ray.gpu_check import Row, format_table

    table = format_table([Row("train", "PASS", "loss 6.9→5.1", 12.3)], "cuda:0 (H100)")
    assert "| train | PASS | loss 6.9→5.1 | 12 |" in table and "cuda:0 (H100)" in table


# ------------------------------------------------------------------------- on a CUDA GPU only

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_auto_resolves_to_the_gpu_and_bf16() -> None:
    device = dev.resolve_device("auto")
    assert device.type == "cuda"
    assert dev.autocast_dtype("auto", device) is torch.bfloat16


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("impl", ["full", "chunked", "linear"])
def test_float32_logits_under_cuda_bf16_autocast(impl: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    pred, table, ids = (t.cuda() for t in _extreme(K=256, D=64, V=512))
    ref = cwt_loss_from_ids(pred.double(), ids, table.double())
    ce_ref = F.cross_entropy(F.linear(pred.double(), table.double()), ids)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cwt = cwt_loss_from_ids(pred, ids, table)
        ce = cross_entropy_head(pred, table, None, ids, impl=impl, chunk_size=64)
    assert cwt.dtype == ce.dtype == torch.float32
    assert abs(cwt.item() - ref.item()) < 1e-3 * max(1.0, abs(ref.item()))
    assert abs(ce.item() - ce_ref.item()) < 1e-3 * max(1.0, abs(ce_ref.item()))
