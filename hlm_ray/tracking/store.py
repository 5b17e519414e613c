"""Where the MLflow store is and how to talk about it: URIs, the reachability probe, the
request limits and the small helpers the tracker, the registry and the local server share.

    uri = default_tracking_uri()          # $MLFLOW_TRACKING_URI, else sqlite:///<root>/mlflow.db
    sqlite_path(uri)                      # the database file of a sqlite URI, else None
    probe(uri)                            # ConnectionError at once if an HTTP server is not there
    redact(uri)                           # without user:password, for messages
    print(browse_hint(uri, experiment_id, run_id))  # how to open a run once this process exits

Without a tracking server everything lands in `<root>/mlflow.db` with artifacts in
`<root>/mlartifacts`: `<root>` is ``$HLM_MLFLOW_DIR``, else `hlm_ray.paths.work_dir()` (the
current directory, as for ``mlflow ui``'s own default ``sqlite:///mlflow.db``).
"""

from __future__ import annotations

import getpass
import os
import socket
import urllib.parse
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hlm_ray.paths import work_dir

MLFLOW_DIR_ENV = "HLM_MLFLOW_DIR"
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"

# MLflow's per-request limits (mlflow.utils.validation, 3.17): params and tags share one budget
# of 100 per log_batch; longer values are rejected (tags) or truncated with a warning (params).
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
PROBE_TIMEOUT_S = 3.0
# hlm's own MLflow calls: a tracking outage must cost training seconds, not MLflow's minutes.
HTTP_WAITS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.2",
    # A server that proxies an object store (--artifacts-destination s3://...) tells clients to
    # fetch every file, and to send big ones, straight from the store, at URLs it signs with
    # *its* endpoint for it (a name inside the cluster, or its own loopback): a laptop behind a
    # port-forward, or a node that cannot resolve that name, retries them for minutes. Through
    # the server they reach it like every other call. Set these to true where every client
    # reaches the object store itself.
    "MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD": "false",
    "MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD": "false",
}


def bound_http_waits() -> None:
    """Short MLflow HTTP timeouts and retries in this process, unless the user set them."""
    for key, value in HTTP_WAITS.items():
        os.environ.setdefault(key, value)


def mlflow_dir() -> Path:
    """The folder of the embedded store: ``$HLM_MLFLOW_DIR``, else `work_dir()` (the current
    directory; the installed checkout inside a `ray job submit --working-dir .` copy)."""
    value = os.environ.get(MLFLOW_DIR_ENV)
    return Path(value).expanduser().resolve() if value else work_dir()


def default_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<mlflow_dir()>/mlflow.db``.

    A relative sqlite path is made absolute here: Ray workers run in other working directories,
    so a driver should resolve the URI once and hand the result to its workers.
    """
    uri = os.environ.get(TRACKING_URI_ENV, "").strip()
    if not uri:
        return f"sqlite:///{mlflow_dir() / 'mlflow.db'}"
    return absolute_uri(uri)


def absolute_uri(uri: str) -> str:
    """A sqlite URI with its database path made absolute (``sqlite:///mlflow.db`` names another
    store in every folder); other URIs unchanged."""
    db = sqlite_path(uri)
    if db is None or db.is_absolute():
        return uri
    query = uri.partition("?")[2]
    return f"sqlite:///{db.resolve()}" + (f"?{query}" if query else "")


def log_tags(client, run_id: str, tags: dict[str, Any]) -> None:
    from mlflow.entities import RunTag

    entries = [RunTag(k, clip(str(v), MAX_TAG_VALUE)) for k, v in tags.items()]
    for chunk in chunks(entries, MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run_id, tags=chunk, synchronous=True)


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other schemes and in-memory ones)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].partition("?")[0]
    if not path or path == ":memory:":
        return None
    return Path(path)


def artifact_location(uri: str) -> str | None:
    """`mlartifacts` next to a sqlite database; None lets a server or other store decide.

    Without it, a sqlite store puts artifacts in ``./mlruns`` relative to whatever directory
    the writing process happens to run in (a Ray worker's is not the project's).
    """
    db = sqlite_path(uri)
    if db is None:
        return None
    folder = db.resolve().parent / "mlartifacts"
    folder.mkdir(parents=True, exist_ok=True)
    return folder.as_uri()


def probe(uri: str) -> None:
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
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ConnectionError(f"cannot connect to {host}:{port}: {exc}") from exc


def redact(uri: str) -> str:
    """The URI without any user:password part, for messages."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


UI_URL = "http://127.0.0.1:5000"
"""Where ``mlflow ui`` serves by default."""
# MLflow 3's UI opens on its GenAI pages unless the page says otherwise (its "Model training"
# switch, remembered per browser): the links hlm prints say it.
UI_QUERY = "?workflowType=machine_learning"


def browse_hint(uri: str, experiment_id: str | None = None, run_id: str | None = None) -> str:
    """How to open a run in MLflow's browser, valid after this process exits: the server's own
    page for an HTTP store, else the ``mlflow ui`` command for the store and the page to open
    (never the URL of a temporary server)."""
    page = ""
    if experiment_id is not None:
        page = f"/#/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
        page += UI_QUERY
    if uri.startswith(("http://", "https://")):
        return f"MLflow: {redact(uri).rstrip('/')}{page}"
    db = sqlite_path(uri)
    store = f"sqlite:///{db.resolve()}" if db is not None else redact(uri)
    return f"MLflow: mlflow ui --backend-store-uri {store}\n  then open {UI_URL}{page}"


def artifact_url(run_id: str, path: str) -> str:
    """A run's artifact as the MLflow UI serves it, relative to the UI's page: for Markdown
    images in a run's description."""
    query = urllib.parse.urlencode({"path": path, "run_uuid": run_id})
    return f"get-artifact?{query}"


def mlflow_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry (some containers)
        return "unknown"


def is_number(value: Any) -> bool:
    if isinstance(value, bool | int | float):
        return True
    try:  # numpy and torch scalars
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, str | bytes)


def clip(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


def chunks(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
