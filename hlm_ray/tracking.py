"""Where runs are recorded: a five-method tracker interface, a local JSONL one and MLflow.

    tracker = JsonlTracker(output_dir)        # metrics.jsonl + params.json in the run folder
    tracker.log_params(cfg.to_dict()); tracker.log_metrics({"train/loss": 2.3}, step=10)
    tracker.set_tags({...}); tracker.log_artifact(path); tracker.finish("FINISHED")

`Tracker` itself is the no-op used on non-zero ranks and in tests.

MLflow (the only module in the project that imports it, and only inside functions, so importing
this module stays cheap):

    uri = default_tracking_uri()          # $MLFLOW_TRACKING_URI, else sqlite:///<root>/mlflow.db
    ml = MlflowTracker("hlm", run_name="tiny-headless", tracking_uri=uri, tags={"preset": "tiny"})
    save(ml.run_id)                       # persist it: a restarted worker group passes it back
    ml = MlflowTracker("hlm", run_id=saved_id)               # ...and continues the same run
    tracker = MultiTracker(JsonlTracker(output_dir), ml)
    ...
    tracker.log_artifact(plot_loss_curve(read_metrics(output_dir), output_dir / "loss.png"))
    tracker.finish("FINISHED")

Without a tracking server everything lands in `<root>/mlflow.db` with artifacts in
`<root>/mlartifacts` (`<root>` is the project folder, or ``$HLM_MLFLOW_DIR``); view it with
``mlflow ui --backend-store-uri sqlite:///mlflow.db`` run in that folder. A new run is tagged
with `git_commit()` (``mlflow.source.git.commit``) and the user; `parent_run_id` nests it.

Tracking never stops training: if the store cannot be reached or a call fails, `MlflowTracker`
logs one warning saying why and ignores every later call (the JSONL tracker keeps recording).
An unreachable HTTP server is detected up front with a short TCP probe; a server that goes away
mid-run costs one stall of MLflow's own retries (minutes by default: bound it with
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` and ``MLFLOW_HTTP_REQUEST_TIMEOUT``).
"""

from __future__ import annotations

import getpass
import json
import logging
import math
import os
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hlm_ray.config import flatten
from hlm_ray.paths import project_root

log = logging.getLogger(__name__)

MLFLOW_DIR_ENV = "HLM_MLFLOW_DIR"
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")

# MLflow's per-request limits (mlflow.utils.validation, 3.17): params and tags share one budget
# of 100 per log_batch; longer values are rejected (tags) or truncated with a warning (params).
_MAX_PARAMS_TAGS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAM_VALUE = 6000
_MAX_TAG_VALUE = 8000
_PROBE_TIMEOUT_S = 3.0


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


# --------------------------------------------------------------------------------------- MLflow


def mlflow_dir() -> Path:
    """The folder of the embedded store: ``$HLM_MLFLOW_DIR``, else the project root."""
    value = os.environ.get(MLFLOW_DIR_ENV)
    return Path(value).expanduser().resolve() if value else project_root()


def default_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<mlflow_dir()>/mlflow.db``.

    A relative sqlite path is made absolute here: Ray workers run in other working directories,
    so a driver should resolve the URI once and hand the result to its workers.
    """
    uri = os.environ.get(TRACKING_URI_ENV, "").strip()
    if not uri:
        return f"sqlite:///{mlflow_dir() / 'mlflow.db'}"
    db = _sqlite_path(uri)
    if db is not None and not db.is_absolute():
        query = uri.partition("?")[2]
        return f"sqlite:///{db.resolve()}" + (f"?{query}" if query else "")
    return uri


def git_commit(folder: str | Path | None = None) -> str | None:
    """``git rev-parse HEAD`` in `folder` (default: the project root); None outside a repo."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=folder or project_root(),
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):  # no git binary, missing folder, hung git
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and sha else None


