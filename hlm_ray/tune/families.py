"""The model families of the headline comparison (`sweeps/headline.py`): each a preset, its
settings and the budget both arms share, and the arithmetic that turns a budget into each arm's
steps.

    family = FAMILIES["gpt2-cpu"]
    family.steps("headless"), family.steps("vanilla")   # 400, 408: + the generator's tokens
    arm_settings("gpt2-cpu-flops", "vanilla")  # {"optim.max_steps": 17, "budget.flops": ...}
    check_families(spec)                       # HLMError for an unknown family, before Ray

Both arms of a family get the same pretraining budget: in tokens, or (the `-flops` /
`-seconds` families, GPT-2 tokenizer) in FLOPs or measured training seconds; a headless decoder
is then fine-tuned into a generator on `share` of its pretraining tokens (the paper: under 2%),
and the vanilla decoder pretrains on that many tokens more (the same total).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

from hlm_ray.classify.tasks import XNLI_LANGUAGES
from hlm_ray.config import Config
from hlm_ray.errors import HLMError
from hlm_ray.finetune.generators import GENERATORS
from hlm_ray.presets import load_config
from hlm_ray.tune.axis import Value
from hlm_ray.tune.spec import SweepSpec


@dataclass(frozen=True)
class Family:
    """One row group of the report: a model (a preset and overrides) and its budget."""

    preset: str
    overrides: dict[str, Any]
    tokens: int
    """Pretraining tokens of each arm (rounded down to whole optimizer steps)."""
    share: float | None = None
    """Decoders: the headless arm's generator fine-tune, as a share of its pretraining tokens;
    the vanilla arm pretrains on as many tokens more. None: encoders (the GLUE fine-tune is the
    same for both arms), or a fixed `generator`."""
    clm_tokens_per_step: int | None = None
    """Tokens per step of the generator fine-tune (its recipe's batch × seq_len)."""
    generator: dict[str, Any] | None = None
    """Decoders at CPU scale: the fixed generator fine-tune (`hlm_ray.finetune.generators`:
    steps, batch, rate); the vanilla arm pretrains on as many tokens (or FLOPs) more."""
    lrs: dict[str, float] | None = None
    """Each arm's own learning rate (None: the preset's, both arms); `lr_note` says where from."""
    lr_note: str = ""
    paper: str = ""
    """What it reproduces."""
    budget: str = "tokens"
    """What the arms share: tokens (`tokens` each), flops (`flops` each: each arm trains on
    the tokens its head lets it afford) or seconds (`seconds` of measured training each, up
    to `tokens` worth of steps, which is also the schedule's length)."""
    flops: float | None = None
    seconds: float | None = None
    curve: bool = False
    """Keep checkpoints at 25%, 50% and 100% of each arm's steps (`--curve` scores them)."""

    def config(self) -> Config:
        return load_config(self.preset, overrides=dict(self.overrides))

    def tokens_per_step(self) -> int:
        from hlm_ray.budget import tokens_per_step  # torch: not at import

        return tokens_per_step(self.config())

    def pretrain_steps(self) -> int:
        return self.tokens // self.tokens_per_step()

    @property
    def generates(self) -> bool:
        """A decoder whose headless arm is fine-tuned into a generator."""
        return self.share is not None or self.generator is not None

    def finetune_steps(self) -> int | None:
        """The headless arm's generator fine-tune steps (what `run_downstream` derives)."""
        if self.generator is not None:
            return int(self.generator["optim.max_steps"])
        if self.share is None:
            return None
        pretrain_tokens = self.pretrain_steps() * self.tokens_per_step()
        return max(1, math.floor(self.share * pretrain_tokens / self.clm_tokens_per_step))

    def finetune_tokens(self) -> int:
        """The fine-tune's tokens (0 for an encoder)."""
        if self.generator is not None:
            batch = self.generator["optim.global_batch_size"]
            return self.finetune_steps() * batch * self.config().data.seq_len
        return self.finetune_steps() * self.clm_tokens_per_step if self.share else 0

    def steps(self, objective: str) -> int:
        """Pretraining steps of an arm: the budget, plus the fine-tune's tokens for a vanilla
        decoder (in its own steps, rounded to the nearest). At equal FLOPs: the steps the
        arm's `flops_budget` buys (the dry run's bound U for the headless arm)."""
        if self.budget == "flops":
            return flops_steps(self.arm_config(objective), self.flops_budget(objective))
        steps = self.pretrain_steps()
        if not self.generates or objective == "headless" or self.budget == "seconds":
            return steps
        return steps + round(self.finetune_tokens() / self.tokens_per_step())

    def arm_config(self, objective: str) -> Config:
        from hlm_ray.config import apply_overrides

        lr = {"optim.lr": self.lrs[objective]} if self.lrs else {}
        return apply_overrides(self.config(), {"objective.name": objective, **lr})

    def finetune_flops(self) -> float:
        """The generator fine-tune's FLOPs: its tokens at the vanilla arm's FLOPs per token (a
        new head of the same vocabulary)."""
        from hlm_ray.budget import flops_per_step, tokens_per_step

        vanilla = self.arm_config("vanilla")
        per_token = flops_per_step(vanilla, vocab_size_of(vanilla)) / tokens_per_step(vanilla)
        if self.generator is not None or self.budget != "flops":
            return self.finetune_tokens() * per_token
        headless = self.arm_config("headless")
        headless_tokens = flops_steps(headless, self.flops) * tokens_per_step(headless)
        return self.share * headless_tokens * per_token

    def flops_budget(self, objective: str) -> float:
        """`flops` for both arms, plus for a vanilla decoder the FLOPs of its headless twin's
        generator fine-tune (`finetune_flops`)."""
        if not self.generates or objective == "headless":
            return self.flops
        return self.flops + self.finetune_flops()


def vocab_size_of(cfg: Config) -> int:
    """The arm's vocabulary (a tokenizer file is loaded once per path)."""
    t = cfg.tokenizer
    return _vocab_size(t.kind, t.path, t.vocab_size) if t.kind == "file" else t.vocab_size


@cache
def _vocab_size(kind: str, path: str | None, size: int) -> int:
    from hlm_ray.config import apply_overrides
    from hlm_ray.plan import vocab_size_of as size_of
    from hlm_ray.presets import load_config

    cfg = load_config("tiny-encoder")
    return size_of(apply_overrides(cfg, {"tokenizer.kind": kind, "tokenizer.path": path}))


def flops_steps(cfg: Config, flops: float) -> int:
    """The steps `flops` buys an arm (`hlm_ray.budget`'s floor rule; U at its bound)."""
    from hlm_ray.budget import flops_per_step

    return math.floor(flops / flops_per_step(cfg, vocab_size_of(cfg)))


# The paper's corpora, by hub name (OpenWebText2 is not on the hub; OpenWebText is its nearest).
OPENWEBTEXT = ["Skylion007/openwebtext"]
WIKIPEDIA = [f"wikimedia/wikipedia:20231101.{lang}" for lang in XNLI_LANGUAGES]
# The tiny families: the presets' models, 40 steps of 32 × 64 tokens, small evaluations.
TINY_SETTINGS = {"run.log_every": 10, "run.eval_every": 20, "run.checkpoint_every": 20}
TINY_SETTINGS |= {"run.eval_batches": 2, "optim.warmup_steps": 4}
TINY_TOKENS = 40 * 32 * 64
# The cpu families' model and optimizer: d=128, 2 layers, a 4k BPE (both families, both arms).
CPU_SETTINGS = {
    "model.hidden_size": 128,
    "model.num_layers": 2,
    "model.num_heads": 2,
    "tokenizer.vocab_size": 4096,
    "optim.lr": 1e-3,
    "optim.warmup_steps": 30,
    "run.log_every": 50,
    "run.eval_every": 300,
    "run.checkpoint_every": 300,
}
# The paper's decoder tokenizer (GPT-2, 50,257 tokens; shipped in the data folder), for the
# equal-compute rows: the head is then most of a vanilla step, which the compute budgets price.
GPT2_CPU_SETTINGS = {
    **{k: v for k, v in CPU_SETTINGS.items() if k != "tokenizer.vocab_size"},
    "tokenizer.kind": "file",
    "tokenizer.path": "tokenizers/gpt2",
    "optim.warmup_steps": 5,
}
# Equal FLOPs, for every arm at V = 50,257: ~69 vanilla encoder steps, ~17 vanilla decoder steps,
# ~227 headless encoder steps (the dry run lists them).
CPU_FLOPS = 1.2e12
# Equal seconds: measured training time of each arm (the deadline of `budget.seconds`).
CPU_SECONDS = 60.0
# The generator recipe of the tiny decoders (hlm_ray.finetune.clm.RECIPES: tiny, 32 sequences of
# 64 tokens a step) and the share of the pretraining tokens it fine-tunes on.
SMALL_GENERATOR = {"share": 0.02, "clm_tokens_per_step": 32 * 64}
# The cpu decoder of the compute comparisons (the scaling sweep's and the headline's decoder
# rows): d=128, 2 layers, a 2,048-token BPE of the corpus, so that the head is 38% of a vanilla
# step's FLOPs (pythia-70m's: 45%; the GPT-2 tokenizer's 50k: 94%) and the vanilla arm gets
# hundreds of steps; 8 sequences of 64 tokens a step (K = 504 CWT rows); warm-up a tenth of each
# run's steps; both arms update their (tied) embeddings densely.
DECODER_CPU_SETTINGS = {
    "model.hidden_size": 128,
    "model.num_layers": 2,
    "model.num_heads": 2,
    "tokenizer.vocab_size": 2048,
    "optim.global_batch_size": 8,
    "optim.micro_batch_size": 8,
    "optim.embedding_update": "dense",
    "budget.warmup_share": 0.1,
}
# Each arm's rate: what `sweeps/scaling.py --preset cpu`'s search found for this model (the same
# rate at its smallest and largest budget, so one rate per arm serves all three families).
DECODER_CPU_LRS = {"headless": 3.16e-3, "vanilla": 1e-3}
DECODER_LR_NOTE = "each arm at the rate the scaling sweep's search found for this model"
DECODER_CPU = {"generator": GENERATORS["cpu"], "lrs": DECODER_CPU_LRS, "lr_note": DECODER_LR_NOTE}
DECODER_RUN = {"run.log_every": 50, "run.eval_every": 1_000_000, "run.checkpoint_every": 500,
               "run.eval_batches": 2}  # fmt: skip
# Equal tokens: 1,600 steps of 8 × 64 (819,200 tokens, as the encoders'); equal FLOPs: the
# scaling sweep's 2T; equal seconds: 60 s, at most 2,400 steps (the schedule's length).
DECODER_TOKENS = 1_600 * 8 * 64
DECODER_FLOPS = 2e12
DECODER_SECONDS_CAP = 2_400 * 8 * 64
# Sized so that `headline.py --preset cpu` (36 trials) fits 45 minutes on 2 AVX2 cores.
CPU_TOKENS = 400 * 32 * 64  # 400 steps of 32 × 64 tokens
SECONDS_CAP = 1_200 * 32 * 64  # the equal-seconds arms' schedule: more steps than 60 s buy


def pair(suffix: str, settings: dict[str, Any], tokens: int, **budget) -> dict[str, Family]:
    """The encoder and decoder families of one budget at CPU scale: bert-cpu<suffix> (the tiny
    encoder with `settings`, `tokens`) and gpt2-cpu<suffix> (the cpu decoder, its own tokens
    `decoder_tokens`, flops `decoder_flops`, each arm at its searched rate, and its generator
    fine-tune); `budget` sets their other `Family` fields; `paper` names the encoder's table
    (the decoder's is Table 3)."""
    paper = budget.pop("paper", "Table 1 (bert-base, GLUE) at CPU scale")
    decoder = budget.pop("decoder", "Table 3 (pythia-70m, LAMBADA) at CPU scale")
    dec_tokens = budget.pop("decoder_tokens", DECODER_TOKENS)
    dec_flops = budget.pop("decoder_flops", budget.get("flops"))
    dec_budget = {**budget, "flops": dec_flops}
    enc = Family("tiny-encoder", settings, tokens, paper=paper, **budget)
    dec = Family("tiny-gpt2", {**DECODER_CPU_SETTINGS, **DECODER_RUN}, dec_tokens, paper=decoder,
                 **DECODER_CPU, **dec_budget)  # fmt: skip
    return {f"bert-cpu{suffix}": enc, f"gpt2-cpu{suffix}": dec}


FAMILIES: dict[str, Family] = {
    # tiny: the smoke test (seconds of training; scores stay at chance).
    "tiny-encoder": Family("tiny-encoder", TINY_SETTINGS, TINY_TOKENS),
    "tiny-gpt2": Family("tiny-gpt2", TINY_SETTINGS, TINY_TOKENS, **SMALL_GENERATOR),
    # cpu, equal tokens: 819,200 tokens for both arms (encoders 400 steps of 32 × 64, decoders
    # 1,600 of 8 × 64).
    **pair("", CPU_SETTINGS, CPU_TOKENS),
    "tiny-encoder-curve": Family("tiny-encoder", TINY_SETTINGS, TINY_TOKENS, curve=True),
    # --curve: bert-cpu with its checkpoints at 25%, 50% and 100% of the budget kept and scored.
    "bert-cpu-curve": Family(
        "tiny-encoder",
        CPU_SETTINGS,
        CPU_TOKENS,
        curve=True,
        paper="Figures 3-4 (score against pretraining tokens) at CPU scale",
    ),
    # cpu, equal compute (Table 1's equal GPU-hours row, Figure 7): the GPT-2 tokenizer for the
    # encoder, the cpu decoder (2k BPE) for the decoder; every arm the same FLOPs, or the same
    # measured training seconds (encoders up to 1,200 steps, the schedule's length).
    **pair(
        "-flops",
        GPT2_CPU_SETTINGS,
        CPU_TOKENS,
        budget="flops",
        flops=CPU_FLOPS,
        decoder_flops=DECODER_FLOPS,
        paper="Table 1's equal-compute row at CPU scale (GPT-2 tokenizer, equal FLOPs)",
        decoder="Table 3 at equal FLOPs, CPU scale (the cpu decoder, 2k BPE)",
    ),
    **pair(
        "-seconds",
        GPT2_CPU_SETTINGS,
        SECONDS_CAP,
        budget="seconds",
        seconds=CPU_SECONDS,
        decoder_tokens=DECODER_SECONDS_CAP,
        paper="Table 1's equal GPU-hours row at CPU scale (GPT-2 tokenizer, equal seconds)",
        decoder="Table 3 at equal training seconds, CPU scale (the cpu decoder, 2k BPE)",
    ),
    # paper: the models and budgets of Tables 1, 3 and 8 (a cluster).
    "bert-base": Family(
        "bert-base",
        {"data.sources": OPENWEBTEXT},
        tokens=1_000_000 * 256 * 128,
        paper="Table 1: GLUE, bert-base, 1M steps of 256 × 128 tokens",
    ),
    "pythia-70m": Family(
        "pythia-70m",
        {"data.sources": OPENWEBTEXT},
        tokens=143_000 * 1024 * 2048,
        share=0.02,
        clm_tokens_per_step=256 * 2048,
        paper="Table 3: LAMBADA, pythia-70m, 143k steps of 1024 × 2048 tokens",
    ),
    "distilbert-multilingual": Family(
        "distilbert-multilingual",
        # The hub tokenizer's size (what the plan prices where the hub is unreachable).
        {"data.sources": WIKIPEDIA, "optim.micro_batch_size": 8, "tokenizer.vocab_size": 119_547},
        tokens=400_000 * 64 * 128,
        paper="Figure 6: XNLI zero-shot, distilbert-multilingual, 400k steps of 64 × 128",
    ),
}


def arm_settings(value: Value, objective: str) -> dict[str, Any]:
    """The arm's budget (`budget.tokens`, which the run logs as budget/*) and the steps it
    becomes (`hlm_ray.budget`'s floor rule; set here too so a resumed trial knows its length).
    A vanilla decoder pretrains on its headless twin's fine-tuning tokens too."""
    family = FAMILIES[str(value)]
    steps = family.steps(objective)
    tokens = {"optim.max_steps": steps, "budget.tokens": steps * family.tokens_per_step()}
    if family.curve:  # checkpoints at the curve's steps, all kept
        from hlm_ray.tune.curve import checkpoint_settings

        return tokens | checkpoint_settings(steps)
    lr = {"optim.lr": family.lrs[objective]} if family.lrs else {}
    if family.budget == "flops":  # the worker turns the FLOPs into steps (U measured)
        return {"optim.max_steps": steps, "budget.flops": family.flops_budget(objective), **lr}
    if family.budget == "seconds":  # a deadline; max_steps is the cap and the schedule
        return {"optim.max_steps": steps, "budget.seconds": family.seconds, **lr}
    return tokens | lr


def check_families(spec: SweepSpec) -> None:
    """Families this sweep does not know, arms other than headless and vanilla, a downstream
    recipe without the report's scores: `HLMError` before anything runs."""
    unknown = [v for v in spec.values if str(v) not in FAMILIES]
    if unknown:
        raise HLMError(
            f"sweep.values: unknown family {unknown[0]!r}; choose from {', '.join(FAMILIES)}"
        )
    if set(spec.objectives) != {"headless", "vanilla"}:
        raise HLMError("the headline comparison needs sweep.objectives=[headless,vanilla]")
    if not spec.recipe.startswith("headline-"):
        raise HLMError(
            f"sweep.recipe={spec.recipe}: the headline report needs its downstream scores; "
            "use headline-tiny, headline-cpu or headline-paper"
        )
