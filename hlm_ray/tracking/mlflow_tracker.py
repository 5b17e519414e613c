"""The MLflow tracker: one MLflow run behind the `Tracker` contract.

    uri = default_tracking_uri()          # $MLFLOW_TRACKING_URI, else sqlite:///<root>/mlflow.db
    ml = MlflowTracker("hlm", run_name="tiny-headless", tracking_uri=uri, tags={"preset": "tiny"})
    save(ml.run_id)                       # persist it: a restarted worker group passes it back
    ml = MlflowTracker("hlm", run_id=saved_id)               # ...and continues the same run
    tracker = MultiTracker(JsonlTracker(output_dir), ml)
    tracker.finish("FINISHED")

MLflow is imported only inside functions, so importing this module stays cheap. A new run is
tagged with `git_commit()` (``mlflow.source.git.commit``) and the user; `parent_run_id` nests it.

Tracking never stops training: if the store cannot be reached or a call fails, `MlflowTracker`
logs one warning saying why and ignores every later call (the JSONL tracker keeps recording).
An unreachable HTTP server is detected up front with a short TCP probe; a server that goes away
mid-run costs one short stall: `store.bound_http_waits` gives MLflow's HTTP client a 5 s timeout
and one retry unless ``MLFLOW_HTTP_REQUEST_TIMEOUT`` / ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` /
``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR`` are set (MLflow's defaults wait minutes). What MLflow
missed is in ``metrics.jsonl``; `hlm_ray.tracking.sync` replays it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hlm_ray.config import flatten
from hlm_ray.errors import one_line
from hlm_ray.paths import git_commit
from hlm_ray.tracking import store
from hlm_ray.tracking.base import Tracker
from hlm_ray.tracking.store import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VALUE,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VALUE,
    artifact_location,
    bound_http_waits,
    chunks,
    clip,
    default_tracking_uri,
    is_number,
    log_tags,
    mlflow_user,
    redact,
    sqlite_path,
)

log = logging.getLogger(__name__)

RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
# MLflow 3.x's UI opens an experiment without this tag on its GenAI pages (traces, an assistant);
# "custom_model_development" opens runs, charts and models: what a training experiment is.
EXPERIMENT_TAGS = {EXPERIMENT_KIND_TAG: "custom_model_development"}
NOTE_TAG = "mlflow.note.content"
"""A run's description (Markdown), shown first on its page."""


