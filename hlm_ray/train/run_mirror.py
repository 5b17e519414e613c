"""A run folder's copy in its run storage, where the storage is not the run folder's parent.

Ray Train keeps a run's checkpoints in `<storage_path>/<run name>`. By default the storage path
is the run folder's parent, so that folder *is* the run folder (`run.output_dir`), on a disk the
nodes share. With any other storage path (an `s3://` bucket, a shared volume the run folder is
not on), the run folder is only where the process writing it runs: rank 0's node for
metrics.jsonl, the model and the summary; the driver's node for the MLflow run id. The mirror
keeps the run folder's files in the storage, beside Ray's checkpoints, so that the driver gets
rank 0's results after the fit, and a rank 0 restarted on another node continues the metric
history instead of starting a blank one.

    mirror = RunMirror.of(out_dir, storage_path)   # None: the storage holds the run folder
    mirror.push(out_dir, PROGRESS)                  # rank 0, at each checkpoint
    mirror.push(out_dir, RESULTS)                   # rank 0, at the end
    mirror.pull(out_dir, RESULTS)                   # the driver, after the fit

A path is pushed whole (a folder replaces the mirror's); what is not in the run folder is left
out. A file appears in an object store only when completely written; a folder's completeness is
its own manifest's business (a checkpoint's `hlm_checkpoint.json`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hlm_ray.tracking.base import RUN_REF_FILE
from hlm_ray.train.checkpoint import BEST

PROGRESS = ("metrics.jsonl", "params.json", BEST)
"""What a restarted rank 0 needs to continue: the history, the logged params, the best copy."""
RESULTS = (*PROGRESS, "summary.json", "config.yaml", "model", "loss_curve.png")
"""What a finished run leaves: rank 0's whole output."""
RUN_REF = (RUN_REF_FILE, "launch.json")
"""The driver's part: the MLflow run's id and status (`hlm sync` and a sweep read it), and how
`hlm train` launched it (`train.resume.LAUNCH_FILE`: a run continued from the storage alone)."""


@dataclass(frozen=True)
class RunMirror:
    uri: str
    """`<storage_path>/<run name>`: Ray's folder of the run, where its checkpoints are."""

    @classmethod
    def of(cls, out_dir: Path, storage_path: str | None) -> RunMirror | None:
        """The mirror of run folder `out_dir` in `storage_path`, or None when the storage is
        the run folder's own parent (nothing to mirror)."""
        if storage_path is None:
            return None
        if "://" not in storage_path and Path(storage_path).resolve() == out_dir.parent:
            return None
        return cls(f"{storage_path.rstrip('/')}/{out_dir.name}")

    def _store(self):
        from hlm_ray.prepare.store import Store

        return Store.open(self.uri)

    def push(self, out_dir: Path, names: tuple[str, ...]) -> None:
        store = self._store()
        for name in names:
            if (Path(out_dir) / name).exists():
                store.upload(Path(out_dir) / name, name)

    def pull(self, out_dir: Path, names: tuple[str, ...]) -> list[str]:
        """The mirror's copies of `names` into `out_dir`; the names it had."""
        store = self._store()
        return [name for name in names if store.download(name, Path(out_dir) / name)]

    def has_checkpoints(self) -> bool:
        """Whether Ray holds checkpoints of a run of this name in the storage already."""
        from hlm_ray.train.checkpoint import PREFIX

        return any(n.startswith(PREFIX) for n in self._store().names())
