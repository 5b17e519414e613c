"""Training-step benchmark (paper Figures 3 and 7b): headless against vanilla on a real model.

    rows = run_train_step(get_bench_preset("cpu").train_step, torch.device("cpu"))

A step is what `train_worker` does per micro-batch, through the same code: `LMObjective`
forward, backward, `clip_grad_norm`, `build_optimizer`'s optimizer step, `zero_grad`. Inputs
are random token ids, uniform over the vocabulary (no tokenizer needed for V = 131k); encoders
get BERT masking (15%). The arms at each (model, V, micro-batch) point:

    headless/dense     CWT (dedup), AdamW over the whole embedding table: the faithful default
    headless/lazy      CWT, sparse embedding gradients + row-wise AdamW (optim.embedding_update)
    vanilla/<impl>     cross-entropy with each `vanilla_impls` implementation (full, chunked,
                       linear = F.linear_cross_entropy, compiled = torch.compile'd head,
                       liger / cce / cce_compile = the fused kernels of objective.vanilla_impl,
                       skipped with the reason where they cannot run);
                       GPT-NeoX's untied input table is lazy too (the strongest vanilla setup);
                       encoders: logits at masked positions only (the strong MLM baseline)
    vanilla/full-seq   encoders only: the head on every position, as the paper's baseline

The fastest vanilla/<impl> arm is the *strongest vanilla*. Arms are built once per point,
warmed up, then timed in alternation (A B C A B C ...) so that drift of a shared machine spreads
over all of them; each row reports the median step time with quartiles and extremes. Every row
carries the FLOP model's prediction (`hlm_ray.flops.step_flops`, U measured on the batches) so
measured ratios read against ideal ones: `flops_vs_headless` (this arm's FLOPs / headless FLOPs)
and `time_vs_headless` (this arm's step time / the faster headless arm's).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from hlm_ray.bench.common import (
    NoHeadObjective,
    compiled_cross_entropy,
    peak_bytes,
    spread,
    tensor_bytes,
    timed,
)
from hlm_ray.bench.presets import StepModel, TrainStepSpec
from hlm_ray.config import ModelConfig, ObjectiveConfig, OptimConfig
from hlm_ray.data import mask_tokens
from hlm_ray.device import autocast
from hlm_ray.errors import one_line
from hlm_ray.flops import device_peak_flops, mfu, rows_per_loss, step_flops
from hlm_ray.fused_ce import FUSED_IMPLS
from hlm_ray.models import body, build_model, lm_head
from hlm_ray.objectives import IGNORE_INDEX, LossOutput
from hlm_ray.train.lm_objective import LMObjective
from hlm_ray.train.optim import build_optimizer, clip_grad_norm

SPECIAL = {"eos_token": 0, "pad_token": 1, "mask_token": 2, "cls_token": 3, "sep_token": 4}
FIRST_ID = len(SPECIAL)  # random ids avoid the special tokens


@dataclass(frozen=True)
class Arm:
    name: str
    objective: str
    embedding_update: str = "dense"
    ce_impl: str = "full"
    mlm_full_logits: bool = False
    attn_impl: str = "sdpa"
    compile_blocks: bool = False

    @property
    def is_vanilla(self) -> bool:
        return self.objective == "vanilla"

    @property
    def competes(self) -> bool:
        """Candidate for the strongest vanilla (full-sequence MLM logits is the weak baseline)."""
        return self.is_vanilla and not self.mlm_full_logits and not self.compile_blocks


def arms_for(model: ModelConfig, spec: TrainStepSpec, vocab: int | None = None) -> list[Arm]:
    # The input table of a vanilla GPT-NeoX is untied from its head: it can be lazy too.
    vanilla_update = "lazy" if model.arch == "gpt_neox" else "dense"
    arms = [Arm("headless/dense", "headless"), Arm("headless/lazy", "headless", "lazy")]
    if vocab in spec.no_head_vocabs:  # the body alone: the limit of the loss head's cost
        arms.append(Arm("no-head/lazy", "none", "lazy"))
    arms += [Arm(f"vanilla/{impl}", "vanilla", vanilla_update, impl) for impl in spec.vanilla_impls]
    if model.family == "encoder":
        arms.append(Arm("vanilla/full-seq", "vanilla", vanilla_update, "full", True))
    for attn in spec.attn_impls[1:]:
        arms.append(Arm(f"headless/lazy+{attn}", "headless", "lazy", attn_impl=attn))
        arms.append(
            Arm(
                f"vanilla/{spec.vanilla_impls[0]}+{attn}",
                "vanilla",
                vanilla_update,
                spec.vanilla_impls[0],
                attn_impl=attn,
            )
        )
    if spec.compile_blocks:
        arms.append(Arm("headless/lazy+compile", "headless", "lazy", compile_blocks=True))
    return arms


class BuiltArm:
    """One arm's model, objective module and optimizer, ready to step."""

    def __init__(self, arm: Arm, sm: StepModel, vocab: int, device: torch.device):
        torch.manual_seed(0)  # the same initial weights in every arm of a point
        cfg = replace(sm.model, attn_impl=arm.attn_impl)
        built_as = "headless" if arm.objective == "none" else arm.objective  # the same model
        self.model = build_model(cfg, vocab_size=vocab, objective=built_as, special_ids=SPECIAL)
        self.model.to(device).train()
        if arm.compile_blocks:
            compile_blocks(self.model)
        compiled = arm.ce_impl == "compiled"
        fused = arm.ce_impl in FUSED_IMPLS  # LMObjective refuses one that cannot run here
        objective = ObjectiveConfig(
            name=arm.objective,
            ce_impl="full" if compiled or fused else arm.ce_impl,
            vanilla_impl=arm.ce_impl if fused else "torch",
            mlm_full_logits=arm.mlm_full_logits,
        )
        if arm.objective == "none":
            self.module = NoHeadObjective(self.model)
        else:
            self.module = (CompiledHeadObjective if compiled else LMObjective)(
                self.model, objective
            )
        optim = OptimConfig(lr=1e-4, weight_decay=0.01, embedding_update=arm.embedding_update)
        self.optimizer = build_optimizer(self.model, optim)

    def step(self, batch, amp: torch.dtype | None, device: torch.device) -> None:
        input_ids, labels = batch
        with autocast(device, amp):
            out = self.module(input_ids, labels)["loss"]
        out.loss.backward()
        clip_grad_norm(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def static_bytes(self) -> int:
        """Parameters and optimizer state (what lives between steps)."""
        state = [t for s in self.optimizer.state.values() for t in s.values()]
        return tensor_bytes([*self.model.parameters(), *state])


class CompiledHeadObjective(LMObjective):
    """Vanilla whose vocabulary head (linear + cross-entropy, float32 logits) goes through
    torch.compile: the `ce_compiled` of the loss-head benchmark inside a real step."""

    def _ce(self, hidden_BLD, input_ids_BL, labels_BL):
        head = lm_head(self.model)
        if self.causal:  # hidden[:, :-1] predicts input_ids[:, 1:]
            pred_KD = hidden_BLD[:, :-1].reshape(-1, hidden_BLD.shape[-1])
            ids_K = input_ids_BL[:, 1:].reshape(-1)
        elif self.cfg.mlm_full_logits:
            pred_KD, ids_K = hidden_BLD.flatten(0, 1), labels_BL.reshape(-1)
        else:
            masked_BL = labels_BL != IGNORE_INDEX
            pred_KD, ids_K = hidden_BLD[masked_BL], labels_BL[masked_BL]
        loss = compiled_cross_entropy()(head.features(pred_KD), head.weight, head.bias, ids_K)
        return LossOutput(loss=loss, num_rows=len(ids_K))


def compile_blocks(model) -> None:
    """torch.compile each transformer block in place (embedding look-up and loss stay eager:
    sparse gradients and data-dependent shapes do not go through the compiler)."""
    root = body(model)
    for path in ("layers", "h", "encoder.layer", "transformer.layer"):
        blocks = root
        with contextlib.suppress(AttributeError):
            for part in path.split("."):
                blocks = getattr(blocks, part)
            if isinstance(blocks, torch.nn.ModuleList):
                for block in blocks:
                    block.compile()
                return
    raise ValueError(f"no transformer blocks found in {type(model).__name__}")


def make_batches(
    sm: StepModel, vocab: int, micro_batch: int, n: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(vocab * 31 + micro_batch)
    batches = []
    for _ in range(n):
        ids = torch.randint(FIRST_ID, vocab, (micro_batch, sm.seq_len), generator=gen)
        labels = None
        if sm.model.family == "encoder":
            ids, labels = mask_tokens(
                ids,
                mask_id=SPECIAL["mask_token"],
                special_ids=sorted(SPECIAL.values()),
                vocab_size=vocab,
                generator=gen,
            )
            labels = labels.to(device)
        batches.append((ids.to(device), labels))
    return batches


def _targets(batches) -> tuple[int, int]:
    """Mean number of target rows K and of distinct target ids U over the batches."""
    targets = [LMObjective.target_ids(ids, labels) for ids, labels in batches]
    K = sum(t.numel() for t in targets) / len(targets)
    U = sum(int(torch.unique(t).numel()) for t in targets) / len(targets)
    return round(K), round(U)


def _flops(sm: StepModel, arm: Arm, vocab: int, micro_batch: int, K: int, U: int, device):
    # Flash / memory-efficient causal kernels skip the masked half of the attention square.
    causal = 0.5 if device.type == "cuda" and sm.model.family == "decoder" else 1.0
    # The FLOP model's K for an encoder is the expected masked count round(p·B·L): scale the
    # measured distinct ids to it (the batches' own K differs by sampling noise).
    model_K = rows_per_loss(sm.model.family, micro_batch, sm.seq_len)
    U = max(1, min(model_K, round(U * model_K / K)))
    objective = "headless" if arm.objective == "none" else arm.objective  # no head: its body
    flops = step_flops(
        sm.model,
        vocab_size=vocab,
        objective=objective,
        micro_batch=micro_batch,
        seq_len=sm.seq_len,
        mlm_full_logits=arm.mlm_full_logits,
        unique_columns=U if objective == "headless" else None,
        causal_attention_factor=causal,
    )
    return replace(flops, head=0.0) if arm.objective == "none" else flops


def run_train_step(
    spec: TrainStepSpec,
    device: torch.device,
    *,
    flat_points: dict[str, tuple[int, int]] | None = None,
    progress: bool = True,
    log=print,
) -> list[dict]:
    """Rows of every (model, V, micro-batch) point ("experiment" = "points"), then of the
    flat-in-V comparisons ("flat-in-V": headless at the smallest and largest V of `flat_points`,
    timed in alternation with each other, so the ratio is not at the mercy of machine drift
    between two points)."""
    amp = torch.bfloat16 if spec.precision == "bf16" else None
    peak_flops = device_peak_flops() if device.type == "cuda" else None
    rows: list[dict] = []
    for sm in spec.models:
        dropped: dict[str, str] = {}  # vanilla arms slower than the reference impl somewhere
        points = sorted(sm.points, key=lambda p: (p[1] != sm.points[0][1], p[0]))
        for vocab, micro_batch in points:
            point = _run_point(
                sm, vocab, micro_batch, spec, device, amp, peak_flops, dropped, progress
            )
            rows += point
            for line in _point_lines(point):
                log(line)
    for name, (small, large) in (flat_points or {}).items():
        sm = next((m for m in spec.models if m.name == name), None)
        if sm is not None:
            flat = _run_flat(sm, small, large, spec, device, amp, peak_flops, progress)
            rows += flat
            for line in _point_lines(flat):
                log(line)
    return rows


def _base(sm: StepModel, vocab: int, micro_batch: int, spec: TrainStepSpec, device) -> dict:
    return {
        "experiment": "points",
        "model": sm.name,
        "family": sm.model.family,
        "arch": sm.model.arch,
        "V": vocab,
        "micro_batch": micro_batch,
        "seq_len": sm.seq_len,
        "tokens": micro_batch * sm.seq_len,
        "precision": spec.precision,
        "device": device.type,
    }


def _run_point(sm, vocab, micro_batch, spec, device, amp, peak_flops, dropped, progress):
    arms = arms_for(sm.model, spec, vocab)
    batches = make_batches(sm, vocab, micro_batch, spec.batches, device)
    K, U = _targets(batches)
    entries = [(arm.name, arm, vocab, batches) for arm in arms if arm.name not in dropped]
    desc = f"{sm.name} V={vocab} B={micro_batch}"
    results = alternate(entries, sm, spec, device, amp, progress, desc)
    for name, note in dropped.items():
        results[name] = {"status": "skipped", "note": note}
    base = _base(sm, vocab, micro_batch, spec, device)
    return _rows(
        arms, results, base, sm, vocab, micro_batch, K, U, device, peak_flops, spec, dropped
    )


def _run_flat(sm, small, large, spec, device, amp, peak_flops, progress) -> list[dict]:
    micro_batch = sm.points[0][1]
    arms = [a for a in arms_for(sm.model, spec) if a.name in ("headless/lazy", "headless/dense")]
    batches = {v: make_batches(sm, v, micro_batch, spec.batches, device) for v in (small, large)}
    entries = [(f"{a.name}@{v}", a, v, batches[v]) for a in arms for v in (small, large)]
    flat_spec = replace(spec, repeats=spec.flat_repeats)
    results = alternate(entries, sm, flat_spec, device, amp, progress, f"{sm.name} flat in V")
    rows = []
    for label, arm, vocab, _ in entries:
        r = results[label]
        K, U = _targets(batches[vocab])
        f = _flops(sm, arm, vocab, micro_batch, K, U, device)
        row = {
            **_base(sm, vocab, micro_batch, spec, device),
            "experiment": "flat-in-V",
            "arm": arm.name,
            "objective": arm.objective,
            "embedding_update": arm.embedding_update,
            "mlm_full_logits": False,
            "attn_impl": arm.attn_impl,
            "K": f.target_rows,
            "U": U,
            "gflop_per_step": f.total / 1e9,
            "head_share": f.head_share,
            "flops_vs_headless": 1.0,
            "strongest_vanilla": False,
            "status": r["status"],
            "note": r.get("note", ""),
        }
        if r["status"] == "ok":
            row.update(_timing_fields(r, row["tokens"], f.total, peak_flops))
            row["time_vs_headless"] = None
        rows.append(row)
    return rows


def alternate(entries, sm, spec, device, amp, progress, desc) -> dict[str, dict]:
    """Build and warm up every entry (label, arm, vocab, batches), time them in alternation
    (A B C A B C ...; one more round if a spread is wide), then one untimed step each for
    peak memory. Returns {label: {"status", "times", "peak_mb"} or {"status", "note"}}."""
    built: dict[str, tuple[BuiltArm, list]] = {}
    results: dict[str, dict] = {}
    steps = spec.warmup + spec.repeats * (1 + spec.extra_rounds) + 1
    bar = tqdm(total=len(entries) * steps, desc=desc, disable=not progress, leave=False)
    gc.collect()
    gc.disable()  # no collector pauses inside timed steps
    try:
        for label, arm, vocab, batches in entries:  # build and warm up every arm first
            try:
                b = BuiltArm(arm, sm, vocab, device)
                xs = [batches[i % len(batches)] for i in range(spec.warmup)]
                warm = [timed(lambda b=b, x=x: b.step(x, amp, device), device) for x in xs]
            except Exception as err:  # a backend that is missing, a compile failure, OOM
                results[label] = {
                    "status": "skipped",
                    "note": one_line(err, with_type=True, limit=200),
                }
                continue
            finally:
                bar.update(spec.warmup)
            if warm and warm[-1] > spec.max_step_s:
                note = f"a warm-up step took {warm[-1]:.1f}s > {spec.max_step_s:g}s"
                results[label] = {"status": "skipped", "note": note}
                continue
            built[label] = (b, batches)
            results[label] = {"status": "ok", "times": []}
        for round_ in range(1 + spec.extra_rounds):
            if round_ and not _noisy(results, spec.max_iqr):
                break
            for r in range(spec.repeats):  # alternate: A B C A B C ...
                for label, (b, batches) in built.items():
                    x = batches[(spec.warmup + r) % len(batches)]
                    results[label]["times"].append(
                        timed(lambda b=b, x=x: b.step(x, amp, device), device)
                    )
                    bar.update(1)
        for label, (b, batches) in built.items():  # peak memory: one more, untimed step
            transient = peak_bytes(lambda b=b, x=batches[0]: b.step(x, amp, device), device)
            results[label]["peak_mb"] = (
                None if transient is None else (b.static_bytes() + transient) / 2**20
            )
            bar.update(1)
    finally:
        gc.enable()
        bar.close()
        built.clear()  # the next point's gc.collect() reclaims any cycles
    return results


def _noisy(results: dict[str, dict], max_iqr: float) -> bool:
    """Whether some arm's interquartile range exceeds max_iqr × its median."""
    for r in results.values():
        if r["status"] == "ok" and r["times"]:
            s = spread(r["times"])
            if (s["p75"] - s["p25"]) > max_iqr * s["median"]:
                return True
    return False


def _timing_fields(r: dict, tokens: int, flops: float, peak_flops) -> dict:
    s = spread(r["times"])
    return {
        "step_ms": s["median"] * 1e3,
        "step_ms_p25": s["p25"] * 1e3,
        "step_ms_p75": s["p75"] * 1e3,
        "step_ms_min": s["min"] * 1e3,
        "step_ms_max": s["max"] * 1e3,
        "repeats": len(r["times"]),
        "tokens_per_s": tokens / s["median"],
        "peak_mb": r.get("peak_mb"),
        "mfu": mfu(flops / s["median"], peak_flops),
    }


def _rows(arms, results, base, sm, vocab, micro_batch, K, U, device, peak_flops, spec, dropped):
    flops = {arm.name: _flops(sm, arm, vocab, micro_batch, K, U, device) for arm in arms}
    medians = {
        name: spread(r["times"])["median"] for name, r in results.items() if r["status"] == "ok"
    }
    headless = [n for n in medians if n.startswith("headless/") and "+" not in n]
    best_headless = min(headless, key=medians.get) if headless else None
    competing = [a.name for a in arms if a.competes and a.name in medians]
    strongest = min(competing, key=medians.get) if competing else None
    headless_flops = flops["headless/lazy"].total
    rows = []
    for arm in arms:
        r, f = results[arm.name], flops[arm.name]
        row = {
            **base,
            "arm": arm.name,
            "objective": arm.objective,
            "embedding_update": arm.embedding_update,
            "ce_impl": arm.ce_impl if arm.is_vanilla else None,
            "mlm_full_logits": arm.mlm_full_logits,
            "attn_impl": arm.attn_impl,
            "K": f.target_rows,
            "U": U if arm.objective == "headless" else None,
            "gflop_per_step": f.total / 1e9,
            "head_share": f.head_share,
            "flops_vs_headless": f.total / headless_flops,
            "strongest_vanilla": arm.name == strongest,
            "status": r["status"],
            "note": r.get("note", ""),
        }
        if r["status"] == "ok":
            row.update(_timing_fields(r, base["tokens"], f.total, peak_flops))
            row["time_vs_headless"] = (
                medians[arm.name] / medians[best_headless] if best_headless else None
            )
        rows.append(row)
    # A vanilla impl much slower than the fastest one here is not run at this model's later
    # points (larger V): it cannot become the strongest baseline there, and it would eat the
    # budget (F.linear_cross_entropy's CPU chunking grows steeply with V). The reference impl
    # (the first of `vanilla_impls`) always runs, so every point keeps a vanilla arm.
    reference = f"vanilla/{spec.vanilla_impls[0]}"
    for arm in arms:
        if arm.competes and arm.name not in (reference, strongest) and arm.name in medians:
            ratio = medians[arm.name] / medians[strongest]
            if ratio > spec.drop_factor:
                dropped[arm.name] = (
                    f"{ratio:.1f}× slower than {strongest} at V={vocab}, B={micro_batch}: "
                    "not run at the later points"
                )
    return rows


def _point_lines(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        head = f"  {r['model']:>14} V={r['V']:<7} B={r['micro_batch']:<3} {r['arm']:<24}"
        if r["status"] != "ok":
            lines.append(f"{head} skipped: {r['note']}")
            continue
        ratio = r.get("time_vs_headless")
        lines.append(
            f"{head} {r['step_ms']:9.1f} ms  [{r['step_ms_p25']:.1f}, {r['step_ms_p75']:.1f}]  "
            f"{r['tokens_per_s']:9.0f} tok/s  FLOPs×{r['flops_vs_headless']:.2f}"
            + ("" if ratio is None else f"  time×{ratio:.2f}")
        )
    return lines
