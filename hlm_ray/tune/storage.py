"""Where a sweep keeps its state and its trials: its folder, or a run storage every node reaches.

    store = SweepStorage.of(folder, "s3://bucket/sweeps", "vocab-tiny")
    store.tune_path              # Ray Tune's storage: s3://bucket/sweeps/vocab-tiny
    store.trials                 # the trials' run storage: .../vocab-tiny/trials (None: the folder)
    store.pull_state()           # sweep.json from the storage, when this machine has none
    store.push_state()           # after each write of it
    store.pull_trials(runs)      # each trial's summary, scores and MLflow run id, for the report

By default everything is in the sweep's folder (`runs/sweeps/<name>`), which on a cluster of
several nodes must be on a volume they all mount. With `--storage-path` (an `s3://` URI, or a
shared folder) Tune's experiment state and the trials' checkpoints and run folders go there,
under the sweep's name; the folder keeps the summary, the figures and the logs, written by the
driver, and a copy of what the report reads from each trial. The sweep's `sweep.json` is kept
in both, so a sweep resubmitted from a machine without its folder (a new head node) resumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hlm_ray.errors import HLMError
from hlm_ray.tracking.base import RUN_REF_FILE
from hlm_ray.train.run_mirror import RunMirror

STATE_FILE = "sweep.json"
TUNE_DIR = "tune"
TRIALS_DIR = "trials"
TRIAL_FILES = ("summary.json", "downstream.json", RUN_REF_FILE, "metrics.jsonl")
"""What the driver reads from each trial's run folder (report, summary, closing runs)."""


@dataclass(frozen=True)
class SweepStorage:
    folder: Path
    remote: str | None = None
    """`<storage path>/<sweep name>`, or None: everything in `folder`."""

    @classmethod
    def of(cls, folder: Path, storage_path: str | None, name: str) -> SweepStorage:
        if storage_path is None:
            return cls(folder)
        if "://" not in storage_path:
            storage_path = str(Path(storage_path).expanduser().resolve())
            if Path(storage_path) / name == folder:
                return cls(folder)
        return cls(folder, f"{storage_path.rstrip('/')}/{name}")

    @property
    def tune_path(self) -> str:
        """Ray Tune's `storage_path` (its experiment folder is `tune` under it)."""
        return self.remote or str(self.folder)

    @property
    def trials(self) -> str | None:
        """The trials' Ray Train storage; None: their run folders, in `folder/trials`."""
        return f"{self.remote}/{TRIALS_DIR}" if self.remote else None

    def _store(self):
        from hlm_ray.prepare.store import Store

        return Store.open(self.remote)

    def pull_state(self) -> None:
        if self.remote and not (self.folder / STATE_FILE).is_file():
            self._store().download(STATE_FILE, self.folder / STATE_FILE)

    def push_state(self) -> None:
        if self.remote:
            self._store().upload(self.folder / STATE_FILE, STATE_FILE)

    def check_same(self, state: dict | None) -> None:
        """A sweep resumes from the storage it started with."""
        before = (state or {}).get("storage")
        if state is not None and before != self.remote:
            raise HLMError(
                f"sweep {self.folder.name} keeps its trials in {before or self.folder}, not "
                f"{self.remote or self.folder}; resume it with the --storage-path it started with"
            )

    def pull_trials(self, runs: list[str]) -> None:
        """Each trial's `TRIAL_FILES` from its mirror into `folder/trials/<run>`."""
        if not self.remote:
            return
        for run in runs:
            RunMirror(f"{self.trials}/{run}").pull(self.folder / TRIALS_DIR / run, TRIAL_FILES)

    def tuner_exists(self) -> bool:
        from ray import tune

        path = f"{self.tune_path}/{TUNE_DIR}"
        if not self.remote and not Path(path).is_dir():
            return False
        return tune.Tuner.can_restore(path)
