"""The vocabulary-size ablation (paper Figure 7, Table 9): vocabulary sizes × {headless, vanilla}.

    python sweeps/vocab.py --preset tiny                       # the demo: 1k, 8k, 32k; ~3 min
    python sweeps/vocab.py --preset cpu                        # Figure 7 at equal FLOPs, 3 seeds
    python sweeps/vocab.py --preset cpu --dry-run              # its trials, steps and FLOPs
    python sweeps/vocab.py --preset paper                      # BERT-Small, 6 sizes, GPU workers
    python sweeps/vocab.py --set sweep.values=[512,2048] --num-seeds 3
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python sweeps/vocab.py --preset tiny

BERT-Small encoders, one BPE trained per vocabulary size, headless vs vanilla MLM, scored by the
GLUE-style fine-tuning average. Each trial trains (or finds cached) the BPE of its size,
pretrains through a TorchTrainer, runs the downstream protocol of its family and reports. The
same --name resumes the sweep. Results: runs/sweeps/<name>/summary.md, the figures beside it,
and the MLflow parent run.

Both arms update the input embedding densely (a vanilla head reads the whole tied table), so the
arms differ in their objective alone; each headless trial also times its own model's step with
the lazy, row-wise update beside the dense one (`hlm_ray.bench.update_probe`), the update that
keeps a headless step's cost flat in V: its effect is its own row and line. The `cpu` preset
gives every trial the same `budget.flops`, so each arm trains on the tokens its head lets it
afford, and its largest size is the shipped GPT-2 tokenizer (50,257 tokens; BPE on the shipped
corpus stops short of 50k). After the sweep, `hlm_ray.tune.vocab_report` redraws Figure 7a/7b
(the task, its majority-class baseline, points at chance; the training speed of each arm and the
headless arm's speed with the lazy update), writes report.md (the headline report's statistics
per size, speed intervals from the runs' own step times) and prints two closing sentences: what
the speed figure shows, and whether the scores can be told apart.

The paper names only some grid points (85k and 100k); the others are spaced over the same range.
Its data is CC-News, read from the hub copy `vblagoje/cc_news` (override `data.sources` on a
machine without the hub).
"""

import sys

from hlm_ray.errors import HLMError
from hlm_ray.tune.axis import Axis, Figure
from hlm_ray.tune.cli import SweepScript
from hlm_ray.tune.spec import SweepSpec, paper_scale, tiny_scale
from hlm_ray.tune.vocab_report import write_vocab_report


def check_vocab_sizes(spec: SweepSpec) -> None:
    """Sizes the BPE trainer cannot produce: below the byte alphabet + special tokens."""
    from hlm_ray.tokenizer import BYTE_ALPHABET, special_tokens_for

    cfg = spec.base_config()
    if cfg.tokenizer.kind != "bpe":
        raise HLMError(
            f"the vocabulary sweep trains a BPE per size but tokenizer.kind={cfg.tokenizer.kind}"
            "; remove the tokenizer.kind override"
        )
    minimum = BYTE_ALPHABET + len(special_tokens_for(cfg.model.family))
    small = [v for v in spec.values if v < minimum]
    if small:
        raise HLMError(
            f"vocabulary size {small[0]} is below the {BYTE_ALPHABET} byte-level + "
            f"{minimum - BYTE_ALPHABET} special tokens of a {cfg.model.family}; use sizes >= "
            f"{minimum}"
        )


def check_real_sizes(spec: SweepSpec, real: dict[int, int]) -> None:
    """A BPE that stops below its requested size (the corpus has too few merges) is an error
    unless `sweep.allow_smaller_vocab`; then the real size is used, said and recorded."""
    short = {req: got for req, got in real.items() if got < req}
    if not short:
        return
    req, got = next(iter(short.items()))
    if not spec.allow_smaller_vocab:
        raise HLMError(
            f"vocabulary size {req} is more than the corpus supports: BPE training stopped at "
            f"{got} tokens; lower the size, add text (data.sources), or run at the real size "
            "with --set sweep.allow_smaller_vocab=true"
        )
    for req, got in short.items():
        print(
            f"warning: vocabulary size {req}: BPE training stopped at {got} tokens; "
            f"its trials use V={got} (recorded in the summary)"
        )


