"""Checkpoints that any `transformers` user can load, written atomically.

A checkpoint is a folder:

    checkpoint_00000050/
      model/              save_pretrained() output + the tokenizer (+ token_bytes.npy)
      train_state.pt      optimizer, scheduler, step, RNG states, metrics at this step
      config.yaml         the resolved hlm_ray config
      hlm_checkpoint.json {"step": 50, ...}: written last, so its presence means "complete"

`save_checkpoint` builds the folder under a temporary name and renames it into place, so an
interrupted save (Ctrl-C, a killed worker) never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hlm_ray.errors import HLMError

MARKER = "hlm_checkpoint.json"
PREFIX = "checkpoint_"


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_checkpoint(
    folder: Path,
    *,
    model,
    tokenizer,
    config_yaml: str,
    train_state: dict[str, Any],
    meta: dict[str, Any],
) -> Path:
    """Write a complete checkpoint at `folder` (atomic: temp folder, then rename)."""
    from hlm_ray.tokenizer import save_tokenizer

    folder = Path(folder)
    tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "model")
    save_tokenizer(tokenizer, tmp / "model")
    torch.save(train_state, tmp / "train_state.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    (tmp / MARKER).write_text(json.dumps(meta, indent=2))
    if folder.exists():  # re-saving the same step after a restart: replace the old one
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def is_checkpoint(folder: Path) -> bool:
    return (Path(folder) / MARKER).is_file()


def checkpoint_step(folder: Path) -> int:
    return int(json.loads((Path(folder) / MARKER).read_text())["step"])


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"{PREFIX}*") if is_checkpoint(p)]
    return sorted(found, key=checkpoint_step)


def resolve_resume(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder's latest checkpoint; HLMError otherwise."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1]
    raise HLMError(
        f"--resume {path}: not a checkpoint (no {MARKER}) and no {PREFIX}* folders inside it; "
        "pass a run's output folder or one of its checkpoint_* folders"
    )


def refuse_existing(folder: str | Path) -> None:
    """A fresh run must not start in a folder that holds checkpoints: it would mix with them."""
    if list_checkpoints(Path(folder)):
        raise HLMError(
            f"{folder} already holds checkpoints; continue it with --resume {folder} "
            "or choose another --output"
        )


def load_train_state(folder: Path) -> dict[str, Any]:
    # The file holds our own optimizer/RNG state (numpy arrays, tuples): not weights-only.
    return torch.load(Path(folder) / "train_state.pt", map_location="cpu", weights_only=False)


def prune_checkpoints(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints."""
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
