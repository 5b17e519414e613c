"""What a training run checks before it imports torch or starts anything: its workers and the
folders it will write. Plain Python (no torch, no Ray): `hlm train` answers bad input at once.

    check_workers(args.num_workers, local=args.local)   # 1 or more; --local is one worker
    check_output(Path(cfg.run.output_dir))               # creatable and writable, nothing left
    check_storage(storage_path)                          # Ray's storage: a local folder checked
"""

from __future__ import annotations

import os
from pathlib import Path

from hlm_ray.errors import HLMError


def check_storage(storage_path: str) -> None:
    if "://" in storage_path:
        return  # a remote URI: Ray's pyarrow filesystem reports its own errors
    path = Path(storage_path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".hlm-write-probe-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise HLMError(
            f"storage path {path} is not writable ({err.strerror}); "
            "choose another --output or --storage-path"
        ) from None


def check_output(out_dir: Path) -> None:
    """The run folder can be created and written (checked before any MLflow run is opened)."""
    out_dir = Path(out_dir)
    blocker = next((p for p in [out_dir, *out_dir.parents] if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise HLMError(
            f"output {out_dir}: {blocker} is a file, not a folder; choose another --output"
        )
    created = [p for p in [out_dir, *out_dir.parents] if not p.exists()]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".hlm-write-probe-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
        for folder in created:  # leave no trace: later checks may still refuse the run
            folder.rmdir()
    except OSError as err:
        raise HLMError(
            f"output folder {out_dir} is not writable ({err.strerror}); choose another --output"
        ) from None


def check_workers(num_workers: int, *, local: bool = False) -> None:
    """1 or more Ray Train workers; `local` (this process, no Ray) is one worker."""
    if local and num_workers != 1:
        raise HLMError(
            f"--local trains in this process, one worker, not --num-workers {num_workers}: drop "
            "--local to train on Ray Train workers, or drop --num-workers"
        )
    if num_workers < 1:
        raise HLMError(f"--num-workers {num_workers}: use 1 or more (Ray Train workers)")
