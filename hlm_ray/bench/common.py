"""What every benchmark shares: timing with spread, peak memory, and the environment record.

    times_s = [timed(fn, device) for _ in range(5)]
    stats = spread(times_s)                  # {"median": ..., "p25": ..., "p75": ..., "min", "max"}
    peak = peak_bytes(fn, device)           # bytes allocated by fn above what existed before
    env = environment(device)               # device, versions, cores, load average

Peak memory, what it measures
-----------------------------
On CUDA: `torch.cuda.max_memory_allocated` during the call, less what was allocated before it
(the caching allocator's view: tensors only, no fragmentation).
On CPU there is no allocator statistic, so `LiveTensorBytes` (a `TorchDispatchMode`) counts it:
every storage an aten op returns that did not exist before is added when it appears and removed
when it is freed (a weak reference on the storage). The figure is the peak of those live bytes:
activations, logits, gradients, optimizer temporaries — what `max_memory_allocated` would say on a
GPU. It does not see memory allocated outside aten ops (oneDNN scratch, Python objects), nor
what `torch.compile`d kernels allocate internally, and the process's RSS can be higher
(allocator caching). The dispatch mode slows ops down, so memory is measured in a separate,
untimed call.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall seconds of one call, with the device drained before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def spread(samples: list[float]) -> dict[str, float]:
    """Median and spread (quartiles, extremes) of a list of timings."""
    xs = sorted(samples)
    if len(xs) >= 2:
        p25, _, p75 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        p25 = p75 = xs[0]
    return {
        "median": statistics.median(xs),
        "p25": p25,
        "p75": p75,
        "min": xs[0],
        "max": xs[-1],
    }


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of tensor storage created by aten ops while active (see module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._known: WeakIdKeyDictionary = WeakIdKeyDictionary()

    @staticmethod
    def _storages(t: torch.Tensor) -> list:
        if t.is_sparse:
            return [t._indices().untyped_storage(), t._values().untyped_storage()]
        if t.layout != torch.strided or t.device.type == "meta":
            return []
        return [t.untyped_storage()]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):  # inputs (and views of them) are not new memory
            if isinstance(t, torch.Tensor):
                for st in self._storages(t):
                    if st not in self._known:
                        self._known[st] = False
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for st in self._storages(t):
                    if st not in self._known:
                        self._add(st)
        return out

    def _add(self, storage) -> None:
        n = storage.nbytes()
        self._known[storage] = True
        weakref.finalize(storage, self._free, n)
        self.live += n
        self.peak = max(self.peak, self.live)

    def _free(self, n: int) -> None:
        self.live -= n


def peak_bytes(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Peak bytes allocated during `fn()` above those live before it (None if not measurable)."""
    if device.type == "cuda":
        synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu":
        return None
    tracker = LiveTensorBytes()
    with tracker:
        result = fn()
    del result
    return tracker.peak


def tensor_bytes(tensors) -> int:
    """Bytes of distinct tensors (parameters, optimizer state), sparse ones included."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        if t.is_sparse:
            total += t._values().nbytes + t._indices().nbytes
        else:
            total += t.nbytes
    return total


def environment(device: torch.device) -> dict[str, Any]:
    """Where and with what the numbers were taken (recorded with every result)."""
    import transformers

    env: dict[str, Any] = {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    with contextlib.suppress(ImportError):
        import ray

        env["ray"] = ray.__version__
    with contextlib.suppress(OSError, AttributeError):
        env["load_average"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with contextlib.suppress(OSError):
        models = [
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ]
        if models:
            env["cpu_model"] = models[0]
    return env


def plain_cross_entropy(
    hidden_ND: torch.Tensor, weight_VD: torch.Tensor, bias_V: torch.Tensor | None, labels_N
) -> torch.Tensor:
    """Linear + cross-entropy with float32 logits, written plainly for `torch.compile`."""
    bias = None if bias_V is None else bias_V.float()
    return F.cross_entropy(F.linear(hidden_ND.float(), weight_VD.float(), bias), labels_N)


_COMPILED: dict[str, Callable] = {}


def compiled_cross_entropy() -> Callable:
    """`plain_cross_entropy` through torch.compile with dynamic shapes: compiled on first call,
    once per process for every (N, V) it then sees (the benchmarks share it)."""
    if "ce" not in _COMPILED:
        _COMPILED["ce"] = torch.compile(plain_cross_entropy, dynamic=True)
    return _COMPILED["ce"]


class NoHeadObjective(torch.nn.Module):
    """A training step with no loss head at all: the body's hidden states, a loss that costs
    nothing beside them (their mean square, so that backward reaches every body weight), the
    same embedding table and optimizer. What a headless step is measured against: its loss
    head's whole cost is the difference. Returns what `LMObjective` returns."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids_BL, labels_BL=None, **_):
        from hlm_ray.models import hidden_states
        from hlm_ray.objectives import LossOutput

        hidden_BLD = hidden_states(self.model, input_ids_BL)
        loss = hidden_BLD.float().pow(2).mean()
        return {"loss": LossOutput(loss=loss, num_rows=input_ids_BL.numel())}
