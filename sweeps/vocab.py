"""The vocabulary-size ablation (paper Figure 7, Table 9): vocabulary sizes × {headless, vanilla}.

    python sweeps/vocab.py --preset tiny                       # 2 sizes × 2 objectives, 2 CPUs
    python sweeps/vocab.py --preset paper                      # BERT-Small, 6 sizes, GPU workers
    python sweeps/vocab.py --set sweep.values=[512,2048] --num-seeds 3
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python sweeps/vocab.py --preset tiny

BERT-Small encoders, one BPE trained per vocabulary size, headless vs vanilla MLM, scored by the
GLUE-style fine-tuning average. Each trial trains (or finds cached) the BPE of its size,
pretrains through a TorchTrainer, runs the downstream protocol of its family and reports. The
same --name resumes the sweep. Results: runs/sweeps/<name>/summary.md, the figures beside it,
and the MLflow parent run.

The paper names only some grid points (85k and 100k); the others are spaced over the same range.
Its data is CC-News, read from the hub copy `vblagoje/cc_news` (override `data.sources` on a
machine without the hub).
"""

import sys

from hlm_ray.errors import HLMError
from hlm_ray.tune.axis import Axis, Figure
from hlm_ray.tune.cli import sweep_main
from hlm_ray.tune.spec import CC_NEWS, TINY_TRIAL, SweepSpec


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


AXIS = Axis(
    name="vocab",
    field="tokenizer.vocab_size",
    short="v",
    label="vocabulary size",
    column=("vocab (asked)", "vocab_size"),
    figures=(
        Figure("fig7a_score_vs_vocab.png", "downstream/score", "downstream score"),
        Figure("fig7b_tokens_per_s_vs_vocab.png", "tokens_per_s", "training tokens / s"),
    ),
    description="The vocab ablation as a Ray Tune sweep (headless vs vanilla).",
    check=check_vocab_sizes,
    prepared=check_real_sizes,
)

PRESETS = {
    "tiny": SweepSpec(
        axis=AXIS, base="tiny-encoder", values=(512, 1024), overrides=TINY_TRIAL, recipe="tiny"
    ),
    "paper": SweepSpec(
        axis=AXIS,
        base="bert-small",
        values=(16_384, 32_768, 50_000, 65_536, 85_000, 100_000),
        # BPE training reads the first GB of the corpus (all of it at once would need tens of
        # GB of memory); pretraining reads all of it.
        overrides=(CC_NEWS, "tokenizer.train_sample_bytes=1000000000"),
        recipe="paper",
        cpus_per_worker=4,
        gpus_per_worker=1,
    ),
}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the sweep with command-line `argv` (`hlm sweep vocab` passes its own `prog`)."""
    return sweep_main(AXIS, PRESETS, argv, prog)


if __name__ == "__main__":
    sys.exit(main())
