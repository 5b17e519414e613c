"""The per-worker training function: the same code runs in one process or on Ray Train workers.

    summary = train_worker(cfg.to_dict())                         # one process
    summary = train_worker(cfg.to_dict(), env=WorkerEnv(...), reporter=..., tracker=...)

What a worker does each optimizer step: take its shard of the step's global batch (a pure
function of (seed, step), so resume needs no sampler state), run `grad_accum` micro-batches of
`optim.micro_batch_size` sequences (K for CWT comes from one micro-batch), clip, step. Loss values
stay on the device between log steps: no Python-side sync per step.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from hlm_ray.budget import (
    budget_metrics,
    budget_params,
    deadline_passed,
    first_step_unique_columns,
    flops_per_step,
    needs_unique_columns,
    resolve_budget,
)
from hlm_ray.config import Config
from hlm_ray.data import BlockSampler
from hlm_ray.device import autocast, autocast_dtype, resolve_device
from hlm_ray.flops import config_step_flops, describe, device_peak_flops, k_tags, mfu
from hlm_ray.model_card import write_model_card
from hlm_ray.models import build_model, init_from_pretrained, num_parameters
from hlm_ray.tokenizer import token_byte_lengths
from hlm_ray.tracking import JsonlTracker, MultiTracker, Tracker, read_metrics
from hlm_ray.train import checkpoint as ckpt
from hlm_ray.train.distributed import gather_negative_ids, global_mean
from hlm_ray.train.inputs import (
    Masking,
    build_corpus,
    build_tokenizer,
    data_tags,
    load_batch,
    special_ids,
    stream_seed,
)
from hlm_ray.train.lm_objective import LMObjective
from hlm_ray.train.optim import build_optimizer, build_scheduler, clip_grad_norm
from hlm_ray.train.summary import plot_loss_curve
from hlm_ray.train.validate import evaluate

BEST = "best_checkpoint"  # a copy of the checkpoint with the lowest validation loss


@dataclass
class WorkerEnv:
    """Where this worker sits. Ray Train fills it from its context; one process is rank 0 of 1."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class LocalReporter:
    """Checkpoints in `<output_dir>/checkpoint_*`, keeping the newest `keep`."""

    def __init__(self, output_dir: Path, keep: int):
        self.root = Path(output_dir)
        self.keep = keep

    def report(self, metrics: dict[str, float], checkpoint_dir: Path | None) -> None:
        if checkpoint_dir is not None:
            ckpt.prune_checkpoints(self.root, self.keep)

    def checkpoint_folder(self, step: int) -> Path:
        return self.root / f"{ckpt.PREFIX}{step:08d}"


@dataclass
class _Run:
    """What one worker holds while it trains: built by `_setup`, advanced by `_step`, read by
    `_log_window`, `_evaluate_now`, `_checkpoint` and `_finish`."""

    cfg: Config
    env: WorkerEnv
    out_dir: Path
    reporter: LocalReporter
    tracker: Tracker
    tokenizer: Any
    corpus: Any
    model: torch.nn.Module
    module: torch.nn.Module
    """The LMObjective (DDP-wrapped with more than one worker): its forward returns the loss."""
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    amp: torch.dtype | None
    sampler: BlockSampler
    masking: Masking | None
    token_bytes: torch.Tensor
    """Each token id's byte length (for the validation bits per byte of a vocabulary head)."""
    step_cost: Any
    peak_flops: float | None
    accum: int
    start: int
    """The step training starts from (0, or the resumed checkpoint's)."""
    train_time: float = 0.0
    window_start: float = field(default_factory=time.perf_counter)
    window_steps: int = 0
    loss_sum: torch.Tensor | None = None
    grad_norm: float = math.nan
    rows_sum: torch.Tensor | None = None  # loss rows (K) per micro-batch, summed over the window
    setup_s: float = 0.0
    checkpoint_s: float = 0.0
    entered: float = 0.0
    entered_at: float = 0.0
    last_batch: tuple | None = None
    """(input_ids, labels, negatives) of the last micro-batch."""
    best_val: float = math.inf
    last: dict[str, float] = field(default_factory=dict)
    budget: Any = None
    """What `budget.*` became (`hlm_ray.budget.BudgetPlan`), or None."""
    prior_seconds: float = 0.0
    """Training seconds of the steps before the resumed checkpoint (for budget.seconds)."""
    done: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.optim.global_batch_size * self.cfg.data.seq_len