def plot_loss_curve(
    metrics_rows: Iterable[dict[str, Any]], out_png: str | Path, *, title: str | None = None
) -> Path:
    """`train/loss` and `val/loss` against `step` (rows as from `read_metrics`) as a PNG."""
    # The object-oriented API with no pyplot: it never switches the process's global backend
    # (Agg is what Figure.savefig uses for PNG) and never opens windows.
    from matplotlib.figure import Figure

    rows = list(metrics_rows)
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    plotted = False
    for key, style in (("train/loss", "-"), ("val/loss", "o-")):
        points = [
            (row["step"], float(row[key]))
            for row in rows
            if "step" in row and _is_number(row.get(key)) and math.isfinite(float(row[key]))
        ]
        if points:
            steps, values = zip(*sorted(points), strict=True)
            ax.plot(steps, values, style, label=key, markersize=3)
            plotted = True
    if plotted:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no loss logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


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
        self.experiment = experiment
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.run_id: str | None = None
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
        flat = {key: _clip(str(value), _MAX_PARAM_VALUE) for key, value in flatten(params)}

        def call(client, run_id):
            from mlflow.entities import Param

            # MLflow raises on a changed value and the restart of a resumed run re-logs them
            # all: send only new keys; a changed one (e.g. an override on resume) goes to a tag.
            logged = client.get_run(run_id).data.params
            new = [Param(k, v) for k, v in flat.items() if k not in logged]
            changed = {k: v for k, v in flat.items() if k in logged and logged[k] != v}
            for chunk in _chunks(new, _MAX_PARAMS_TAGS_PER_BATCH):
                client.log_batch(run_id, params=chunk, synchronous=True)
            if changed:
                log.warning(
                    "MLflow run %s already has different values for %s; the new values are "
                    "kept as 'param_changed.*' tags",
                    run_id,
                    ", ".join(sorted(changed)),
                )
                _log_tags(client, run_id, {f"param_changed.{k}": v for k, v in changed.items()})

        self._call("log_params", call)

    def set_tags(self, tags: dict[str, Any]) -> None:
        flat = dict(flatten(tags))
        self._call("set_tags", lambda client, run_id: _log_tags(client, run_id, flat))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        def call(client, run_id):
            from mlflow.entities import Metric

            now_ms = int(time.time() * 1000)
            entries = [
                Metric(key, float(value), now_ms, int(step))
                for key, value in metrics.items()
                if _is_number(value)  # a stray string or None must not cost the whole batch
            ]
            for chunk in _chunks(entries, _MAX_METRICS_PER_BATCH):
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

    def finish(self, status: str = "FINISHED") -> None:
        status = status.upper()
        if status not in RUN_STATUSES:
            raise ValueError(f"run status must be one of {', '.join(RUN_STATUSES)}: {status!r}")
        self._call("finish", lambda client, run_id: client.set_terminated(run_id, status))

    # ------------------------------------------------------------------------------ internals

    def _start(
        self,
        run_name: str | None,
        run_id: str | None,
        parent_run_id: str | None,
        tags: dict[str, Any],
    ) -> None:
        _probe(self.tracking_uri)
        db = _sqlite_path(self.tracking_uri)
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)  # sqlite creates the file, not folders
        client = self._get_client()
        extra = {k: _clip(str(v), _MAX_TAG_VALUE) for k, v in flatten(tags) if v is not None}
        if parent_run_id:
            extra["mlflow.parentRunId"] = parent_run_id
        if run_id is not None:
            run = client.get_run(run_id)  # raises if it does not exist: never start a second one
            if run.info.lifecycle_stage == "deleted":
                client.restore_run(run_id)
            if run.info.status != "RUNNING":
                client.update_run(run_id, status="RUNNING")
            _log_tags(client, run_id, extra)
            self.run_id = run_id
            return
        defaults = {"mlflow.user": _user()}
        commit = git_commit()
        if commit:
            defaults["mlflow.source.git.commit"] = commit
        run = client.create_run(
            self._experiment_id(client),
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
                    self.experiment, artifact_location=_artifact_location(self.tracking_uri)
                )
            except Exception:
                # Another process may have created it between the lookup and the create.
                exp = client.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            # A deleted experiment still owns its name; bring it back rather than fail.
            client.restore_experiment(exp.experiment_id)
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
        reason = f"{type(exc).__name__}: {_first_line(str(exc))}"
        self.disabled_reason = reason
        log.warning(
            "MLflow tracking is off for the rest of this run (%s at %s failed): %s",
            what,
            _redact(self.tracking_uri),
            reason,
        )

    # A tracker may be built in a driver and shipped to a Ray worker: the client is rebuilt there.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}

    def __repr__(self) -> str:
        state = "active" if self.active else f"off ({self.disabled_reason})"
        return (
            f"MlflowTracker({self.experiment!r}, run_id={self.run_id!r}, "
            f"uri={_redact(self.tracking_uri)!r}, {state})"
        )


