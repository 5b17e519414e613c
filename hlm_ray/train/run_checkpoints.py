"""A training run's checkpoints over time: save the step's, keep the best and the final model,
restore one on resume. The folder format itself (manifest, atomic writes) is `checkpoint.py`.

    save_checkpoint(run, done, final)     # every rank; rank 0 writes, every rank reports
    step, seconds, state = restore(folder, model, optimizer, scheduler)
    clear_stale(out_dir, reporter.root)   # a fresh start: no old checkpoints to mix in
    truncate_metrics(out_dir, step)       # metric lines after the resumed step are redone

`<output_dir>/best_checkpoint` (`BEST`) is a copy of the checkpoint with the lowest validation
loss: it survives the pruning of old checkpoints (ours or Ray's), also across resumes.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from hlm_ray.errors import HLMError
from hlm_ray.tracking import read_metrics
from hlm_ray.train import checkpoint as ckpt
from hlm_ray.train.checkpoint import BEST
from hlm_ray.train.run_lock import check_writer
from hlm_ray.train.run_state import TrainRun
from hlm_ray.train.token_counts import STATE_KEY, total_counts, write_model_files


def save_checkpoint(run: TrainRun, done: int, final: bool = False) -> None:
    """Write the step's checkpoint (rank 0), keep the final model and the best checkpoint
    beside it, and report to Ray (every rank)."""
    if run.env.is_main:
        check_writer()  # an orphaned worker (its driver gone) writes no checkpoint
    saving = time.perf_counter()
    counts_V = total_counts(run)  # a collective: every rank, before rank 0 writes
    folder = _save(run.reporter.checkpoint_folder(done), run, done, counts_V, final)
    if folder is not None and final:
        copy_tree(folder / "model", run.out_dir / "model")  # before Ray takes the folder
    if folder is not None and run.last.get("val/loss", math.inf) < run.best_val:
        run.best_val = run.last["val/loss"]
        copy_tree(folder, run.out_dir / BEST)
    run.reporter.report({**run.last, "step": done}, folder)
    run.window_start = time.perf_counter()
    run.checkpoint_s += run.window_start - saving  # saving, copying, Ray's report


def keep_final_model(out_dir: Path, checkpoint: Path) -> None:
    """The final model beside the run, from the checkpoint a worker resumed from when it had
    no step left to train: the worker that saved that last checkpoint wrote the model on its
    own node, and a rank 0 restarted elsewhere (that node lost while the run was finishing)
    would otherwise finish without one."""
    if not (out_dir / "model" / "config.json").is_file():
        check_writer()
        copy_tree(checkpoint / "model", out_dir / "model")


def _save(folder: Path, run: TrainRun, step: int, counts_V, final: bool) -> Path | None:
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
        STATE_KEY: counts_V,  # None: not exact (resumed from a checkpoint without counts)
    }
    meta = {"step": step, "objective": cfg.objective.name, "arch": cfg.model.arch}
    return ckpt.write_checkpoint(
        folder,
        model=run.model,
        tokenizer=run.tokenizer,
        config_yaml=cfg.to_yaml(),
        train_state=state,
        meta=meta,
        model_files=lambda model_dir: write_model_files(model_dir, run, counts_V, final),
    )


def restore(folder: Path, model, optimizer, scheduler) -> tuple[int, float, dict]:
    """Load the checkpoint; (its step, the training seconds before it, its train state: its
    metrics are what a resumed run with no step left to train reports)."""
    from safetensors.torch import load_file

    folder = ckpt.resolve_resume(folder)
    weights = load_file(str(folder / "model" / "model.safetensors"))
    # transformers 5 saves some weights under their legacy names (GPT-NeoX's lm_head as
    # embed_out): map them back to the model's own names.
    legacy = {"embed_out.weight": "lm_head.weight", "embed_out.bias": "lm_head.bias"}
    weights = {legacy.get(k, k): v for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight") or "vocab_projector" in k}
    if set(missing) - tied or unexpected:
        raise HLMError(
            f"checkpoint {folder} does not match the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}; resume with the config it was trained with"
        )
    state = ckpt.load_train_state(folder)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    ckpt.set_rng_state(state["rng"])
    return int(state["step"]), float(state.get("train_seconds", 0.0)), state


def best_val_loss(out_dir: Path) -> float:
    """The validation loss of the run's best checkpoint so far (inf when there is none)."""
    folder = out_dir / BEST
    if not ckpt.is_checkpoint(folder):
        return math.inf
    return ckpt.load_train_state(folder)["metrics"].get("val/loss", math.inf)


def clear_stale(out_dir: Path, checkpoints_root: Path) -> None:
    """A fresh start: remove the checkpoints and best copy of an earlier run in the folder, and
    what a cut-off save left half written."""
    for old in [*ckpt.list_checkpoints(checkpoints_root), out_dir / BEST]:
        shutil.rmtree(old, ignore_errors=True)
    ckpt.remove_leftovers(out_dir)


def truncate_metrics(out_dir: Path, step: int) -> None:
    """Drop metric lines logged after the checkpoint we resume from (they will be redone); a
    fresh start (`step` 0) drops them all, its step-0 line included (a worker group restarted
    before its first checkpoint wrote that line once more each time)."""
    rows = [r for r in read_metrics(out_dir) if r["step"] <= step] if step else []
    path = out_dir / "metrics.jsonl"
    if path.exists():
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def copy_tree(src: Path, dst: Path) -> None:
    """Replace `dst` with a copy of `src`, never leaving a half-copied `dst` behind."""
    tmp = dst.with_name(f"{ckpt.TMP_PREFIX}{dst.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
