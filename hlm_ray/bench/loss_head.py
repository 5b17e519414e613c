"""Loss-head micro-benchmark: forward + backward of the loss alone, CWT against cross-entropy.

    rows = run_loss_head(get_bench_preset("cpu").loss_head, torch.device("cpu"))

For K target rows of width D and a vocabulary of V: predictions O (K×D) and a table W (V×D),
both trained, and K target ids drawn uniformly from the vocabulary. Each method computes the
loss and the gradients of O and W (`torch.autograd.grad`):

    cwt_plain     CWT against the K gathered target rows (K×K logits)        6·K·K·D FLOPs
    cwt_dedup     CWT against the U ≤ min(K, V) distinct ids (K×U logits)    6·K·U·D
    cwt_chunked   cwt_dedup in row chunks (`chunk_rows` × U logits at once; recomputed backward)
    ce_full       cross-entropy over full K×V logits                           6·K·V·D
    ce_chunked    the same in row chunks (`chunk_rows` × V logits at once)
    ce_linear     torch's fused `F.linear_cross_entropy` in `chunk_rows` rows a chunk
    ce_compiled   `torch.compile`d linear + cross-entropy (dynamic shapes: compiled once)
    ce_liger      Liger Kernel's fused linear cross-entropy (Triton, CUDA only)
    ce_cce        Cut Cross-Entropy's kernel: logits only in on-chip memory (Triton, CUDA only)
    ce_cce_compile  Cut Cross-Entropy's torch.compile path (any device)

The fused kernels come from the optional `gpu` extra (`hlm_ray.fused_ce`); where one cannot run
(not installed, no GPU) its rows say why instead of a time.

CWT reads W through `F.embedding(..., sparse=True)`: its table gradient holds U rows (the lazy
embedding update's path); cross-entropy's W gradient is necessarily dense V×D. FLOPs are model
FLOPs (3 × the forward matmul; recomputation not counted). CWT costs K/V of cross-entropy
(U/V de-duplicated), so the two cross at K ≈ V: every preset puts K on both sides of V.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from hlm_ray.bench.common import compiled_cross_entropy, peak_bytes, spread, timed
from hlm_ray.bench.presets import LossHeadSpec
from hlm_ray.fused_ce import unavailable_reason
from hlm_ray.objectives import cross_entropy_head, cwt_loss_from_ids

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# What each materialises (CCE's torch.compile path computes e @ c.T, then cross-entropy).
FULL_MATRIX = {"cwt_plain": "K", "ce_full": "V", "ce_compiled": "V", "ce_cce_compile": "V"}
FUSED = {"ce_liger": "liger", "ce_cce": "cce", "ce_cce_compile": "cce_compile"}
# Compiled code allocates outside torch's dispatcher: no CPU peak for these.
COMPILED = ("ce_compiled", "ce_cce_compile")


def _method(name: str, chunk_rows: int, compiled: Callable | None) -> Callable:
    """fn(pred_KD, table_VD, ids_K) -> scalar loss."""
    if name == "cwt_plain":
        return lambda o, w, y: cwt_loss_from_ids(o, y, w, variant="plain", sparse_grad=True)
    if name == "cwt_dedup":
        return lambda o, w, y: cwt_loss_from_ids(o, y, w, variant="dedup", sparse_grad=True)
    if name == "cwt_chunked":
        return lambda o, w, y: cwt_loss_from_ids(
            o, y, w, variant="dedup", chunk_size=chunk_rows, sparse_grad=True
        )
    if name == "ce_full":
        return lambda o, w, y: cross_entropy_head(o, w, None, y, impl="full")
    if name == "ce_chunked":
        return lambda o, w, y: cross_entropy_head(
            o, w, None, y, impl="chunked", chunk_size=chunk_rows
        )
    if name == "ce_linear":
        return lambda o, w, y: cross_entropy_head(
            o, w, None, y, impl="linear", chunk_size=chunk_rows
        )
    if name == "ce_compiled":
        assert compiled is not None
        return compiled
    if name in FUSED:
        return lambda o, w, y: cross_entropy_head(o, w, None, y, vanilla_impl=FUSED[name])
    raise ValueError(f"unknown loss-head method {name!r}")


class _Compiler:
    """Compiles the cross-entropy once (dynamic shapes) and remembers why if it cannot."""

    def __init__(self, device: torch.device, dtype: torch.dtype, dim: int):
        self.fn: Callable | None = None
        self.reason = ""
        self.seconds = 0.0
        start = time.perf_counter()
        try:
            compiled = compiled_cross_entropy()

            def fn(o, w, y):
                return compiled(o, w, None, y)

            o = torch.randn(8, dim, device=device, dtype=dtype, requires_grad=True)
            w = torch.randn(16, dim, device=device, dtype=dtype, requires_grad=True)
            y = torch.randint(0, 16, (8,), device=device)
            torch.autograd.grad(fn(o, w, y), [o, w])
            self.fn = fn
        except Exception as err:  # any compiler failure: report it, measure the rest
            self.reason = f"torch.compile failed: {type(err).__name__}: {str(err).splitlines()[0]}"
        self.seconds = time.perf_counter() - start


def _inputs(K: int, V: int, D: int, dtype: torch.dtype, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    pred = torch.randn(K, D, generator=gen).to(device, dtype).requires_grad_()
    table = (torch.randn(V, D, generator=gen) / D**0.5).to(device, dtype).requires_grad_()
    ids = torch.randint(0, V, (K,), generator=gen).to(device)
    return pred, table, ids


def head_flops(method: str, K: int, V: int, U: int, D: int) -> float:
    """Model FLOPs of the head's forward + backward (3 × the logits matmul)."""
    cols = {"cwt_plain": K, "cwt_dedup": U, "cwt_chunked": U}.get(method, V)
    return 6.0 * K * cols * D


