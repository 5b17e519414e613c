"""The tracker contract and its local implementations; where a run folder names its MLflow run.

    tracker = JsonlTracker(output_dir)        # metrics.jsonl + params.json in the run folder
    tracker.log_params(cfg.to_dict()); tracker.log_metrics({"train/loss": 2.3}, step=10)
    tracker.set_tags({...}); tracker.log_artifact(path); tracker.finish("FINISHED")
    tracker = MultiTracker(JsonlTracker(output_dir), MlflowTracker(...))
    read_metrics(output_dir)                  # the rows of metrics.jsonl
    read_run_ref(output_dir)                  # {"run_id", "tracking_uri"} of its MLflow run, or None

`Tracker` itself is the no-op used on non-zero ranks and in tests.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hlm_ray.config import flatten
from hlm_ray.errors import HLMError

log = logging.getLogger(__name__)

RUN_REF_FILE = "mlflow_run.json"
"""In a run folder: the id and tracking URI of the run's MLflow run (written by
`hlm_ray.train.launch.open_mlflow_run`), so a resumed run, a restarted worker group, a sweep
trial and `hlm finetune` / `hlm eval` all log to the same run."""
DOWNSTREAM_FILE = "downstream.json"
"""In a sweep trial's run folder: the scores of its downstream step ({metric: value}), which the
step logged to the run's MLflow run at step 0; `hlm sync` replays them as it does metrics.jsonl."""


class Tracker:
    def log_params(self, params: dict[str, Any]) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def finish(self, status: str = "FINISHED") -> None: ...


class JsonlTracker(Tracker):
    """Appends one JSON line per `log_metrics` call to `<folder>/metrics.jsonl`."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.folder / "metrics.jsonl"

    def log_params(self, params: dict[str, Any]) -> None:
        flat = dict(flatten(params))
        (self.folder / "params.json").write_text(json.dumps(flat, indent=1, default=str))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


class MultiTracker(Tracker):
    def __init__(self, *trackers: Tracker):
        self.trackers = trackers

    def log_params(self, params):
        for t in self.trackers:
            t.log_params(params)

    def set_tags(self, tags):
        for t in self.trackers:
            t.set_tags(tags)

    def log_metrics(self, metrics, step):
        for t in self.trackers:
            t.log_metrics(metrics, step)

    def log_artifact(self, path, artifact_path=None):
        for t in self.trackers:
            t.log_artifact(path, artifact_path)

    def finish(self, status="FINISHED"):
        for t in self.trackers:
            t.finish(status)


def read_metrics(folder: str | Path) -> list[dict[str, Any]]:
    """The rows of `<folder>/metrics.jsonl`. A line that is not a whole row (a JSON object
    with an integer "step"), such as the torn tail a write cut by a full disk or a power loss
    leaves (`{"step": 45, "train/lo`), is left out with one warning naming it: the rows around
    it are still read, resumed from and synced."""
    path = Path(folder) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows, torn = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            torn.append((number, line))
    if torn:
        _warn_torn(path, torn)
    return rows


_warned: set[tuple[str, tuple[int, ...]]] = set()


def _warn_torn(path: Path, torn: list[tuple[int, str]]) -> None:
    """Once per process and file state: the file is read many times in a run's life."""
    key = (str(path), tuple(n for n, _ in torn))
    if key in _warned:
        return
    _warned.add(key)
    number, text = torn[0]
    more = f" and {len(torn) - 1} more line(s)" if len(torn) > 1 else ""
    log.warning(
        "%s: line %d (%s)%s is not a whole metrics row (a write cut short, by a full disk or a "
        "power loss?); left out, the other rows are read (a resumed run rewrites the file "
        "without it)",
        path, number, text[:40] + ("..." if len(text) > 40 else ""), more,
    )  # fmt: skip


def read_run_ref(folder: str | Path) -> dict[str, Any] | None:
    """The MLflow run a run folder belongs to: ``{"run_id": ..., "tracking_uri": ...}`` from its
    `RUN_REF_FILE`, or None when it has none (never tracked, or a bare model folder). A damaged
    file is one `HLMError` that says what to do."""
    from hlm_ray.jsonl import json_file

    path = Path(folder) / RUN_REF_FILE
    if not path.is_file():
        return None
    fix = (
        "it names the run's MLflow run: restore it (`mlflow ui` shows the run's id), or delete "
        f"it to continue {Path(folder).name} in a new MLflow run"
    )
    ref = json_file(path, fix=fix)
    if not isinstance(ref.get("run_id"), str):
        raise HLMError(f"{path} is damaged (it names no run_id); {fix}")
    return ref


def write_run_ref(folder: str | Path, run_id: str, tracking_uri: str) -> None:
    """Record the run folder's MLflow run (read back by `read_run_ref`), and where the folder
    was when it did (`copied_from` tells a copy of the folder from the folder itself)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ref = {"run_id": run_id, "tracking_uri": tracking_uri, "folder": str(folder.resolve())}
    (folder / RUN_REF_FILE).write_text(json.dumps(ref))


def copied_from(folder: str | Path, ref: dict[str, Any]) -> Path | None:
    """The run folder `folder` is a copy of, when its `ref` (`read_run_ref`) was written in
    another folder that still exists and still names the same MLflow run; None for the folder
    itself, or one that was moved (the original is gone or names another run)."""
    recorded = ref.get("folder")
    if not isinstance(recorded, str) or Path(recorded).resolve() == Path(folder).resolve():
        return None
    try:
        original = read_run_ref(recorded)
    except HLMError:
        return None
    return Path(recorded) if original and original["run_id"] == ref["run_id"] else None