class MlflowTracker(Tracker):
    """One MLflow run, written through an explicit `MlflowClient` and the run id.

    No fluent (`mlflow.start_run`) state is touched, so several trackers can live in one process
    and nested sweep runs work. Given `run_id`, the existing run is resumed (set back to RUNNING)
    instead of a new one being created: a restarted Ray worker group must continue its run.

    `run_id` is None when no run could be started or resumed; `active` turns False after the
    first failure, from which point every call is a no-op (one warning, see the module doc).
    """

    def __init__(
        self,
        experiment: str,
        run_name: str | None = None,
        *,
        tracking_uri: str | None = None,
        run_id: str | None = None,
        parent_run_id: str | None = None,
        tags: dict[str, Any] | None = None,
    ):
        bound_http_waits()
        self.experiment = experiment
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.disabled_reason: str | None = None
        self._client: Any = None
        try:
            self._start(run_name, run_id, parent_run_id, tags or {})
        except Exception as exc:  # tracking must never stop training
            self.run_id = None
            self._disable(f"resuming run {run_id}" if run_id else "starting a run", exc)

    @property
    def active(self) -> bool:
        return self.run_id is not None and self.disabled_reason is None

    # ------------------------------------------------------------------------- the interface

    def log_params(self, params: dict[str, Any]) -> None:
        flat = {key: clip(str(value), MAX_PARAM_VALUE) for key, value in flatten(params)}

        def call(client, run_id):
            from mlflow.entities import Param

            # MLflow raises on a changed value and the restart of a resumed run re-logs them
            # all: send only new keys; a changed one (e.g. an override on resume) goes to a tag.
            logged = client.get_run(run_id).data.params
            new = [Param(k, v) for k, v in flat.items() if k not in logged]
            changed = {k: v for k, v in flat.items() if k in logged and logged[k] != v}
            for chunk in chunks(new, MAX_PARAMS_TAGS_PER_BATCH):
                client.log_batch(run_id, params=chunk, synchronous=True)
            if changed:
                log.warning(
                    "MLflow run %s already has different values for %s; the new values are "
                    "kept as 'param_changed.*' tags",
                    run_id,
                    ", ".join(sorted(changed)),
                )
                log_tags(client, run_id, {f"param_changed.{k}": v for k, v in changed.items()})

        self._call("log_params", call)

    def set_tags(self, tags: dict[str, Any]) -> None:
        flat = dict(flatten(tags))
        self._call("set_tags", lambda client, run_id: log_tags(client, run_id, flat))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        def call(client, run_id):
            from mlflow.entities import Metric

            now_ms = int(time.time() * 1000)
            entries = [
                Metric(key, float(value), now_ms, int(step))
                for key, value in metrics.items()
                if is_number(value)  # a stray string or None must not cost the whole batch
            ]
            for chunk in chunks(entries, MAX_METRICS_PER_BATCH):
                client.log_batch(run_id, metrics=chunk, synchronous=True)

        self._call("log_metrics", call)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file (to `<artifact_path>/<name>`) or a folder's contents.

        A folder's contents go under `artifact_path` when given (``log_artifact(out / "model",
        "model")`` gives ``model/config.json``, as `MlflowClient.log_artifacts` does), else
        under the folder's own name, so a bare call keeps the name as it does for a file.
        """
        local = Path(path)
        if self.active and not local.exists():
            # The caller's mistake, not the store's: say so but keep tracking on.
            log.warning("MLflow: not logging artifact %s: no such file or folder", local)
            return

        def call(client, run_id):
            if local.is_dir():
                client.log_artifacts(run_id, str(local), artifact_path or local.name)
            else:
                client.log_artifact(run_id, str(local), artifact_path)

        self._call("log_artifact", call)

    def status(self) -> str | None:
        """The run's status in the store (None when tracking is off or the store cannot say)."""
        if not self.active:
            return None
        try:
            return self._get_client().get_run(self.run_id).info.status
        except Exception:
            return None

    def artifacts(self) -> set[str]:
        """The run's top-level artifact paths (empty when tracking is off)."""
        if not self.active:
            return set()
        try:
            return {a.path for a in self._get_client().list_artifacts(self.run_id)}
        except Exception as exc:  # tracking must never stop training
            self._disable("listing the run's artifacts", exc)
            return set()

    def last_step(self, key: str) -> int:
        """The last step of metric `key` the run holds (-1: none, or tracking is off): what an
        earlier attempt of the run sent already."""
        if not self.active:
            return -1
        try:
            history = self._get_client().get_metric_history(self.run_id, key)
        except Exception as exc:  # tracking must never stop training
            self._disable("reading the run's metric history", exc)
            return -1
        return max((m.step for m in history), default=-1)

    def finish(self, status: str = "FINISHED") -> None:
        """End the run. FAILED never replaces a status the run already ended with: a sweep marks
        a trial it stopped KILLED while the trial's process is still going down, and that
        process's last act may be to catch the error of its own shutdown."""
        status = status.upper()
        if status not in RUN_STATUSES:
            raise ValueError(f"run status must be one of {', '.join(RUN_STATUSES)}: {status!r}")

        def call(client, run_id):
            if status == "FAILED" and client.get_run(run_id).info.status != "RUNNING":
                return
            client.set_terminated(run_id, status)

        self._call("finish", call)

    # ------------------------------------------------------------------------------ internals

    def _start(
        self,
        run_name: str | None,
        run_id: str | None,
        parent_run_id: str | None,
        tags: dict[str, Any],
    ) -> None:
        store.probe(self.tracking_uri)
        db = sqlite_path(self.tracking_uri)
        if db is not None:
            from hlm_ray.tracking.server import creating_store

            # A new store is migrated when its client is made; two runs started at once both
            # migrated it and one ran untracked ("duplicate column name: step"). The first to
            # take the lock creates it (the folder too: sqlite makes the file only), the others
            # wait for it.
            with creating_store(db) as fresh:
                if fresh:
                    self._get_client().search_experiments(max_results=1)
        client = self._get_client()
        extra = {k: clip(str(v), MAX_TAG_VALUE) for k, v in flatten(tags) if v is not None}
        if parent_run_id:
            extra["mlflow.parentRunId"] = parent_run_id
        if run_id is not None:
            run = client.get_run(run_id)  # raises if it does not exist: never start a second one
            if run.info.lifecycle_stage == "deleted":
                client.restore_run(run_id)
            if run.info.status != "RUNNING":
                client.update_run(run_id, status="RUNNING")
            log_tags(client, run_id, extra)
            self.experiment_id = run.info.experiment_id
            self.run_id = run_id
            return
        defaults = {"mlflow.user": mlflow_user()}
        commit = git_commit()
        if commit:
            defaults["mlflow.source.git.commit"] = commit
        self.experiment_id = self._experiment_id(client)
        run = client.create_run(
            self.experiment_id,
            start_time=int(time.time() * 1000),
            tags={**defaults, **extra},
            run_name=run_name,
        )
        self.run_id = run.info.run_id

    def _experiment_id(self, client) -> str:
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                return client.create_experiment(
                    self.experiment,
                    artifact_location=artifact_location(self.tracking_uri),
                    tags=EXPERIMENT_TAGS,
                )
            except Exception:
                # Another process may have created it between the lookup and the create.
                exp = client.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            # A deleted experiment still owns its name; bring it back rather than fail.
            client.restore_experiment(exp.experiment_id)
        if EXPERIMENT_KIND_TAG not in exp.tags:  # made before hlm said what it is, or by hand
            client.set_experiment_tag(
                exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_TAGS[EXPERIMENT_KIND_TAG]
            )
        return exp.experiment_id

    def _get_client(self):
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _call(self, what: str, fn: Callable[[Any, str], None]) -> None:
        if not self.active:
            return
        try:
            fn(self._get_client(), self.run_id)
        except Exception as exc:  # tracking must never stop training
            self._disable(what, exc)

    def _disable(self, what: str, exc: BaseException) -> None:
        if self.disabled_reason is not None:
            return
        reason = f"{type(exc).__name__}: {one_line(exc, limit=300, empty='(no message)')}"
        self.disabled_reason = reason
        if isinstance(exc, ImportError) and (exc.name or "").split(".")[0] == "mlflow":
            # A bare node (no mlflow): one line, and the JSONL keeps the run for `hlm sync`.
            self.disabled_reason = "mlflow is not installed"
            log.warning(
                "MLflow tracking is off: mlflow is not installed; the run's metrics.jsonl keeps "
                "everything (`hlm sync RUN` sends it to MLflow where mlflow is installed)"
            )
            return
        log.warning(
            "MLflow tracking is off for the rest of this run (%s at %s failed): %s",
            what,
            redact(self.tracking_uri),
            reason,
        )

    # A tracker may be built in a driver and shipped to a Ray worker: the client is rebuilt there.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}

    def __repr__(self) -> str:
        state = "active" if self.active else f"off ({self.disabled_reason})"
        return (
            f"MlflowTracker({self.experiment!r}, run_id={self.run_id!r}, "
            f"uri={redact(self.tracking_uri)!r}, {state})"
        )