def run_loss_head(
    spec: LossHeadSpec, device: torch.device, *, progress: bool = True, log=print
) -> list[dict]:
    """One row per (sweep, K, V, method); see the module docstring."""
    dtype = DTYPES[spec.dtype]
    compiler = None
    if "ce_compiled" in spec.methods and spec.compile:
        compiler = _Compiler(device, dtype, spec.dim)
        note = compiler.reason or f"compiled in {compiler.seconds:.1f}s"
        log(f"loss head: torch.compile'd cross-entropy: {note}")
    cache: dict[tuple[int, int, str], dict] = {}
    rows: list[dict] = []
    total = sum(len(s.values) for s in spec.sweeps)
    bar = tqdm(total=total, desc="loss head", disable=not progress, dynamic_ncols=True)
    for index, sweep in enumerate(spec.sweeps):
        name = f"{sweep.over}@{'K' if sweep.over == 'V' else 'V'}={sweep.fixed}"
        previous: dict[str, tuple[float, float, str]] = {}  # method -> (s, FLOPs, where)
        for K, V in sweep.cells():
            pred, table, ids = _inputs(K, V, spec.dim, dtype, device, seed=K * 7919 + V)
            U = int(torch.unique(ids).numel())
            results: dict[str, dict] = {}
            todo = []
            for method in spec.methods:
                if (K, V, method) in cache:  # the same cell in another sweep
                    results[method] = cache[(K, V, method)]
                    continue
                flops = head_flops(method, K, V, U, spec.dim)
                reason = _skip_reason(
                    spec, method, K, V, flops, compiler, previous.get(method), device
                )
                if reason:
                    results[method] = _skipped(reason)
                else:
                    todo.append(method)
            results.update(_measure_cell(spec, todo, pred, table, ids, device, compiler))
            for method in todo:
                cache[(K, V, method)] = results[method]
                if results[method]["status"] == "ok":
                    flops = head_flops(method, K, V, U, spec.dim)
                    previous[method] = (results[method]["time_ms"] / 1e3, flops, f"K={K}, V={V}")
            for method in spec.methods:
                flops = head_flops(method, K, V, U, spec.dim)
                r = results[method]
                rows.append(
                    {
                        "sweep": name,
                        "sweep_index": index,
                        "method": method,
                        "K": K,
                        "V": V,
                        "D": spec.dim,
                        "U": U if method in ("cwt_dedup", "cwt_chunked") else None,
                        "dtype": spec.dtype,
                        "device": device.type,
                        "gflop": flops / 1e9,
                        **r,
                        "gflops_per_s": flops / 1e9 / (r["time_ms"] / 1e3)
                        if r["status"] == "ok"
                        else None,
                    }
                )
            bar.update(1)
            times = ", ".join(
                f"{m} {results[m]['time_ms']:.1f}"
                for m in spec.methods
                if results[m]["status"] == "ok"
            )
            log(f"  {name} K={K} V={V} U={U}: {times} ms")
            del pred, table, ids
    bar.close()
    return rows