GPT2_VOCAB = 50_257
"""The shipped GPT-2 tokenizer's size: the value that stands for it (BPE on the shipped corpus
stops short of 50k merges)."""
GPT2_TOKENIZER = {"tokenizer.kind": "file", "tokenizer.path": "tokenizers/gpt2"}


def vocab_settings(value, workers: int) -> dict:
    """A size is a BPE trained to it, except `GPT2_VOCAB`: the shipped GPT-2 tokenizer. Every
    value sets the same keys (Tune resolves each key a value sets for every trial)."""
    if value == GPT2_VOCAB:
        return {"tokenizer.vocab_size": value, **GPT2_TOKENIZER}
    return {"tokenizer.vocab_size": value, "tokenizer.kind": "bpe", "tokenizer.path": None}


def arm_settings(value, objective: str) -> dict:
    """Both arms update the embedding table densely: a vanilla head reads the whole tied table,
    and the objectives are compared at the same update (the lazy one's speed is probed apart)."""
    return {"optim.embedding_update": "dense"}


AXIS = Axis(
    name="vocab",
    field="tokenizer.vocab_size",
    settings=vocab_settings,
    arm_settings=arm_settings,
    column=("vocab (asked)", "vocab_size"),
    label="vocabulary size",
    figures=(
        Figure("fig7a_score_vs_vocab.png", "downstream/score", "downstream score"),
        Figure("fig7b_tokens_per_s_vs_vocab.png", "tokens_per_s", "training tokens / s"),
    ),
    check=check_vocab_sizes,
    prepared=check_real_sizes,
)

# The cpu preset's model (the headline report's cpu encoder: d=128, 2 layers) and its budget:
# every trial gets EQUAL_FLOPS (`hlm_ray.flops`): ~379 headless steps at any size, 363 vanilla
# steps at 1k down to 116 at 50,257 (`--dry-run` lists them). Sized for ~20 minutes on 2 idle
# cores: 24 trials, two at a time, each ~30-50 s of Ray and downstream overhead plus ~60 s of
# training.
CPU_MODEL = (
    "model.hidden_size=128",
    "model.num_layers=2",
    "model.num_heads=2",
    "optim.lr=1e-3",
    "optim.warmup_steps=10",
    "run.log_every=50",
    "run.eval_every=100000",
    "run.checkpoint_every=100000",
    "run.eval_batches=2",
)
EQUAL_FLOPS = 2e12

PRESETS = {
    # The demo: sizes where the head matters, 50 steps each, one seed; ~3 minutes on 2 cores.
    "tiny": tiny_scale(AXIS, "tiny-encoder", (1024, 8192, 32_768), "optim.max_steps=50"),
    # Figure 7 at CPU scale: equal FLOPs per trial, 3 seeds, the headline report per size.
    "cpu": SweepSpec(
        axis=AXIS,
        base="tiny-encoder",
        values=(1024, 4096, 16_384, GPT2_VOCAB),
        num_seeds=3,
        overrides=(*CPU_MODEL, f"budget.flops={EQUAL_FLOPS:g}"),
        recipe="tiny",
    ),
    # BPE training reads the first GB of the corpus (all of it at once would need tens of GB of
    # memory); pretraining reads all of it.
    "paper": paper_scale(
        AXIS,
        "bert-small",
        (16_384, 32_768, 50_000, 65_536, 85_000, 100_000),
        "tokenizer.train_sample_bytes=1000000000",
    ),
}


def equal_flops_steps(spec: SweepSpec) -> dict[tuple, int]:
    """{(value, objective): the steps `budget.flops` buys} as the dry run prices them (the
    bound U for the headless arm: the fewest steps it can get; the worker measures U and may
    give it more). Each uses the requested size (GPT-2: its 50,257 tokens)."""
    from hlm_ray.budget import resolve_budget

    out = {}
    for value in spec.values:
        for objective in spec.objectives:
            cfg = spec.cell_config(value, objective, 0)
            _, plan = resolve_budget(cfg, int(value))
            out[(value, objective)] = plan.steps if plan else cfg.optim.max_steps
    return out


SCRIPT = SweepScript(AXIS, PRESETS, report=write_vocab_report)
main = SCRIPT.main

if __name__ == "__main__":
    sys.exit(main())
