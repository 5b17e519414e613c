"""The benchmark presets: `smoke` (tests), `cpu` (2 cores, < 10 min), `gpu` (one CUDA device).

    from hlm_ray.bench.presets import get_bench_preset
    preset = get_bench_preset("cpu", repeats=5)     # repeats overrides every benchmark's count

A preset is data: the loss-head grid, the models and (vocabulary, micro-batch) points of the
training-step benchmark, and the Ray-overhead run. Sizes of the `cpu` preset are chosen so the
whole `hlm bench --preset cpu` fits in ten minutes on 2 cores while the K ≈ V crossover of the
loss head is inside its grid (K both below and above V).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial

from hlm_ray.config import ModelConfig
from hlm_ray.errors import HLMError

BENCHMARKS = ("loss_head", "train_step", "ray_overhead")
"""What `hlm bench --only` chooses from, in the order they run (`suite.run_bench`)."""

LOSS_METHODS = (
    "cwt_plain",
    "cwt_dedup",
    "cwt_chunked",
    "ce_full",
    "ce_chunked",
    "ce_linear",
    "ce_compiled",
    "ce_liger",
    "ce_cce",
    "ce_cce_compile",
)


@dataclass(frozen=True)
class Sweep:
    """One line through the (K, V) grid: `over` ("V" or "K") takes `values`, the other is fixed."""

    over: str
    fixed: int
    values: tuple[int, ...]

    def cells(self) -> list[tuple[int, int]]:
        """(K, V) pairs, smallest first."""
        return [(self.fixed, v) if self.over == "V" else (v, self.fixed) for v in self.values]


@dataclass(frozen=True)
class LossHeadSpec:
    dim: int
    """Hidden size D of the predictions and of the table rows."""
    sweeps: tuple[Sweep, ...]
    methods: tuple[str, ...] = LOSS_METHODS
    chunk_rows: int = 1024
    """Row chunk of cwt_chunked and ce_chunked."""
    dtype: str = "fp32"
    """fp32 or bf16 inputs (logits are float32 either way, except in F.linear_cross_entropy)."""
    warmup: int = 1
    repeats: int = 3
    budget_s: float = 3.0
    """Seconds per call a method may take: a method whose time at the previous cell of a sweep,
    scaled by the FLOPs, predicts more is skipped (keeps pathological kernels off the clock)."""
    max_logits_gb: float = 4.0
    """Methods that materialise a full K×V (or K×K) float32 matrix are skipped above this."""
    compile: bool = True
    """Measure torch.compile'd cross-entropy (compiled once, with dynamic shapes)."""


@dataclass(frozen=True)
class StepModel:
    """A model of the training-step benchmark and the (V, micro-batch) points it runs at."""

    name: str
    model: ModelConfig
    seq_len: int
    points: tuple[tuple[int, int], ...]
    """(vocabulary size, micro-batch size) pairs; the first micro-batch is the main one."""


@dataclass(frozen=True)
class TrainStepSpec:
    models: tuple[StepModel, ...]
    warmup: int = 1
    repeats: int = 3
    precision: str = "fp32"
    """fp32 or bf16 (autocast, float32 parameters and logits)."""
    vanilla_impls: tuple[str, ...] = ("full", "linear")
    """Cross-entropy implementations tried for vanilla (`objective.ce_impl` values;
    "compiled": linear + cross-entropy through torch.compile; the fused kernels of
    `objective.vanilla_impl`: liger, cce, cce_compile); the fastest is the strongest baseline.
    A kernel that cannot run on the device (or is not installed) gives a skipped row."""
    drop_factor: float = 1.5
    """A vanilla impl slower than this × the fastest one at a point is not run at the model's
    later points (the reference impl, the first of `vanilla_impls`, always runs)."""
    max_iqr: float = 0.2
    """An arm whose interquartile range exceeds this × its median triggers another round."""
    extra_rounds: int = 1
    """At most this many more rounds of `repeats` alternations when a spread is wide."""
    max_step_s: float = 30.0
    """An arm whose warm-up step takes longer than this is not timed further."""
    attn_impls: tuple[str, ...] = ("sdpa",)
    """More than one: the headless/lazy and best vanilla arms are repeated per backend."""
    compile_blocks: bool = False
    """Add a headless/lazy arm with torch.compile'd transformer blocks."""
    batches: int = 4
    """Distinct random micro-batches cycled through (token ids uniform over the vocabulary)."""
    flat_repeats: int = 8
    """Timed alternations of the flat-in-V comparison (its arms are cheap: headless only)."""
    no_head_vocabs: tuple[int, ...] = (131072,)
    """Points of these vocabularies also time a `no-head/lazy` arm: the same model's step with
    no loss head at all (the limit the loss head's cost is measured against)."""