def train_worker(
    config: dict[str, Any],
    *,
    env: WorkerEnv | None = None,
    reporter: LocalReporter | None = None,
    tracking: dict[str, Any] | None = None,
    resume_from: str | Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train to `optim.max_steps`; returns the run summary (rank 0's view).

    `tracking` ({"uri": ..., "run_id": ...}) makes rank 0 log to that MLflow run as well as to
    `<output_dir>/metrics.jsonl`; the caller opened the run and closes it."""
    entered, entered_at = time.perf_counter(), time.time()  # for summary["seconds"]
    cfg = Config.from_dict(config)
    _quiet_library_progress_bars()
    run = _setup(cfg, env, reporter, tracking, resume_from)
    run.entered, run.entered_at = entered, entered_at
    cfg = run.cfg  # with the steps a budget became
    bar = tqdm(
        total=cfg.optim.max_steps,
        initial=run.start,
        disable=not (progress and run.env.is_main),
        desc=f"{cfg.objective.name} {cfg.model.arch}",
        dynamic_ncols=True,
        # A Ray worker's output is line-buffered into the driver's log: update it rarely there.
        mininterval=0.1 if sys.stderr.isatty() else 10.0,
    )
    run.model.train()
    run.window_start = time.perf_counter()
    run.setup_s = run.window_start - entered
    seconds = cfg.budget.seconds
    first = cfg.optim.max_steps if deadline_passed(run.prior_seconds, seconds) else run.start
    for step in range(first, cfg.optim.max_steps):
        if cfg.run.fail_at_step == step and run.env.rank == run.env.world_size - 1:
            _inject_failure(run.out_dir, step)
        _step(run, step)
        done = run.done = step + 1
        bar.update(1)
        out_of_time = deadline_passed(run.prior_seconds + run.train_time, seconds)
        final = done == cfg.optim.max_steps or out_of_time
        if done % cfg.run.log_every == 0 or final:
            _log_window(run, done)
            bar.set_postfix(loss=f"{run.last['train/loss']:.3f}")
        if done % cfg.run.eval_every == 0 or final:
            _evaluate_now(run, done)
        if done % cfg.run.checkpoint_every == 0 or final:
            _checkpoint(run, done, final)
        if out_of_time:
            break
    bar.close()
    return _finish(run)


def _setup(cfg, env, reporter, tracking, resume_from) -> _Run:
    """Tokenizer, corpus, model, objective, optimizer; restored from `resume_from` if given;
    parameters and tags logged on a fresh start."""
    env = env or WorkerEnv(device=resolve_device(cfg.run.device, option="run.device"))
    out_dir = Path(cfg.run.output_dir)
    reporter = reporter or LocalReporter(out_dir, cfg.run.keep_checkpoints)
    tracker = (
        _tracker(out_dir, tracking, resuming=resume_from is not None) if env.is_main else Tracker()
    )
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
    if cfg.init.model_dir:
        init_from_pretrained(
            model, cfg.init.model_dir, new_head=cfg.init.new_head, train=cfg.init.train
        )
    model = model.to(env.device)
    module = LMObjective(model, cfg.objective, compile=cfg.optim.compile)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim)

    start, prior_seconds = 0, 0.0
    if resume_from is not None:
        start, prior_seconds = _restore(Path(resume_from), model, optimizer, scheduler)
    if env.is_main:
        _truncate_metrics(out_dir, start)  # a fresh start (or a restart) redoes later steps
        if start == 0:  # no stale checkpoints to mix in
            for old in [*ckpt.list_checkpoints(reporter.root), out_dir / BEST]:
                shutil.rmtree(old, ignore_errors=True)
    if env.world_size > 1:
        module = torch.nn.parallel.DistributedDataParallel(module)

    step_cost = config_step_flops(cfg, len(tokenizer), world_size=env.world_size)
    if env.is_main and start == 0:
        tracker.log_params({**cfg.to_dict(), **(budget_params(budget) if budget else {})})
        tracker.set_tags({**_tags(cfg, tokenizer, env, model, step_cost), **data_tags(cfg)})
        tracker.log_metrics({**describe(step_cost), **_budget_log(budget)}, step=0)
    elif env.is_main:  # resumed: values changed by overrides are kept as param_changed.* tags
        tracker.log_params(cfg.to_dict())
    amp = autocast_dtype(cfg.optim.precision, env.device)
    return _Run(
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
        step_cost=step_cost,
        peak_flops=device_peak_flops() if env.device.type == "cuda" else None,
        accum=accum,
        start=start,
        loss_sum=torch.zeros((), device=env.device),
        rows_sum=torch.zeros((), device=env.device),
        best_val=_best_val_loss(out_dir / BEST) if start else math.inf,
        budget=budget,
        prior_seconds=prior_seconds,
        done=start,
    )


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


def _budget_log(budget) -> dict[str, float]:
    return budget_metrics(budget) if budget is not None else {}


def _step(run: _Run, step: int) -> None:
    """One optimizer step: this worker's `accum` micro-batches of the step's global batch, then
    clip and update. The loss stays on the device (summed into `run.loss_sum`)."""
    cfg, env = run.cfg, run.env
    step_start = time.perf_counter()
    micro_batches = run.sampler.shard(step, env.rank, env.world_size, cfg.optim.micro_batch_size)
    for i, idx in enumerate(micro_batches):
        input_ids, labels = load_batch(
            run.corpus.train, idx, env, run.masking, cfg.run.seed, step, i
        )
        negatives = None
        if cfg.objective.cross_worker_negatives:
            negatives = gather_negative_ids(LMObjective.target_ids(input_ids, labels))
        sync = i == len(micro_batches) - 1 or env.world_size == 1
        seed = stream_seed(cfg.run.seed, step, env.rank, i)
        with _no_sync(run.module, sync), autocast(env.device, run.amp):
            out = run.module(input_ids, labels, negative_ids=negatives, negative_seed=seed)["loss"]
        run.scaler.scale(out.loss / run.accum).backward()
        run.loss_sum += out.loss.detach() / run.accum
        # An int for CWT and decoders, a 0-d tensor for the masked vanilla loss: no sync here.
        run.rows_sum += out.num_rows / run.accum
    run.scaler.unscale_(run.optimizer)
    # Sparse-aware (the lazy embedding update's gradient): torch's clip_grad_norm_ raises.
    run.grad_norm = clip_grad_norm(run.model.parameters(), cfg.optim.grad_clip or float("inf"))
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.last_batch = (input_ids, labels, negatives)  # for the measured U at log steps
    run.train_time += time.perf_counter() - step_start
    run.window_steps += 1


def _log_window(run: _Run, done: int) -> None:
    """The metrics of the steps since the last log line (the one sync per window)."""
    elapsed = time.perf_counter() - run.window_start
    steps = run.window_steps
    # The loss and K per micro-batch, averaged over workers and steps (one collective).
    loss_sum, rows_sum = global_mean(torch.stack([run.loss_sum, run.rows_sum])).tolist()
    rows, before = rows_sum / steps, run.last.get("train/K")
    run.last = {
        "train/loss": loss_sum / steps,
        "train/lr": run.scheduler.get_last_lr()[0],
        "train/grad_norm": float(run.grad_norm),
        "train/step_time_s": elapsed / steps,
        "train/tokens_per_s": run.tokens_per_step * steps / elapsed,
        "train/K": rows,  # a masked LM's K varies by micro-batch (~15% of positions): the mean
        **_peak_memory(run.env.device),
    }
    # Measured U: distinct ids among the last micro-batch's negatives (all workers' with
    # cross-worker negatives); the FLOP model and MFU use it, not the bound min(W·K, V).
    U = measured_unique_columns(*run.last_batch)
    cost = config_step_flops(
        run.cfg, len(run.tokenizer), world_size=run.env.world_size, unique_columns=U
    )
    run.last["train/U"] = float(U)
    run.last["train/flops_per_token"] = cost.per_token
    utilisation = mfu(cost.per_token * run.last["train/tokens_per_s"], run.peak_flops)
    if utilisation is not None:
        run.last["train/mfu"] = utilisation / run.env.world_size  # peak is per device
    run.tracker.log_metrics(run.last, step=done)
    if rows != before:  # the tags say what the metric says
        run.tracker.set_tags(k_tags(rows, len(run.tokenizer)))
    run.loss_sum.zero_()
    run.rows_sum.zero_()
    run.window_steps, run.window_start = 0, time.perf_counter()


def measured_unique_columns(
    input_ids: torch.Tensor, labels: torch.Tensor | None, negatives: torch.Tensor | None
) -> int:
    """U of one micro-batch: distinct target ids, or distinct ids among all workers' negatives
    when they were gathered (one host sync; called at log steps only)."""
    ids = negatives if negatives is not None else LMObjective.target_ids(input_ids, labels)
    return int(torch.unique(ids).numel())


def _evaluate_now(run: _Run, done: int) -> None:
    val = evaluate(
        run.module, run.corpus.val, run.cfg, run.env, run.masking, run.token_bytes, run.amp
    )
    run.tracker.log_metrics(val, step=done)
    run.last.update(val)
    run.window_start = time.perf_counter()  # evaluation is not training time


def _checkpoint(run: _Run, done: int, final: bool = False) -> None:
    """Write the step's checkpoint (rank 0), keep the final model and the best checkpoint
    beside it, and report to Ray (every rank)."""
    saving = time.perf_counter()
    folder = _save(run.reporter.checkpoint_folder(done), run, done)
    if folder is not None and final:
        _copy_tree(folder / "model", run.out_dir / "model")  # before Ray takes the folder
    if folder is not None and run.last.get("val/loss", math.inf) < run.best_val:
        # The best checkpoint survives the pruning of old ones (ours or Ray's).
        run.best_val = run.last["val/loss"]
        _copy_tree(folder, run.out_dir / BEST)
    run.reporter.report({**run.last, "step": done}, folder)
    run.window_start = time.perf_counter()
    run.checkpoint_s += run.window_start - saving  # saving, copying, Ray's report


def _finish(run: _Run) -> dict[str, Any]:
    """Log the artifacts (rank 0) and return (and write) the run summary."""
    cfg, out_dir = run.cfg, run.out_dir
    steps_run = run.done - run.start
    summary = {
        "objective": cfg.objective.name,
        "arch": cfg.model.arch,
        "steps": run.done,
        "tokens": run.done * run.tokens_per_step,
        "tokens_per_s": (
            steps_run * run.tokens_per_step / run.train_time if run.train_time else math.nan
        ),
        "vocab_size": len(run.tokenizer),
        "parameters": num_parameters(run.model),
        "metrics": run.last,
        "model_dir": str(out_dir / "model"),
        # Where the worker's time went (rank 0): building model and data, the optimizer steps
        # (train), checkpoints with their reports, everything (worker); entered_at is the wall
        # clock the launcher compares with its own.
        "seconds": {
            "setup": run.setup_s,
            "train": run.train_time,
            "checkpoint": run.checkpoint_s,
            "worker": time.perf_counter() - run.entered,
            "entered_at": run.entered_at,
        },
    }
    if run.budget is not None:
        summary["budget"] = _budget_outcome(run)
    if run.env.is_main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        _log_artifacts(run.tracker, out_dir, cfg)  # after summary.json: the model card reads it
    return summary


def _budget_outcome(run: _Run) -> dict[str, Any]:
    """What the budget became, and what the run spent (rank 0 logs it): the steps run and,
    with the last measured U (`train/U`), the FLOPs per step the data really cost."""
    plan = run.budget
    out = {**budget_params(plan), "budget/steps_run": run.done}
    out["budget/train_seconds"] = run.prior_seconds + run.train_time
    out["budget/flops_per_step"] = plan.flops_per_step
    if "train/U" in run.last:
        measured = flops_per_step(
            run.cfg,
            len(run.tokenizer),
            world_size=run.env.world_size,
            unique_columns=int(run.last["train/U"]),
        )
        out["budget/flops_per_step_measured"] = measured
    numbers = {k: float(v) for k, v in out.items() if isinstance(v, int | float)}
    run.tracker.log_metrics(numbers, step=run.done)
    return out


def _save(folder: Path, run: _Run, step: int) -> Path | None:
    """All ranks call this; rank 0 writes. Returns the folder (rank 0) or None."""
    if not run.env.is_main:
        return None
    cfg = run.cfg
    state = {
        "step": step,
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "rng": ckpt.rng_state(),
        "metrics": run.last,
        "train_seconds": run.prior_seconds + run.train_time,  # budget.seconds spans resumes
    }
    meta = {"step": step, "objective": cfg.objective.name, "arch": cfg.model.arch}
    return ckpt.write_checkpoint(
        folder,
        model=run.model,
        tokenizer=run.tokenizer,
        config_yaml=cfg.to_yaml(),
        train_state=state,
        meta=meta,
    )


def _restore(folder: Path, model, optimizer, scheduler) -> tuple[int, float]:
    """Load the checkpoint; (its step, the training seconds before it)."""
    from safetensors.torch import load_file

    folder = ckpt.resolve_resume(folder)
    weights = load_file(str(folder / "model" / "model.safetensors"))
    # transformers 5 saves some weights under their legacy names (GPT-NeoX's lm_head as
    # embed_out): map them back to the model's own names.
    legacy = {"embed_out.weight": "lm_head.weight"}
    weights = {legacy.get(k, k): v for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight") or "vocab_projector" in k}
    if set(missing) - tied or unexpected:
        from hlm_ray.errors import HLMError

        raise HLMError(
            f"checkpoint {folder} does not match the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}; resume with the config it was trained with"
        )
    state = ckpt.load_train_state(folder)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    ckpt.set_rng_state(state["rng"])
    return int(state["step"]), float(state.get("train_seconds", 0.0))


def _best_val_loss(folder: Path) -> float:
    if not ckpt.is_checkpoint(folder):
        return math.inf
    return ckpt.load_train_state(folder)["metrics"].get("val/loss", math.inf)


def _truncate_metrics(out_dir: Path, step: int) -> None:
    """Drop metric lines logged after the checkpoint we resume from (they will be redone)."""
    rows = [r for r in read_metrics(out_dir) if r["step"] <= step]
    path = out_dir / "metrics.jsonl"
    if path.exists():
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _inject_failure(out_dir: Path, step: int) -> None:
    """Fault injection (tests): fail once at `step`; the marker file makes the retry pass."""
    marker = out_dir / f".failed_at_{step}"
    if not marker.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        marker.touch()
        raise RuntimeError(f"injected failure at step {step} (run.fail_at_step)")


def _tracker(out_dir: Path, tracking: dict[str, Any] | None, resuming: bool = False) -> Tracker:
    if not tracking or tracking.get("run_id") is None:  # no MLflow run could be opened
        return JsonlTracker(out_dir)
    from hlm_ray.tracking import MlflowTracker
    from hlm_ray.tracking.sync import SkipLogged, last_logged_step

    mlflow = MlflowTracker(
        tracking["experiment"], tracking_uri=tracking["uri"], run_id=tracking["run_id"]
    )
    if resuming:  # steps redone after the checkpoint were sent to MLflow already
        mlflow = SkipLogged(mlflow, last_logged_step(out_dir))
    return MultiTracker(JsonlTracker(out_dir), mlflow)


def _log_artifacts(tracker: Tracker, out_dir: Path, cfg: Config) -> None:
    """The resolved config, the final model (HF format, tokenizer inside) and the loss curve."""
    config_path = out_dir / "config.yaml"
    cfg.save(config_path)
    tracker.log_artifact(config_path)
    write_model_card(out_dir / "model")  # README.md: headless or vanilla, corpus, steps, tokens
    tracker.log_artifact(out_dir / "model", "model")
    with contextlib.suppress(ModuleNotFoundError):  # no matplotlib (a bare node): no loss PNG
        tracker.log_artifact(plot_loss_curve(read_metrics(out_dir), out_dir / "loss_curve.png"))


def _tags(cfg: Config, tokenizer, env: WorkerEnv, model, step_cost) -> dict[str, Any]:
    return {
        **k_tags(step_cost.target_rows, len(tokenizer)),
        "head_flop_share": round(step_cost.head_share, 4),
        "cross_worker_negatives": cfg.objective.cross_worker_negatives,
        "objective": cfg.objective.name,
        "arch": cfg.model.arch,
        "family": cfg.model.family,
        "vocab_size": len(tokenizer),
        "world_size": env.world_size,
        "parameters": num_parameters(model),
    }


def _peak_memory(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"train/peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20}
    import resource

    # CPU: the process's peak resident set (KiB on Linux), the closest thing to device memory.
    return {"train/peak_mem_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _no_sync(module, sync: bool):
    if sync or not hasattr(module, "no_sync"):
        return contextlib.nullcontext()
    return module.no_sync()


def _quiet_library_progress_bars() -> None:
    """Our own bar shows training progress; per-save and per-load bars from HF would interleave."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    with contextlib.suppress(ImportError):  # datasets is optional (absent on a bare node)
        __import__("datasets").disable_progress_bars()


def _copy_tree(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".tmp-{dst.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
