"""Checkpoints that any `transformers` user can load, written atomically.

A checkpoint is a folder:

    checkpoint_00000050/
      model/              save_pretrained() output + the tokenizer (+ token_bytes.npy), and
                          what `model_files` adds (token_counts.npz, readout.json)
      train_state.pt      optimizer, scheduler, step, RNG states, metrics at this step
      config.yaml         the resolved hlm_ray config
      hlm_checkpoint.json {"step": 50, ..., "files": {path: {"size", "sha256"}}}: the manifest,
                          written last, so its presence means "complete"

`write_checkpoint` builds the folder under a temporary name and renames it into place, so an
interrupted save (Ctrl-C, a killed worker) never leaves a half-written checkpoint behind. Copies
made by others (Ray uploads a checkpoint file by file; a killed driver can leave a folder with
some of the files) are caught by the manifest: `verify` checks every file's size and checksum,
and `latest_valid` takes the newest checkpoint that passes, naming the ones it skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hlm_ray.errors import HLMError

MARKER = "hlm_checkpoint.json"
PREFIX = "checkpoint_"
BEST = "best_checkpoint"  # a copy of the checkpoint with the lowest validation loss
DAMAGED_PREFIX = "damaged-"  # a damaged checkpoint is renamed aside: damaged-checkpoint_N
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's list of reported checkpoints

log = logging.getLogger(__name__)


# numpy and torch are imported where they are used: `hlm train` checks its output folder
# (`refuse_existing`) before it imports torch, so that bad input is answered at once.


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

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
    model_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write a complete checkpoint at `folder` (atomic: temp folder, then rename);
    `model_files(model_dir)` adds files beside the model before the manifest lists them."""
    import torch

    from hlm_ray.tokenizer import save_tokenizer

    folder = Path(folder)
    tmp = folder.with_name(f"{TMP_PREFIX}{folder.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp / "model")
        save_tokenizer(_as_saved(model, tokenizer), tmp / "model")
        if model_files is not None:
            model_files(tmp / "model")
        torch.save(train_state, tmp / "train_state.pt")
        (tmp / "config.yaml").write_text(config_yaml)
        write_manifest(tmp, meta)
    except BaseException as err:  # Ctrl-C, a full disk: no half-written folder stays behind
        full = disk_full(tmp.parent, err)  # before the space comes back
        shutil.rmtree(tmp, ignore_errors=True)
        if full is None:
            raise
        raise HLMError(
            f"no space left on device writing {folder.name} in {folder.parent} ({full}); free "
            "space there, then resume: the earlier checkpoints are intact"
        ) from None
    if folder.exists():  # re-saving the same step after a restart: replace the old one
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def disk_full(folder: Path, err: BaseException) -> str | None:
    """What says that `err` came from a full disk under `folder` ("N bytes free"), else None.
    torch says only `basic_ios::clear: iostream error` and `unexpected pos 277760 vs 277652`:
    the disk's free space (under 1 MiB) tells, as does an OSError's ENOSPC or EDQUOT."""
    import errno

    chain, seen = err, set()
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if isinstance(chain, OSError) and chain.errno in (errno.ENOSPC, errno.EDQUOT):
            return "the disk or the quota is full"
        chain = chain.__cause__ or chain.__context__
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    free = stat.f_bavail * stat.f_frsize
    return f"{free:,} bytes free" if free < 1 << 20 else None


TMP_PREFIX = ".tmp-"
"""A folder being written (`write_checkpoint`, `run_checkpoints.copy_tree`): renamed into place
when whole; one left behind was cut off (a SIGKILL, a full disk)."""


OWN_TMP = re.compile(rf"{re.escape(TMP_PREFIX)}({PREFIX}\d+-\d+|model|best_checkpoint)")
"""The temporary folders hlm writes in a run folder (`write_checkpoint`'s, `copy_tree`'s of the
final model and the best checkpoint): only these are its leftovers to remove."""


def remove_leftovers(root: Path) -> list[str]:
    """Remove the half-written `.tmp-*` folders a killed writer of hlm left in run folder `root`
    (only its one writer, `run_lock`, may: another process's could still be in progress). A
    `.tmp-*` folder hlm does not write (`OWN_TMP`) is someone else's, and stays."""
    root = Path(root)
    found = root.glob(f"{TMP_PREFIX}*") if root.is_dir() else []
    gone = [p for p in found if p.is_dir() and OWN_TMP.fullmatch(p.name)]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return sorted(p.name for p in gone)


def _as_saved(model, tokenizer):
    """An encoder's saved tokenizer adds [CLS] ... [SEP] (pairs: [CLS] a [SEP] b [SEP]) as its
    pretraining blocks were framed and as classifiers read them, so `tokenizer(text)` and
    `pipeline(...)` on the folder feed it what it was trained on. Training itself never reads
    this copy (the data path tokenizes with the run's own tokenizer, without special tokens)."""
    if getattr(model.config, "hlm_family", None) != "encoder":
        return tokenizer
    from hlm_ray.classify.template import with_classifier_template  # a leaf module: no cycle

    return with_classifier_template(tokenizer)


def write_manifest(folder: Path, meta: dict[str, Any]) -> None:
    """The marker file, last: `meta` plus every other file's size and sha256."""
    folder = Path(folder)
    files = {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER
    }
    tmp = folder / f".{MARKER}.tmp"
    tmp.write_text(json.dumps({**meta, "files": files}, indent=2))
    os.replace(tmp, folder / MARKER)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# What reading a marker raises when it is empty, half-written, not JSON or without a step.
UNREADABLE = (ValueError, KeyError, TypeError, OSError)


def verify(folder: Path) -> str | None:
    """None when `folder` is a complete checkpoint; else what is wrong with it, in a few words."""
    folder = Path(folder)
    marker = folder / MARKER
    if not marker.is_file():
        return f"no {MARKER} (an interrupted copy)"
    try:
        meta = json.loads(marker.read_text())
        int(meta["step"])
    except UNREADABLE:
        return f"unreadable {MARKER}"
    files = meta.get("files")
    if files is None:  # written before checkpoints had manifests: the files must be there
        legacy = ("train_state.pt", "config.yaml")
        missing = [n for n in legacy if not (folder / n).is_file()]
        return f"{missing[0]} is missing" if missing else None
    if not isinstance(files, dict) or not files:
        return f"{MARKER} lists no files"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want.get("size"):
            return f"{name} has {size} bytes, the manifest says {want.get('size')}"
        if _sha256(path) != want.get("sha256"):
            return f"{name} does not match its checksum"
    return None


def is_checkpoint(folder: Path) -> bool:
    """A folder with the marker (complete when written; `verify` checks its files)."""
    return (Path(folder) / MARKER).is_file()


def checkpoint_step(folder: Path) -> int:
    return int(json.loads((Path(folder) / MARKER).read_text())["step"])


def _folder_step(folder: Path) -> int:
    """The step from the folder's name (checkpoint_00000150 -> 150), -1 if it has none."""
    match = re.fullmatch(rf"{PREFIX}(\d+)", Path(folder).name)
    return int(match.group(1)) if match else -1


def _marker_step(folder: Path) -> int | None:
    """The step the marker names; None without a readable marker (Ray persists a reported
    checkpoint into the run folder file by file, so a marker can be seen half-copied)."""
    try:
        return checkpoint_step(folder)
    except UNREADABLE:
        return None


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoints under `root` whose marker names their step, oldest first (not verified: see
    `latest_valid`, which also reports a folder whose marker is unreadable as damaged)."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = {p: step for p in root.glob(f"{PREFIX}*") if (step := _marker_step(p)) is not None}
    return sorted(steps, key=steps.__getitem__)


def folders(root: Path) -> list[Path]:
    """Every checkpoint_N folder under `root` (complete or not), by step, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"{PREFIX}*") if p.is_dir() and _folder_step(p) >= 0]
    return sorted(found, key=_folder_step)


def newest_valid(root: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest checkpoint that passes `verify`, [(newer damaged folder, why)]). Checks from
    the newest down and stops at the first that passes: older ones are not read."""
    damaged = []
    for folder in reversed(folders(root)):
        problem = verify(folder)
        if problem is None:
            return folder, damaged[::-1]
        damaged.append((folder, problem))
    return None, damaged[::-1]


def describe_damaged(damaged: list[tuple[Path, str]]) -> str:
    return "; ".join(f"{p.name} ({why})" for p, why in damaged)


def latest_valid(root: Path, *, warn: bool = True) -> Path | None:
    """The newest checkpoint under `root` whose files match its manifest; the damaged ones
    newer than it are named in one warning."""
    newest, damaged = newest_valid(root)
    if warn and damaged:
        where = f"resuming from {newest.name}" if newest else "no valid checkpoint left"
        log.warning(
            "skipping damaged checkpoint(s) in %s: %s; %s", root, describe_damaged(damaged), where
        )
    return newest


def set_aside(damaged: list[tuple[Path, str]]) -> list[Path]:
    """Rename damaged folders to damaged-checkpoint_N (kept for inspection, never resumed
    from, and out of the way of the step's next save)."""
    moved = []
    for folder, _ in damaged:
        target = folder.with_name(DAMAGED_PREFIX + folder.name)
        shutil.rmtree(target, ignore_errors=True)
        try:
            folder.rename(target)
        except OSError:
            continue
        moved.append(target)
    return moved


def resolve_resume(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder's newest valid checkpoint; HLMError otherwise.

    An explicit checkpoint folder must pass `verify`; in a run folder, damaged checkpoints are
    skipped (`prepare_resume` sets them aside and says so)."""
    path = Path(path)
    if _folder_step(path) >= 0 or is_checkpoint(path):
        problem = verify(path) if path.is_dir() else "no such folder"
        if problem is None:
            return path
        raise HLMError(
            f"--resume {path}: damaged checkpoint ({problem}); pass the run folder "
            f"{path.parent} to resume from its newest valid checkpoint"
        )
    found = latest_valid(path, warn=False)
    if found is not None:
        return found
    _, damaged = newest_valid(path)
    if damaged:
        raise HLMError(
            f"--resume {path}: every checkpoint is damaged: {describe_damaged(damaged)}; "
            "start a new run with another --output"
        )
    raise HLMError(
        f"--resume {path}: not a checkpoint (no {MARKER}) and no {PREFIX}* folders inside it; "
        "pass a run's output folder or one of its checkpoint_* folders"
    )


def prepare_resume(root: Path, chosen: Path | None, *, explicit: bool = False) -> list[str]:
    """Make the run folder agree with the checkpoint a run continues from: `chosen`, the newest
    valid one (then every newer folder is damaged: set aside), or one the user named
    (`explicit`: newer folders are removed, that work is redone). Ray's run snapshot is dropped
    when it names a folder that is no longer there or not `chosen` (Ray would restore from its
    own idea of the latest, or refuse a "corrupted run directory"). Returns what was done, one
    line each, for the caller to print."""
    root = Path(root)
    notes = []
    left = remove_leftovers(root)
    if left:
        notes.append(f"removed what a cut-off save left half written: {', '.join(left)}")
    step = checkpoint_step(chosen) if chosen is not None else -1
    newer = [p for p in folders(root) if _folder_step(p) > step and p != chosen]
    problems = {p: verify(p) for p in newer}
    superseded = [p for p in newer if explicit and problems[p] is None]
    if superseded:  # whole checkpoints after the one the user named: their steps are redone
        for folder in superseded:
            shutil.rmtree(folder, ignore_errors=True)
        notes.append(
            f"removed checkpoint(s) after step {step}: {', '.join(p.name for p in superseded)} "
            f"(continuing from {chosen.name}, as named)"
        )
    # A damaged folder is never deleted (it may hold what someone needs): set aside, with why.
    newer = [p for p in newer if p not in superseded]
    if newer:
        damaged = [(p, problems[p] or "newer than the one resumed from") for p in newer]
        moved = set_aside(damaged)
        where = f"resuming from {chosen.name}" if chosen is not None else "starting afresh"
        notes.append(
            f"set aside damaged checkpoint(s): {describe_damaged(damaged)}; {where} "
            f"(kept as {', '.join(p.name for p in moved)})"
        )
    snapshot = root / RAY_SNAPSHOT
    if snapshot.is_file():
        named = set(re.findall(rf"{PREFIX}\d+", snapshot.read_text(errors="replace")))
        present = {p.name for p in folders(root)}
        if not named <= present or (chosen is not None and chosen.name not in named):
            snapshot.unlink()
            notes.append(f"dropped Ray's run snapshot (it named {', '.join(sorted(named))})")
    return notes


def refuse_existing(folder: str | Path) -> None:
    """A fresh run must not start in a folder that holds checkpoints (readable or not): it would
    mix with them."""
    if any(is_checkpoint(p) for p in folders(Path(folder))):
        raise HLMError(
            f"{folder} already holds checkpoints; continue it with --resume {folder} "
            "or choose another --output"
        )


def load_train_state(folder: Path) -> dict[str, Any]:
    import torch

    # The file holds our own optimizer/RNG state (numpy arrays, tuples): not weights-only.
    return torch.load(Path(folder) / "train_state.pt", map_location="cpu", weights_only=False)


def prune_checkpoints(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints."""
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
