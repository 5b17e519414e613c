"""Tiny training runs on the shipped tinyshakespeare text, for tests that train through the real
loop (`train_worker`, in process or on Ray Train workers).

    cfg = tiny_run_cfg(tmp_path / "run", steps=6, every=(1, 6, 6), vocab=300)
    cfg = tiny_run_cfg(out, "tiny-encoder", "vanilla", steps=40, every=(5, 40, 20),
                       batch=(16, 8), **{"optim.warmup_steps": 5})
"""

from __future__ import annotations

from hlm_ray.config import Config
from hlm_ray.paths import data_dir
from hlm_ray.presets import load_config

SHAKESPEARE = str(data_dir() / "corpus" / "en" / "tinyshakespeare.txt")


def tiny_run_cfg(
    out,
    preset: str = "tiny-decoder",
    objective: str = "headless",
    *,
    steps: int,
    every: tuple[int, int, int],
    vocab: int = 512,
    batch: tuple[int, int] | None = None,
    **dotted,
) -> Config:
    """`preset` for `objective` on tinyshakespeare, writing to `out`: `steps` optimizer steps,
    `every` = (log, validation, checkpoint) intervals in steps, a BPE of `vocab` tokens,
    `batch` = (global, micro) sequences (None: the preset's), then `dotted` overrides."""
    log_every, eval_every, checkpoint_every = every
    overrides = {"data.sources": [SHAKESPEARE], "tokenizer.vocab_size": vocab}
    overrides |= {"optim.max_steps": steps, "run.output_dir": str(out)}
    overrides |= {"run.log_every": log_every, "run.eval_every": eval_every}
    overrides["run.checkpoint_every"] = checkpoint_every
    if batch is not None:
        overrides |= {"optim.global_batch_size": batch[0], "optim.micro_batch_size": batch[1]}
    return load_config(preset, objective=objective, overrides={**overrides, **dotted})


def expected_target_counts(cfg: Config, steps: int):
    """(V,) counts of the next-token targets of a decoder run's first `steps` optimizer steps,
    rebuilt from its batch order (a pure function of seed and step, whatever the workers)."""
    import numpy as np

    from hlm_ray.data import BlockSampler
    from hlm_ray.train.inputs import build_corpus, build_tokenizer

    tokenizer = build_tokenizer(cfg)
    corpus = build_corpus(cfg, tokenizer)
    batch = cfg.optim.global_batch_size
    sampler = BlockSampler(len(corpus.train), batch, cfg.run.seed)
    counts = np.zeros(len(tokenizer), dtype=np.int64)
    for step in range(steps):
        for idx in sampler.shard(step, 0, 1, batch):
            targets = corpus.train[idx][:, 1:].reshape(-1).numpy()
            counts += np.bincount(targets, minlength=len(tokenizer))
    return counts
