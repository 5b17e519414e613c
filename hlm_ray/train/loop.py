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

from hlm_ray.config import Config
from hlm_ray.data import BlockSampler, mask_tokens
from hlm_ray.flops import config_step_flops, describe, device_peak_flops, mfu
from hlm_ray.models import build_model, init_from_pretrained, num_parameters
from hlm_ray.tokenizer import token_byte_lengths
from hlm_ray.tracking import JsonlTracker, MultiTracker, Tracker, read_metrics
from hlm_ray.train import checkpoint as ckpt
from hlm_ray.train.distributed import gather_negative_ids, global_mean
from hlm_ray.train.inputs import build_corpus, build_tokenizer, special_ids
from hlm_ray.train.optim import build_optimizer, build_scheduler, clip_grad_norm
from hlm_ray.train.step import LMObjective

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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from hlm_ray.errors import HLMError

        raise HLMError("run.device=cuda but no CUDA GPU is visible; use run.device=cpu")
    return torch.device(name)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    if precision == "auto":
        ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if ok else None
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


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
    cfg = Config.from_dict(config)
    _quiet_library_progress_bars()
    env = env or WorkerEnv(device=resolve_device(cfg.run.device))
    out_dir = Path(cfg.run.output_dir)
    reporter = reporter or LocalReporter(out_dir, cfg.run.keep_checkpoints)
    tracker = _tracker(out_dir, tracking) if env.is_main else Tracker()
    accum = cfg.optim.grad_accum_steps(env.world_size)
    torch.manual_seed(cfg.run.seed)

    tokenizer = build_tokenizer(cfg)
    corpus = build_corpus(cfg, tokenizer)
    ids = special_ids(tokenizer)
    model = build_model(
        cfg.model, vocab_size=len(tokenizer), objective=cfg.objective.name, special_ids=ids
    )
    if cfg.init.model_dir:
        init_from_pretrained(
            model, cfg.init.model_dir, new_head=cfg.init.new_head, train=cfg.init.train
        )
    model = model.to(env.device)
    module = LMObjective(model, cfg.objective)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim)

    start = 0
    if resume_from is not None:
        start = _restore(Path(resume_from), model, optimizer, scheduler)
    if env.is_main:
        _truncate_metrics(out_dir, start)  # a fresh start (or a restart) redoes later steps
        if start == 0:  # no stale checkpoints to mix in
            for old in [*ckpt.list_checkpoints(reporter.root), out_dir / BEST]:
                shutil.rmtree(old, ignore_errors=True)
    if env.world_size > 1:
        module = torch.nn.parallel.DistributedDataParallel(module)

    step_cost = config_step_flops(cfg, len(tokenizer), world_size=env.world_size)
    peak = device_peak_flops() if env.device.type == "cuda" else None
    if env.is_main and start == 0:
        tracker.log_params(cfg.to_dict())
        tracker.set_tags(_tags(cfg, tokenizer, env, model, step_cost))
        tracker.log_metrics(describe(step_cost), step=0)
    sampler = BlockSampler(len(corpus.train), cfg.optim.global_batch_size, cfg.run.seed)
    token_bytes = torch.as_tensor(token_byte_lengths(tokenizer), device=env.device)
    masking = _Masking(cfg, tokenizer, ids) if cfg.model.family == "encoder" else None
    amp = autocast_dtype(cfg.optim.precision, env.device)
    scaler = torch.amp.GradScaler(enabled=amp == torch.float16)
    tokens_per_step = cfg.optim.global_batch_size * cfg.data.seq_len

    bar = tqdm(
        total=cfg.optim.max_steps,
        initial=start,
        disable=not (progress and env.is_main),
        desc=f"{cfg.objective.name} {cfg.model.arch}",
        dynamic_ncols=True,
        # A Ray worker's output is line-buffered into the driver's log: update it rarely there.
        mininterval=0.1 if sys.stderr.isatty() else 10.0,
    )
    train_time, window_start, window_steps = 0.0, time.perf_counter(), 0
    loss_sum = torch.zeros((), device=env.device)
    best_val = _best_val_loss(out_dir / BEST) if start else math.inf
    last: dict[str, float] = {}
    model.train()
    for step in range(start, cfg.optim.max_steps):
        if cfg.run.fail_at_step == step and env.rank == env.world_size - 1:
            _inject_failure(out_dir, step)
        step_start = time.perf_counter()
        micro_batches = sampler.shard(step, env.rank, env.world_size, cfg.optim.micro_batch_size)
        for i, idx in enumerate(micro_batches):
            input_ids, labels = _batch(corpus.train, idx, env, masking, cfg.run.seed, step, i)
            negatives = None
            if cfg.objective.cross_worker_negatives:
                negatives = gather_negative_ids(LMObjective.target_ids(input_ids, labels))
            sync = i == len(micro_batches) - 1 or env.world_size == 1
            with _no_sync(module, sync), _autocast(env.device, amp):
                out = module(input_ids, labels, negative_ids=negatives)["loss"]
            scaler.scale(out.loss / accum).backward()
            loss_sum += out.loss.detach() / accum
        scaler.unscale_(optimizer)
        # Sparse-aware (the lazy embedding update's gradient): torch's clip_grad_norm_ raises.
        grad_norm = clip_grad_norm(model.parameters(), cfg.optim.grad_clip or float("inf"))
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train_time += time.perf_counter() - step_start
        window_steps += 1
        done = step + 1
        bar.update(1)

        if done % cfg.run.log_every == 0 or done == cfg.optim.max_steps:
            elapsed = time.perf_counter() - window_start
            last = {
                # The one sync per log window: the loss averaged over workers.
                "train/loss": global_mean(loss_sum).item() / window_steps,
                "train/lr": scheduler.get_last_lr()[0],
                "train/grad_norm": float(grad_norm),
                "train/step_time_s": elapsed / window_steps,
                "train/tokens_per_s": tokens_per_step * window_steps / elapsed,
                "train/K": float(out.num_rows),
                **_peak_memory(env.device),
            }
            utilisation = mfu(step_cost.per_token * last["train/tokens_per_s"], peak)
            if utilisation is not None:
                last["train/mfu"] = utilisation / env.world_size  # peak is per device
            tracker.log_metrics(last, step=done)
            bar.set_postfix(loss=f"{last['train/loss']:.3f}")
            loss_sum.zero_()
            window_steps, window_start = 0, time.perf_counter()
        if done % cfg.run.eval_every == 0 or done == cfg.optim.max_steps:
            val = evaluate(module, corpus.val, cfg, env, masking, token_bytes, amp)
            tracker.log_metrics(val, step=done)
            last.update(val)
            window_start = time.perf_counter()  # evaluation is not training time
        if done % cfg.run.checkpoint_every == 0 or done == cfg.optim.max_steps:
            folder = _save(
                reporter.checkpoint_folder(done),
                model,
                tokenizer,
                cfg,
                optimizer,
                scheduler,
                done,
                last,
                env,
            )
            if folder is not None and done == cfg.optim.max_steps:
                _copy_tree(folder / "model", out_dir / "model")  # before Ray takes the folder
            if folder is not None and last.get("val/loss", math.inf) < best_val:
                # The best checkpoint survives the pruning of old ones (ours or Ray's).
                best_val = last["val/loss"]
                _copy_tree(folder, out_dir / BEST)
            reporter.report({**last, "step": done}, folder)
            window_start = time.perf_counter()
    bar.close()

    model_dir = out_dir / "model"
    if env.is_main:
        _log_artifacts(tracker, out_dir, cfg)
    steps_run = cfg.optim.max_steps - start
    summary = {
        "objective": cfg.objective.name,
        "arch": cfg.model.arch,
        "steps": cfg.optim.max_steps,
        "tokens": cfg.optim.max_steps * tokens_per_step,
        "tokens_per_s": steps_run * tokens_per_step / train_time if train_time else math.nan,
        "vocab_size": len(tokenizer),
        "parameters": num_parameters(model),
        "metrics": last,
        "model_dir": str(model_dir),
    }
    if env.is_main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