@dataclass(frozen=True)
class RayOverheadSpec:
    preset: str = "tiny-decoder"
    steps: int = 100
    log_every: int = 10
    overrides: tuple[str, ...] = ()
    ray_runs: int = 2
    """Runs under Ray; bare runs go before, between and after them (ray_runs + 1)."""


@dataclass(frozen=True)
class BenchPreset:
    name: str
    loss_head: LossHeadSpec
    train_step: TrainStepSpec
    ray_overhead: RayOverheadSpec
    needs_cuda: bool = False
    mfu_model: str | None = None
    """The model whose headless/lazy arm carries the MFU target (GPU presets)."""
    flat_points: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per model: the (smallest, largest) V compared by the flat-in-V target."""


def _model(arch: str, d: int, layers: int, heads: int, positions: int, inner: int | None = None):
    return ModelConfig(
        arch=arch,
        hidden_size=d,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=inner,
        max_positions=positions,
    )


_neox = partial(_model, "gpt_neox")
_bert = partial(_model, "bert")


def _at(micro_batch: int, *vocabs: int) -> tuple[tuple[int, int], ...]:
    """(vocabulary size, micro-batch) points of one micro-batch."""
    return tuple((v, micro_batch) for v in vocabs)


SMOKE = BenchPreset(
    name="smoke",
    loss_head=LossHeadSpec(
        dim=8,
        sweeps=(Sweep("V", 16, (8, 64)), Sweep("K", 32, (8, 64))),
        chunk_rows=8,
        warmup=0,
        repeats=1,
        budget_s=float("inf"),  # tiny cells: never skip on time (timings are not the point)
        compile=False,
    ),
    train_step=TrainStepSpec(
        models=(
            StepModel("neox-smoke", _neox(16, 1, 2, 16), 16, ((64, 2), (256, 2))),
            StepModel("bert-smoke", _bert(16, 1, 2, 16), 16, ((64, 4), (256, 4))),
        ),
        warmup=1,
        repeats=1,
        batches=2,
        flat_repeats=1,
        # A fused kernel: a skipped row with its reason where it cannot run (CPU, CI).
        vanilla_impls=("full", "linear", "liger"),
        no_head_vocabs=(256,),
    ),
    ray_overhead=RayOverheadSpec(
        steps=4,
        log_every=2,
        overrides=("model.hidden_size=16", "model.num_layers=1", "data.max_tokens=20000"),
        ray_runs=1,
    ),
    flat_points={"neox-smoke": (64, 256), "bert-smoke": (64, 256)},
)

# 2 CPU cores. The decoder is the one NOTES.md measured (GPT-NeoX d=256, 4 layers, 16×128
# tokens: K = 2032); the encoder is BERT-mini sized (L4 H256), 15% of 16×128 tokens masked.
CPU = BenchPreset(
    name="cpu",
    loss_head=LossHeadSpec(
        dim=128,
        sweeps=(
            Sweep("V", 256, (64, 256, 1024, 4096, 16384, 65536, 262144)),
            Sweep("V", 4096, (1024, 4096, 16384)),
            Sweep("K", 1024, (256, 1024, 4096)),
        ),
        chunk_rows=1024,
        warmup=1,
        repeats=3,
        budget_s=3.0,
    ),
    train_step=TrainStepSpec(
        models=(
            StepModel(
                "neox-L4-D256",
                _neox(256, 4, 4, 128),
                128,
                ((8192, 16), (32768, 16), (131072, 16), (32768, 4)),
            ),
            StepModel(
                "bert-L4-D256",
                _bert(256, 4, 4, 128),
                128,
                ((8192, 16), (32768, 16), (131072, 16), (32768, 4)),
            ),
        ),
        warmup=1,
        repeats=3,
        vanilla_impls=("full", "linear", "compiled", "liger", "cce", "cce_compile"),
    ),
    # A mid-size step (~0.1 s): tiny-decoder's 30 ms steps are Python-bound, and Ray Train runs
    # the loop in a thread of its worker actor, beside Ray's own threads (GIL).
    ray_overhead=RayOverheadSpec(
        steps=60,
        log_every=10,
        overrides=(
            "model.hidden_size=128",
            "model.num_heads=2",
            "data.seq_len=128",
        ),
    ),
    flat_points={"neox-L4-D256": (8192, 131072), "bert-L4-D256": (8192, 131072)},
)

# One CUDA device, bf16 autocast. The paper's models: BERT-base at seq 512 over micro-batches
# (Figure 3), BERT-small over vocabularies (Figure 7b), Pythia-70M and a GPT-2-small-size decoder.
GPU = BenchPreset(
    name="gpu",
    needs_cuda=True,
    loss_head=LossHeadSpec(
        dim=768,
        sweeps=(
            Sweep("V", 16384, (4096, 16384, 65536, 131072, 262144)),
            Sweep("K", 32768, (4096, 16384, 32768, 65536)),
        ),
        chunk_rows=8192,
        dtype="bf16",
        warmup=3,
        repeats=10,
        budget_s=5.0,
        max_logits_gb=20.0,
    ),
    train_step=TrainStepSpec(
        models=(
            StepModel(
                "gpt2-small",
                ModelConfig(
                    arch="gpt2", hidden_size=768, num_layers=12, num_heads=12, max_positions=1024
                ),
                1024,
                # The issue-13 targets: MFU, and headless vs the strongest vanilla at 32k / 131k.
                ((32768, 8), (50304, 8), (131072, 8)),
            ),
            StepModel(
                "pythia-70m", _neox(512, 6, 8, 2048, 2048), 2048, _at(8, 8192, 50304, 131072)
            ),
            StepModel("bert-small", _bert(512, 4, 8, 512, 2048), 128, _at(64, 8192, 32768, 131072)),
            StepModel(
                "bert-base",
                _bert(768, 12, 12, 512, 3072),
                512,
                ((50304, 16), (50304, 8), (50304, 32)),
            ),
        ),
        warmup=3,
        repeats=10,
        precision="bf16",
        vanilla_impls=("linear", "full", "chunked", "compiled", "liger", "cce"),
        attn_impls=("sdpa", "xformers"),
        compile_blocks=True,
        max_step_s=60.0,
    ),
    ray_overhead=RayOverheadSpec(steps=200, log_every=20, overrides=("run.device=cuda",)),
    mfu_model="gpt2-small",
    flat_points={"pythia-70m": (8192, 131072), "bert-small": (8192, 131072)},
)

BENCH_PRESETS = {"smoke": SMOKE, "cpu": CPU, "gpu": GPU}


def get_bench_preset(name: str, *, repeats: int | None = None) -> BenchPreset:
    if name not in BENCH_PRESETS:
        raise HLMError(f"unknown bench preset {name!r}; choose one of: {', '.join(BENCH_PRESETS)}")
    preset = BENCH_PRESETS[name]
    if repeats is not None:
        if repeats < 1:
            raise HLMError(f"--repeats {repeats} must be >= 1")
        preset = replace(
            preset,
            loss_head=replace(preset.loss_head, repeats=repeats),
            train_step=replace(preset.train_step, repeats=repeats),
        )
    return preset
