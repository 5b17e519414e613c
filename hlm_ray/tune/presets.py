"""The sweeps' named scales: `tiny` (2 CPU cores, minutes) and `paper` (the paper's setups).

    spec = get_sweep("vocab", "tiny", overrides=["optim.max_steps=10"])
    spec = get_sweep("batch_size", "paper", overrides=["sweep.values=[32,128]"])

vocab (paper Figure 7, Table 9): BERT-Small encoders, one BPE per vocabulary size, headless vs
vanilla MLM, scored by the GLUE-style fine-tuning average. batch_size (Figure 8, Table 10): the
11M-parameter GPT-2, one run per micro-batch size (the in-batch negatives of CWT), the headless
arm fine-tuned into a generator, everything scored on LAMBADA.

The paper's text names only some grid points (vocabularies of 85k and 100k, a largest batch of
128); the other points here are spaced to cover the same range. The paper's data is CC-News,
read from the hub copy `vblagoje/cc_news` (override `data.sources` on a machine without the hub).
"""

from __future__ import annotations

from hlm_ray.errors import HLMError
from hlm_ray.tune.spec import SweepSpec, with_overrides

# Few steps and small evaluations: a trial is seconds of training on one CPU core.
_TINY_RUN = [
    "optim.max_steps=40",
    "optim.warmup_steps=4",
    "run.log_every=10",
    "run.eval_every=20",
    "run.checkpoint_every=20",
    "run.eval_batches=2",
]
_CC_NEWS = "data.sources=[vblagoje/cc_news]"

SWEEPS: dict[str, dict[str, SweepSpec]] = {
    "vocab": {
        "tiny": SweepSpec(
            kind="vocab",
            base="tiny-encoder",
            values=(512, 1024),
            overrides=tuple(_TINY_RUN),
            recipe="tiny",
        ),
        "paper": SweepSpec(
            kind="vocab",
            base="bert-small",
            values=(16_384, 32_768, 50_000, 65_536, 85_000, 100_000),
            # BPE training reads the first GB of the corpus (all of it at once would need
            # tens of GB of memory); pretraining reads all of it.
            overrides=(_CC_NEWS, "tokenizer.max_train_bytes=1000000000"),
            recipe="paper",
            cpus_per_worker=4,
            gpus_per_worker=1,
        ),
    },
    "batch_size": {
        "tiny": SweepSpec(
            kind="batch_size",
            base="gpt2-11m",
            values=(8, 16),
            # gpt2-11m shrunk to a tiny GPT-2 with its own small BPE (the 50k GPT-2 vocabulary
            # would make the vanilla head most of the work).
            overrides=(
                "model.hidden_size=64",
                "model.num_layers=2",
                "model.num_heads=2",
                "model.max_positions=128",
                "model.dropout=0.0",
                "tokenizer.kind=bpe",
                "tokenizer.path=null",
                "tokenizer.vocab_size=1024",
                "data.seq_len=64",
                "optim.lr=3e-3",
                *_TINY_RUN,
            ),
            recipe="tiny",
        ),
        "paper": SweepSpec(
            kind="batch_size",
            base="gpt2-11m",
            values=(16, 32, 64, 128),
            overrides=(_CC_NEWS,),
            recipe="paper",
            cpus_per_worker=4,
            gpus_per_worker=1,
        ),
    },
}


def get_sweep(kind: str, preset: str, overrides: list[str] | None = None) -> SweepSpec:
    """The named sweep with `--set` overrides (`sweep.FIELD=...` or config keys) applied."""
    if kind not in SWEEPS:
        raise HLMError(f"unknown sweep {kind!r}; choose one of: {', '.join(SWEEPS)}")
    if preset not in SWEEPS[kind]:
        raise HLMError(
            f"unknown {kind} sweep preset {preset!r}; choose one of: {', '.join(SWEEPS[kind])}"
        )
    return with_overrides(SWEEPS[kind][preset], list(overrides or []))
