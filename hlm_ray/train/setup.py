"""A worker's run, built: tokenizer, corpus, model, objective, optimizer, tracker, resume.

    run = setup_run(cfg, env, reporter, tracking, resume_from)   # a TrainRun

Built in a fixed order after `torch.manual_seed(run.seed)` (tokenizer, corpus, model), so the
same config gives the same initial weights and batches (the knob tests rebuild them by hand).
A budget (`budget.*`) becomes `optim.max_steps` here. On a fresh start the run's parameters and
tags are logged and stale checkpoints removed; on a resume the optimizer, schedule and RNG
state come back from the checkpoint and later metric lines are dropped (they are redone).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch

from hlm_ray.budget import (
    budget_metrics,
    budget_params,
    first_step_unique_columns,
    needs_unique_columns,
    resolve_budget,
)
from hlm_ray.cluster import local_model_dir
from hlm_ray.config import Config
from hlm_ray.data import BlockSampler
from hlm_ray.device import autocast_dtype, resolve_device
from hlm_ray.flops import config_step_flops, describe, device_peak_flops
from hlm_ray.head_bias import add_head_bias
from hlm_ray.models import build_model, init_from_pretrained
from hlm_ray.tokenizer import token_byte_lengths
from hlm_ray.tracking import Tracker
from hlm_ray.train.inputs import (
    Masking,
    build_corpus,
    build_tokenizer,
    data_tags,
    special_ids,
    stream_seed,
)
from hlm_ray.train.lm_objective import LMObjective
from hlm_ray.train.optim import build_optimizer, build_scheduler
from hlm_ray.train.run_checkpoints import best_val_loss, clear_stale, restore, truncate_metrics
from hlm_ray.train.run_state import LocalReporter, TrainRun, WorkerEnv
from hlm_ray.train.run_tracking import open_tracker, run_tags
from hlm_ray.train.token_counts import corpus_log_prior, restore_counts


def setup_run(
    cfg: Config,
    env: WorkerEnv | None,
    reporter: LocalReporter | None,
    tracking: dict[str, Any] | None,
    resume_from: str | Path | None,
) -> TrainRun:
    """Tokenizer, corpus, model, objective, optimizer; restored from `resume_from` if given;
    parameters and tags logged on a fresh start."""
    env = env or WorkerEnv(device=resolve_device(cfg.run.device, option="run.device"))
    out_dir = Path(cfg.run.output_dir)
    reporter = reporter or LocalReporter(out_dir, cfg.run.keep_checkpoints)
    resuming = resume_from is not None
    tracker = open_tracker(out_dir, tracking, resuming=resuming) if env.is_main else Tracker()
    accum = cfg.optim.grad_accum_steps(env.world_size)
    torch.manual_seed(cfg.run.seed)

    tokenizer = build_tokenizer(cfg)
    corpus = build_corpus(cfg, tokenizer)
    ids = special_ids(tokenizer)
    masking = Masking(cfg, tokenizer, ids) if cfg.model.family == "encoder" else None
    sampler = BlockSampler(len(corpus.train), cfg.optim.global_batch_size, cfg.run.seed)
    cfg, budget = resolve_budget(
        cfg,
        len(tokenizer),
        world_size=env.world_size,
        unique_columns=_budget_U(cfg, corpus, sampler, masking, env.world_size),
    )
    model = build_model(
        cfg.model, vocab_size=len(tokenizer), objective=cfg.objective.name, special_ids=ids
    )
    if cfg.init.model_dir:  # on a cluster, maybe the driver's copy in the run storage
        init_from_pretrained(
            model, local_model_dir(cfg.init.model_dir), new_head=cfg.init.new_head,
            train=cfg.init.train,
        )  # fmt: skip
    if cfg.init.prior_bias:  # the vanilla head's logits start at log q (before the optimizer)
        add_head_bias(model, corpus_log_prior(cfg))
    model = model.to(env.device)
    module = LMObjective(model, cfg.objective, compile=cfg.optim.compile)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim)

    start, prior_seconds, state = 0, 0.0, {}
    if resuming:
        start, prior_seconds, state = restore(Path(resume_from), model, optimizer, scheduler)
    if env.is_main:
        truncate_metrics(out_dir, start)  # a fresh start (or a restart) redoes later steps
        if start == 0:  # no stale checkpoints to mix in
            clear_stale(out_dir, reporter.root)
    if env.world_size > 1:
        module = torch.nn.parallel.DistributedDataParallel(module)

    step_cost = config_step_flops(cfg, len(tokenizer), world_size=env.world_size)
    if env.is_main and start == 0:
        tracker.log_params({**cfg.to_dict(), **(budget_params(budget) if budget else {})})
        tracker.set_tags({**run_tags(cfg, tokenizer, env, model, step_cost), **data_tags(cfg)})
        budget_log = budget_metrics(budget) if budget is not None else {}
        tracker.log_metrics({**describe(step_cost), **budget_log}, step=0)
    elif env.is_main:  # resumed: values changed by overrides are kept as param_changed.* tags
        tracker.log_params(cfg.to_dict())
        if env.nodes:  # a restarted worker group may sit elsewhere: where it is now
            tracker.set_tags({"worker_nodes": ",".join(env.nodes)})
    amp = autocast_dtype(cfg.optim.precision, env.device)
    run = TrainRun(
        cfg=cfg,
        env=env,
        out_dir=out_dir,
        reporter=reporter,
        tracker=tracker,
        tokenizer=tokenizer,
        corpus=corpus,
        model=model,
        module=module,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=torch.amp.GradScaler(enabled=amp == torch.float16),
        amp=amp,
        sampler=sampler,
        masking=masking,
        token_bytes=torch.as_tensor(token_byte_lengths(tokenizer), device=env.device),
        peak_flops=device_peak_flops() if env.device.type == "cuda" else None,
        accum=accum,
        start=start,
        loss_sum=torch.zeros((), device=env.device),
        rows_sum=torch.zeros((), device=env.device),
        best_val=best_val_loss(out_dir) if start else math.inf,
        resumed_metrics=state.get("metrics") or {},
        budget=budget,
        prior_seconds=prior_seconds,
        done=start,
        target_counts=torch.zeros(len(tokenizer), dtype=torch.long, device=env.device),
    )
    restore_counts(run, state)
    return run


def _budget_U(cfg: Config, corpus, sampler, masking, world_size: int) -> int | None:
    """U of step 0's first micro-batch when a FLOPs budget needs it (see hlm_ray.budget)."""
    if not needs_unique_columns(cfg):
        return None

    def targets(rank: int) -> torch.Tensor:
        idx = sampler.shard(0, rank, world_size, cfg.optim.micro_batch_size)[0]
        inputs, labels = corpus.train[idx], None
        if masking is not None:
            inputs, labels = masking(inputs, stream_seed(cfg.run.seed, 0, rank, 0))
        return LMObjective.target_ids(inputs, labels)

    workers = world_size if cfg.objective.cross_worker_negatives else 1
    return first_step_unique_columns(targets, range(workers))


def quiet_library_progress_bars() -> None:
    """Our own bar shows training progress; per-save and per-load bars from HF would interleave."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    with contextlib.suppress(ImportError):  # datasets is optional (absent on a bare node)
        __import__("datasets").disable_progress_bars()