class _Masking:
    """Encoder inputs: BERT masking with a generator seeded by (seed, step, rank, micro)."""

    def __init__(self, cfg: Config, tokenizer, ids: dict[str, int]):
        self.mask_id = ids["mask_token"]
        self.special = sorted(set(ids.values()))
        self.vocab_size = len(tokenizer)
        self.p = cfg.data.mlm_probability

    def __call__(self, input_ids_BL: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return mask_tokens(
            input_ids_BL,
            mask_id=self.mask_id,
            special_ids=self.special,
            vocab_size=self.vocab_size,
            probability=self.p,
            generator=gen,
        )


def _batch(blocks, idx, env, masking, seed, step, micro):
    input_ids = blocks[idx]
    labels = None
    if masking is not None:
        # One stream per (step, rank, micro-batch): masks are reproducible on resume.
        stream = ((seed * 1_000_003 + step + 1) * 4099 + env.rank) * 1031 + micro
        input_ids, labels = masking(input_ids, stream % 2**63)
        labels = labels.to(env.device, non_blocking=True)
    return input_ids.to(env.device, non_blocking=True), labels


@torch.no_grad()
def evaluate(module, val_blocks, cfg: Config, env: WorkerEnv, masking, token_bytes, amp):
    """Validation on the first `run.eval_batches` micro-batches of the held-out slice.
    Vanilla: loss, perplexity, bits per byte. Headless: CWT loss and in-batch top-1 accuracy."""
    inner = module.module if hasattr(module, "module") else module
    inner.eval()
    mb = cfg.optim.micro_batch_size
    sums = {"loss": 0.0, "rows": 0, "acc": 0.0, "nats": 0.0, "bytes": 0}
    for b in range(min(cfg.run.eval_batches, math.ceil(len(val_blocks) / mb))):
        idx = torch.arange(b * mb, min((b + 1) * mb, len(val_blocks)))
        input_ids, labels = _batch(val_blocks, idx, env, masking, cfg.run.seed, -1, b)
        with _autocast(env.device, amp):
            parts = inner(input_ids, labels, return_accuracy=True)
        out = parts["loss"]
        rows = int(out.num_rows)
        sums["loss"] += out.loss.item() * rows
        sums["rows"] += rows
        if "cwt" in parts and parts["cwt"].accuracy is not None:
            sums["acc"] += parts["cwt"].accuracy.item() * rows
        if "ce" in parts:
            targets = LMObjective.target_ids(input_ids, labels)
            sums["nats"] += parts["ce"].loss.item() * rows
            sums["bytes"] += int(token_bytes[targets].sum())
    inner.train()
    rows = max(sums["rows"], 1)
    metrics = {"val/loss": sums["loss"] / rows}
    if cfg.objective.name in ("headless", "mixed"):
        metrics["val/accuracy"] = sums["acc"] / rows
    if cfg.objective.name in ("vanilla", "mixed"):
        metrics["val/ce"] = sums["nats"] / rows
        metrics["val/perplexity"] = math.exp(min(sums["nats"] / rows, 50.0))
        metrics["val/bpb"] = sums["nats"] / math.log(2) / max(sums["bytes"], 1)
    return metrics


def _save(folder, model, tokenizer, cfg, optimizer, scheduler, step, metrics, env):
    """All ranks call this; rank 0 writes. Returns the folder (rank 0) or None."""
    if not env.is_main:
        return None
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": ckpt.rng_state(),
        "metrics": metrics,
    }
    meta = {"step": step, "objective": cfg.objective.name, "arch": cfg.model.arch}
    return ckpt.write_checkpoint(
        folder,
        model=model,
        tokenizer=tokenizer,
        config_yaml=cfg.to_yaml(),
        train_state=state,
        meta=meta,
    )


