"""Where runs are recorded: the only package that imports mlflow (and only inside functions, so
importing it stays cheap).

- `base`: the five-method `Tracker` contract (its no-op is used on non-zero ranks and in tests),
  `JsonlTracker` (metrics.jsonl + params.json), `MultiTracker`, `read_metrics`, and the run
  folder's reference to its MLflow run (`read_run_ref` / `write_run_ref`);
- `store`: where the MLflow store is (`default_tracking_uri`), the reachability probe, limits,
  how to open a run in the browser afterwards (`browse_hint`);
- `mlflow_tracker`: `MlflowTracker`, one MLflow run that never stops training;
- `registry`: `register_model` / `download_model` (``models:/NAME/VERSION``);
- `server`: the local ``mlflow server`` a sweep's concurrent trials log through.

    from hlm_ray.tracking import JsonlTracker, MlflowTracker, MultiTracker, default_tracking_uri
    tracker = MultiTracker(JsonlTracker(out_dir), MlflowTracker("hlm", run_name="tiny"))
    tracker.log_metrics({"train/loss": 2.3}, step=10); tracker.finish("FINISHED")

MLflow's usage telemetry is turned off for hlm's processes (``MLFLOW_DISABLE_TELEMETRY=true``
unless set) before mlflow can be imported: its background thread, which reaches out to the
network when mlflow is imported, adds and removes ``_MLFLOW_TELEMETRY_SESSION_ID`` in
``os.environ`` while the process reads its environment elsewhere, and a copy of the environment
taken at that moment raised KeyError in a sweep trial and turned its tracking off.
"""

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from hlm_ray.tracking.base import (
    RUN_REF_FILE,
    JsonlTracker,
    MultiTracker,
    Tracker,
    read_metrics,
    read_run_ref,
    write_run_ref,
)
from hlm_ray.tracking.mlflow_tracker import RUN_STATUSES, MlflowTracker
from hlm_ray.tracking.registry import REGISTRY_SCHEME, download_model, register_model
from hlm_ray.tracking.store import (
    MLFLOW_DIR_ENV,
    TRACKING_URI_ENV,
    browse_hint,
    default_tracking_uri,
    mlflow_dir,
)

__all__ = [
    "MLFLOW_DIR_ENV",
    "REGISTRY_SCHEME",
    "RUN_REF_FILE",
    "RUN_STATUSES",
    "TRACKING_URI_ENV",
    "JsonlTracker",
    "MlflowTracker",
    "MultiTracker",
    "Tracker",
    "browse_hint",
    "default_tracking_uri",
    "download_model",
    "mlflow_dir",
    "read_metrics",
    "read_run_ref",
    "register_model",
    "write_run_ref",
]
