"""Where runs are recorded: a five-method tracker interface.

    tracker = JsonlTracker(output_dir)        # metrics.jsonl + params.json in the run folder
    tracker.log_params(cfg.to_dict()); tracker.log_metrics({"train/loss": 2.3}, step=10)
    tracker.set_tags({...}); tracker.log_artifact(path); tracker.finish("FINISHED")

`Tracker` itself is the no-op used on non-zero ranks and in tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hlm_ray.config import flatten


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
    path = Path(folder) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