def _restore(folder: Path, model, optimizer, scheduler) -> int:
    from safetensors.torch import load_file

    folder = ckpt.resolve_resume(folder)
    weights = load_file(str(folder / "model" / "model.safetensors"))
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
    return int(state["step"])


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


def _tracker(out_dir: Path, tracking: dict[str, Any] | None) -> Tracker:
    if not tracking or tracking.get("run_id") is None:  # no MLflow run could be opened
        return JsonlTracker(out_dir)
    from hlm_ray.tracking import MlflowTracker

    mlflow = MlflowTracker(
        tracking["experiment"], tracking_uri=tracking["uri"], run_id=tracking["run_id"]
    )
    return MultiTracker(JsonlTracker(out_dir), mlflow)


def _log_artifacts(tracker: Tracker, out_dir: Path, cfg: Config) -> None:
    """The resolved config, the final model (HF format, tokenizer inside) and the loss curve."""
    from hlm_ray.tracking import plot_loss_curve

    config_path = out_dir / "config.yaml"
    cfg.save(config_path)
    tracker.log_artifact(config_path)
    tracker.log_artifact(out_dir / "model", "model")
    tracker.log_artifact(plot_loss_curve(read_metrics(out_dir), out_dir / "loss_curve.png"))


def _tags(cfg: Config, tokenizer, env: WorkerEnv, model, step_cost) -> dict[str, Any]:
    return {
        "K": step_cost.target_rows,
        "K_over_V": round(step_cost.target_rows / len(tokenizer), 4),
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


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _no_sync(module, sync: bool):
    if sync or not hasattr(module, "no_sync"):
        return contextlib.nullcontext()
    return module.no_sync()


def _quiet_library_progress_bars() -> None:
    """Our own bar shows training progress; per-save and per-load bars from HF would interleave."""
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


def _copy_tree(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".tmp-{dst.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
