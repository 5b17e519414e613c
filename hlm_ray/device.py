"""The one place that turns a device name and a precision into a torch device and autocast.

    device = resolve_device("auto")              # cuda when this process sees a GPU, else cpu
    amp = autocast_dtype("auto", device)         # bf16 on a bf16-capable GPU, else None (fp32)
    with autocast(device, amp):
        loss = module(batch)

Every stage (train, fine-tune, classifiers, eval, serve, bench, the sweeps' downstream steps)
resolves its device here, so `--device auto` means the same thing everywhere. Inside a Ray
worker or trial that reserved a GPU, Ray sets CUDA_VISIBLE_DEVICES, so "auto" picks that GPU.
"""

from __future__ import annotations

import contextlib

import torch

from hlm_ray.errors import HLMError, TorchTooOld

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(name: str = "auto", *, option: str = "device") -> torch.device:
    """ "auto" -> cuda when visible, else cpu; "cuda" (or "cuda:N") without a GPU is an error
    naming ``option`` (the flag or config key the user set)."""
    if name == "auto":
        return torch.device("cuda" if cuda_available() else "cpu")
    if name.startswith("cuda") and not cuda_available():
        raise HLMError(f"{option}={name} but no CUDA GPU is visible; use {option}=cpu or auto")
    if not (name == "cpu" or name.startswith("cuda")):
        raise HLMError(f"{option}={name!r}; use one of {', '.join(DEVICES)}")
    return torch.device(name)


def device_name(name: str = "auto") -> str:
    """`resolve_device` as a string, for APIs and configs that take one."""
    return str(resolve_device(name))


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``precision``; None means plain float32.

    "auto": bf16 on a CUDA device that supports it, float32 otherwise (CPU bf16 is emulated
    and slow on most CPUs, so it is only used when asked for)."""
    if precision == "auto":
        ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if ok else None
    table = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if precision not in table:
        raise HLMError(f"precision={precision!r}; use one of {', '.join(PRECISIONS)}")
    return table[precision]


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast for ``dtype`` on ``device``; a no-op context for None (float32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def float32_region(device_type: str):
    """Turn autocast off for the enclosed ops, so that a matmul on float32 inputs stays float32.

    Used for the logits of both objectives: under bf16 autocast a `@` or `F.linear` would
    otherwise round float32 inputs to bf16 and return bf16 logits (a loss error of ~0.02 at
    |logit| ~ 1,600). A no-op when autocast is not active."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


def describe(device: torch.device) -> str:
    """ "cpu" or "cuda:0 (NVIDIA H100 80GB HBM3)": for logs and tables."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def require_torch_feature(owner, name: str, option: str, since: str) -> None:
    """Raise `TorchTooOld` naming `option` when `owner.name` (a torch API added in torch `since`)
    is missing: the core runs on older torch releases, that option does not."""
    if not hasattr(owner, name):
        raise TorchTooOld(
            f"{option} needs torch >= {since} ({owner.__name__}.{name}); this is torch "
            f"{torch.__version__}"
        )
