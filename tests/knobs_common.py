"""Helpers of the knob tests (tests/test_knobs*.py): train a few steps through the real loop,
and rebuild what its first step saw (initial weights, micro-batches) to apply a loss by hand.

    cfg = knob_cfg(tmp_path / "run", "tiny-decoder", "headless", **{"objective.temperature": 0.05})
    logged = train_losses(cfg)                       # train/loss of steps 1, 2, ... (metrics.jsonl)
    start = first_step(cfg)                          # the loop's initial model and step 0's batches
    expected = by_hand(start, lambda x, labels, seed: cwt(start, x, labels, temperature=0.05))

The rebuild goes through the same public functions as `hlm_ray.train.setup.setup_run` and
`hlm_ray.train.step.train_step`: `torch.manual_seed(run.seed)` then tokenizer, corpus and
`build_model`; `BlockSampler.shard` and `load_batch` (masking, seeded by `stream_seed`) for the
micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tiny_runs import tiny_run_cfg

from hlm_ray import objectives
from hlm_ray.data import BlockSampler
from hlm_ray.models import build_model, hidden_states, input_embedding_weight, lm_head
from hlm_ray.tracking import read_metrics
from hlm_ray.train.inputs import (
    Masking,
    build_corpus,
    build_tokenizer,
    load_batch,
    special_ids,
    stream_seed,
)
from hlm_ray.train.loop import WorkerEnv, train_worker


def knob_cfg(out, preset: str = "tiny-decoder", objective: str = "headless", **overrides):
    """A tiny CPU run of one step (global batch 32 = 2 micro-batches of 16), step 1 logged."""
    quick = {"run.eval_batches": 1, "run.device": "cpu"}
    every = (1, 1000, 1000)  # log every step, no validation or checkpoint before the last
    return tiny_run_cfg(out, preset, objective, steps=1, every=every, **{**quick, **overrides})


def train_losses(cfg, **kwargs) -> list[float]:
    """Train through `train_worker` (in process); the logged train/loss of each step."""
    train_worker(cfg.to_dict(), progress=False, **kwargs)
    return logged_losses(cfg.run.output_dir)


def logged_losses(out_dir) -> list[float]:
    return [r["train/loss"] for r in read_metrics(Path(out_dir)) if "train/loss" in r]


@dataclass
class FirstStep:
    cfg: object
    model: torch.nn.Module
    tokenizer: object
    micro_batches: list[tuple[torch.Tensor, torch.Tensor | None, int]]
    """(input_ids_BL, labels_BL or None, negative seed) of each of step 0's micro-batches."""


def first_step(cfg, rank: int = 0, world_size: int = 1) -> FirstStep:
    """The loop's initial model (train mode) and rank's micro-batches of step 0."""
    torch.manual_seed(cfg.run.seed)  # as setup_run does, before building anything
    tokenizer = build_tokenizer(cfg)
    corpus = build_corpus(cfg, tokenizer)
    ids = special_ids(tokenizer)
    masking = Masking(cfg, tokenizer, ids) if cfg.model.family == "encoder" else None
    model = build_model(
        cfg.model, vocab_size=len(tokenizer), objective=cfg.objective.name, special_ids=ids
    )
    model.train()
    env = WorkerEnv(rank=rank, world_size=world_size)
    sampler = BlockSampler(len(corpus.train), cfg.optim.global_batch_size, cfg.run.seed)
    batches = []
    for i, idx in enumerate(sampler.shard(0, rank, world_size, cfg.optim.micro_batch_size)):
        input_ids, labels = load_batch(corpus.train, idx, env, masking, cfg.run.seed, 0, i)
        batches.append((input_ids, labels, stream_seed(cfg.run.seed, 0, rank, i)))
    return FirstStep(cfg, model, tokenizer, batches)


def by_hand(start: FirstStep, loss_fn, *, grad: bool = False) -> torch.Tensor:
    """The step's loss as the loop logs it: the mean over its micro-batches of
    `loss_fn(input_ids_BL, labels_BL, seed)` (a LossOutput)."""
    with torch.set_grad_enabled(grad):
        parts = [loss_fn(x, labels, seed).loss for x, labels, seed in start.micro_batches]
    return sum(p / len(parts) for p in parts)


def cwt(start: FirstStep, input_ids_BL, labels_BL, **kwargs) -> objectives.LossOutput:
    """The headless loss of one micro-batch, called directly on `hlm_ray.objectives`."""
    losses = (objectives.headless_causal_loss, objectives.headless_masked_loss)
    return _loss(start, input_ids_BL, labels_BL, input_embedding_weight, losses, kwargs)


def ce(start: FirstStep, input_ids_BL, labels_BL, **kwargs) -> objectives.LossOutput:
    """The vanilla loss of one micro-batch, called directly on `hlm_ray.objectives`."""
    losses = (objectives.vanilla_causal_loss, objectives.vanilla_masked_loss)
    return _loss(start, input_ids_BL, labels_BL, lm_head, losses, kwargs)


def _loss(start, input_ids_BL, labels_BL, weights_of, losses, kwargs) -> objectives.LossOutput:
    """A decoder's loss of (inputs, their next tokens) or an encoder's of (masked inputs,
    labels), with the model's weights for it: the embedding table (CWT) or the head (CE)."""
    hidden_BLD = hidden_states(start.model, input_ids_BL)
    causal, masked = losses
    if labels_BL is None:
        return causal(hidden_BLD, input_ids_BL, weights_of(start.model), **kwargs)
    return masked(hidden_BLD, labels_BL, weights_of(start.model), **kwargs)


def spy(monkeypatch, name: str) -> list[dict]:
    """Record the keyword arguments of every call of `hlm_ray.objectives.<name>` (the loss
    functions call each other through the module, so a call from LMObjective is seen)."""
    calls: list[dict] = []
    real = getattr(objectives, name)

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(objectives, name, recording)
    return calls


def differs(a: float, b: float, rel: float = 1e-3) -> bool:
    return abs(a - b) > rel * max(abs(a), abs(b))