# ------------------------------------------------------------------------------ model registry

REGISTRY_SCHEME = "models:/"
REGISTERED_ARTIFACT = "registered_model"


def register_model(
    model_dir: str | Path,
    name: str,
    *,
    run_id: str | None = None,
    experiment: str = "hlm_ray",
    tracking_uri: str | None = None,
    extra_files: Iterable[str | Path] = (),
    results: dict[str, Any] | None = None,
    tags: dict[str, Any] | None = None,
) -> tuple[str, int]:
    """Register the model folder as a new version of `name`; returns (name, version).

    The folder (weights, config, tokenizer) plus `extra_files` (e.g. the hlm_ray config) and
    `results` (written as ``eval_results.json``) are logged under the run's
    ``registered_model/`` artifact, and that artifact is the version's source, so
    ``download_model("models:/NAME/VERSION")`` gives back a folder `load_pretrained` reads.
    Without `run_id` a run is created to hold the artifacts. Unlike training, registration is
    what the user asked for: failures raise (HLMError) rather than being skipped."""
    import shutil
    import tempfile

    from hlm_ray.errors import HLMError

    uri = tracking_uri or default_tracking_uri()
    try:
        _probe(uri)
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            run_id = MlflowTracker(experiment, f"register-{name}", tracking_uri=uri).run_id
            if run_id is None:
                raise HLMError(f"cannot open an MLflow run at {_redact(uri)} to register {name}")
            client.set_terminated(run_id, "FINISHED")
        with tempfile.TemporaryDirectory(prefix="hlm-register-") as tmp:
            folder = Path(tmp) / REGISTERED_ARTIFACT
            shutil.copytree(model_dir, folder)
            for extra in extra_files:
                shutil.copy(extra, folder / Path(extra).name)
            if results is not None:
                (folder / "eval_results.json").write_text(json.dumps(results, indent=1))
            client.log_artifacts(run_id, str(folder), REGISTERED_ARTIFACT)
        source = f"{client.get_run(run_id).info.artifact_uri}/{REGISTERED_ARTIFACT}"
        try:
            client.create_registered_model(name)
        except MlflowException as err:
            if "RESOURCE_ALREADY_EXISTS" not in str(err.error_code):
                raise
        version_tags = {k: _clip(str(v), _MAX_TAG_VALUE) for k, v in flatten(tags or {})}
        for key, value in flatten(results or {}):
            if _is_number(value):
                version_tags[f"result.{key}"] = str(value)
        version = client.create_model_version(name, source=source, run_id=run_id, tags=version_tags)
    except HLMError:
        raise
    except Exception as err:
        raise HLMError(
            f"registering {name} at {_redact(uri)} failed: {type(err).__name__}: "
            f"{_first_line(str(err))}"
        ) from None
    return name, int(version.version)