def _skip_reason(spec, method, K, V, flops, compiler, previous, device) -> str:
    if method == "ce_compiled" and (compiler is None or compiler.fn is None):
        return compiler.reason if compiler else "compile disabled in this preset"
    if method in FUSED:
        if method in COMPILED and not spec.compile:
            return "compile disabled in this preset"
        reason = unavailable_reason(FUSED[method], device.type)
        if reason:
            return reason
    full = FULL_MATRIX.get(method)
    if full is not None:
        gb = K * (K if full == "K" else V) * 4 / 1e9
        if gb > spec.max_logits_gb:
            return f"a full {gb:.1f} GB logits matrix > {spec.max_logits_gb:g} GB"
    if previous is not None:
        seconds, prev_flops, where = previous
        predicted = seconds * flops / prev_flops
        if predicted > spec.budget_s:
            return (
                f"predicted {predicted:.1f}s per call (from {seconds:.2f}s at {where}, scaled by "
                f"FLOPs) > budget {spec.budget_s:g}s"
            )
    return ""


def _measure_cell(spec, methods, pred, table, ids, device, compiler) -> dict[str, dict]:
    """Warm every method up, then time them in alternation (A B C A B C ...), then measure
    each one's peak memory in one more, untimed call."""
    calls, out = {}, {}
    for method in methods:
        fn = _method(method, spec.chunk_rows, compiler.fn if compiler else None)
        calls[method] = lambda fn=fn: torch.autograd.grad(fn(pred, table, ids), [pred, table])
    times: dict[str, list[float]] = {m: [] for m in methods}

    def attempt(method, action) -> None:
        if method in out:  # failed before
            return
        try:
            action()
        except (RuntimeError, MemoryError) as err:  # out of memory, an unsupported op
            out[method] = _skipped(f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")

    for method in methods:
        for _ in range(spec.warmup):
            attempt(method, calls[method])
    for _ in range(spec.repeats):
        for method in methods:
            attempt(method, lambda m=method: times[m].append(timed(calls[m], device)))
    for method in methods:
        if method in out:
            continue
        peak = None
        if method not in COMPILED or device.type == "cuda":  # see COMPILED
            peak = peak_bytes(calls[method], device)
        stats = spread(times[method])
        out[method] = {
            "status": "ok",
            "time_ms": stats["median"] * 1e3,
            "time_ms_p25": stats["p25"] * 1e3,
            "time_ms_p75": stats["p75"] * 1e3,
            "time_ms_min": stats["min"] * 1e3,
            "time_ms_max": stats["max"] * 1e3,
            "peak_mb": None if peak is None else peak / 2**20,
            "note": "peak memory not measurable inside compiled kernels" if peak is None else "",
        }
    return out


def _skipped(reason: str) -> dict:
    return {
        "status": "skipped",
        "time_ms": None,
        "time_ms_p25": None,
        "time_ms_p75": None,
        "time_ms_min": None,
        "time_ms_max": None,
        "peak_mb": None,
        "note": reason,
    }