def download_model(uri: str, *, tracking_uri: str | None = None) -> Path:
    """A local folder with the files of ``models:/NAME/VERSION`` or ``models:/NAME@alias``.

    Versions are immutable, so each is downloaded once into the cache (an alias is resolved to
    its version first: moving the alias serves the new version)."""
    from hlm_ray.errors import HLMError
    from hlm_ray.paths import cache_dir

    tracking_uri = tracking_uri or default_tracking_uri()
    name, version = _parse_model_uri(uri)
    try:
        _probe(tracking_uri)
        from mlflow import MlflowClient
        from mlflow.artifacts import download_artifacts

        client = MlflowClient(tracking_uri=tracking_uri)
        if not version.isdigit():
            version = client.get_model_version_by_alias(name, version).version
        target = cache_dir("registry", name, str(version))
        done = target / ".complete"
        if not done.exists():
            source = client.get_model_version(name, str(version)).source
            tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
            download_artifacts(artifact_uri=source, dst_path=str(tmp), tracking_uri=tracking_uri)
            inner = tmp / Path(source).name  # download_artifacts keeps the folder's name
            import shutil

            shutil.rmtree(target, ignore_errors=True)
            (inner if inner.is_dir() else tmp).rename(target)
            shutil.rmtree(tmp, ignore_errors=True)
            done.touch()
    except Exception as err:
        raise HLMError(
            f"model {uri} cannot be loaded from the registry at {_redact(tracking_uri)}: "
            f"{type(err).__name__}: {_first_line(str(err))}; list versions with "
            "`mlflow ui` or register one with `hlm finetune --task clm --register NAME`"
        ) from None
    return target


def _parse_model_uri(uri: str) -> tuple[str, str]:
    """("NAME", "VERSION" or "alias") from models:/NAME/VERSION or models:/NAME@alias."""
    from hlm_ray.errors import HLMError

    rest = uri.removeprefix(REGISTRY_SCHEME)
    if "@" in rest:
        name, _, ref = rest.partition("@")
    else:
        name, _, ref = rest.partition("/")
    if not uri.startswith(REGISTRY_SCHEME) or not name or not ref or "/" in ref:
        raise HLMError(
            f"{uri!r} is not a registry URI: use models:/NAME/VERSION or models:/NAME@alias"
        )
    return name, ref


def _log_tags(client, run_id: str, tags: dict[str, Any]) -> None:
    from mlflow.entities import RunTag

    entries = [RunTag(k, _clip(str(v), _MAX_TAG_VALUE)) for k, v in tags.items()]
    for chunk in _chunks(entries, _MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run_id, tags=chunk, synchronous=True)


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other schemes and in-memory ones)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].partition("?")[0]
    if not path or path == ":memory:":
        return None
    return Path(path)


def _artifact_location(uri: str) -> str | None:
    """`mlartifacts` next to a sqlite database; None lets a server or other store decide.

    Without it, a sqlite store puts artifacts in ``./mlruns`` relative to whatever directory
    the writing process happens to run in (a Ray worker's is not the project's).
    """
    db = _sqlite_path(uri)
    if db is None:
        return None
    folder = db.resolve().parent / "mlartifacts"
    folder.mkdir(parents=True, exist_ok=True)
    return folder.as_uri()


def _probe(uri: str) -> None:
    """Raise quickly if an HTTP tracking server does not accept connections.

    MLflow's own client retries a refused connection for about four minutes by default
    (measured with 3.17.2) before giving up; a TCP connect answers in milliseconds.
    """
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    host = parts.hostname
    if parts.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(host):
        return  # reached through a proxy: a direct connect says nothing
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ConnectionError(f"cannot connect to {host}:{port}: {exc}") from exc


def _redact(uri: str) -> str:
    """The URI without any user:password part, for messages."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry (some containers)
        return "unknown"


def _is_number(value: Any) -> bool:
    if isinstance(value, bool | int | float):
        return True
    try:  # numpy and torch scalars
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, str | bytes)


def _clip(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "(no message)"
    return _clip(line, limit)


def _chunks(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
