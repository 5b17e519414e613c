"""Replay a run folder's records to its MLflow run: `hlm sync RUN`, and the end of every run.

Training never waits on the tracking server: every metric is written to `metrics.jsonl` first,
and the MLflow tracker turns itself off after its first failed call (with short HTTP timeouts,
see `store.bound_http_waits`). What MLflow missed while the server was down is sent
here, once it is back:

    report = sync_run("runs/tiny-headless")      # {"run_id", "metrics_logged", "status", ...}

Points MLflow already holds (same key and step) are not sent again, so syncing twice, or a run
whose tracking never failed, adds nothing. A sweep trial's downstream scores (`downstream.json`,
logged at step 0 by a later step, which may have met the outage) are sent with the rows. The
status the launcher meant to give the run (FINISHED, FAILED, KILLED: kept in `mlflow_run.json`)
is applied, as are the params (from `params.json`) and the final artifacts, when the run lacks
them. A run folder that never had an MLflow run (trained where mlflow was not installed) gets a
new one, named after the folder.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from hlm_ray.errors import HLMError
from hlm_ray.tracking.base import DOWNSTREAM_FILE, read_run_ref, write_run_ref
from hlm_ray.tracking.base import RUN_REF_FILE as RUN_ID_FILE


def record_status(out_dir: str | Path, status: str) -> None:
    """Remember the status the run should end with (applied now, or by a later sync). As in
    `MlflowTracker.finish`, FAILED does not replace a status already recorded: opening the run
    clears it, so one found here was set by the sweep that stopped the trial."""
    path = Path(out_dir) / RUN_ID_FILE
    if path.is_file():
        info = json.loads(path.read_text())
        if status == "FAILED" and info.get("status"):
            return
        info["status"] = status
        path.write_text(json.dumps(info))


def sync_run(out_dir: str | Path, *, tracking_uri: str | None = None) -> dict[str, Any]:
    """Send what the MLflow run lacks from `out_dir`; HLMError if the server cannot be reached."""
    from hlm_ray.tracking.store import bound_http_waits, probe, redact

    out_dir = Path(out_dir)
    info = read_run_ref(out_dir) or _open_untracked(out_dir, tracking_uri)
    run_id = info["run_id"]
    bound_http_waits()
    uri = locate_run(out_dir, run_id, info.get("tracking_uri"), tracking_uri)
    try:
        probe(uri)
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        client = MlflowClient(tracking_uri=uri)
        run = client.get_run(run_id)
        rows = records(out_dir)
        keys = sorted({k for row in rows for k in row if k != "step"})
        have = {k: {m.step for m in client.get_metric_history(run_id, k)} for k in keys}
        now = int(time.time() * 1000)
        missing = [
            Metric(key, float(value), now, int(row["step"]))
            for row in rows
            for key, value in row.items()
            if key != "step" and int(row["step"]) not in have[key]
        ]
        for start in range(0, len(missing), 1000):
            client.log_batch(run_id, metrics=missing[start : start + 1000], synchronous=True)
        params_logged = 0
        params_file = out_dir / "params.json"
        if not run.data.params and params_file.is_file():
            params = [
                Param(k, str(v)[:6000]) for k, v in json.loads(params_file.read_text()).items()
            ]
            for start in range(0, len(params), 100):
                client.log_batch(run_id, params=params[start : start + 100], synchronous=True)
            params_logged = len(params)
        artifacts = _missing_artifacts(client, run_id, out_dir, info.get("status"))
        for path, artifact_path in artifacts:
            if path.is_dir():
                client.log_artifacts(run_id, str(path), artifact_path)
            else:
                client.log_artifact(run_id, str(path), artifact_path)
        status = run.info.status
        wanted = info.get("status")
        if wanted and wanted != status:
            client.set_terminated(run_id, wanted)
            status = wanted
    except HLMError:
        raise
    except Exception as err:
        line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise HLMError(
            f"cannot sync {out_dir} to MLflow at {redact(uri)}: {type(err).__name__}: {line}; "
            f"its metrics stay in {out_dir / 'metrics.jsonl'}; retry with `hlm sync {out_dir}`"
        ) from None
    _remember_synced(out_dir, len(rows))
    return {
        "run_id": run_id,
        "metrics_logged": len(missing),
        "params_logged": params_logged,
        "artifacts_logged": [a for _, a in artifacts],
        "status": status,
    }


def records(out_dir: str | Path) -> list[dict[str, Any]]:
    """What the run folder says MLflow should hold: the rows of `metrics.jsonl`, then the
    downstream scores as one row at step 0 (where its step logged them); numbers only."""
    from hlm_ray.tracking import read_metrics
    from hlm_ray.tracking.store import is_number

    rows = read_metrics(out_dir)
    scores = Path(out_dir) / DOWNSTREAM_FILE
    if scores.is_file():  # the step logged its finite scores
        logged = json.loads(scores.read_text()).items()
        rows.append({"step": 0, **{k: v for k, v in logged if is_number(v) and math.isfinite(v)}})
    return [{k: v for k, v in row.items() if k == "step" or is_number(v)} for row in rows]


SYNCED_ROWS = "synced_rows"
"""In `mlflow_run.json`: how many of the folder's `records` MLflow was last found to hold."""


def _remember_synced(out_dir: Path, rows: int) -> None:
    path = out_dir / RUN_ID_FILE
    info = json.loads(path.read_text())
    path.write_text(json.dumps({**info, SYNCED_ROWS: rows}))


def maybe_unsynced(out_dir: str | Path) -> bool:
    """Whether MLflow may lack some of the folder's `records`: no sync has seen them all (one
    was never run, or rows, or the downstream scores, were written after it). False costs no
    MLflow round trip, which a full `sync_run` pays per metric (about 1 s a trial on 2 cores)."""
    info = read_run_ref(out_dir)
    return info is None or info.get(SYNCED_ROWS) != len(records(out_dir))


def logged_downstream(out_dir: str | Path) -> None:
    """The downstream step logged its scores to MLflow (its tracker stayed on): a folder whose
    other records a sync had all seen needs no sync for them either."""
    info = read_run_ref(out_dir)
    count = len(records(out_dir))
    if info is not None and info.get(SYNCED_ROWS) == count - 1:
        _remember_synced(Path(out_dir), count)


def locate_run(out_dir: Path, run_id: str, recorded: str | None, given: str | None) -> str:
    """The tracking URI that holds `run_id`: `given` (--tracking-uri) if named; else the one
    the folder recorded, then $MLFLOW_TRACKING_URI or the project's own store. A sweep trial
    records its sweep's own server on an ephemeral loopback port, gone once the sweep ends: the
    store behind it is found through the others, and recorded for the next sync."""
    from hlm_ray.tracking.store import default_tracking_uri, probe, redact, sqlite_path

    named = [given] if given else [recorded, default_tracking_uri()]
    candidates = list(dict.fromkeys(u for u in named if u))
    for uri in candidates:
        db = sqlite_path(uri)
        if db is not None and not db.is_file():
            continue  # opening it would create an empty store, which cannot hold the run
        try:
            probe(uri)
            from mlflow import MlflowClient

            MlflowClient(tracking_uri=uri).get_run(run_id)
        except Exception:
            continue
        if uri != recorded:
            path = out_dir / RUN_ID_FILE
            ref = json.loads(path.read_text())
            path.write_text(json.dumps({**ref, "tracking_uri": uri}))
        return uri
    tried = ", ".join(redact(u) for u in candidates)
    raise HLMError(
        f"cannot sync {out_dir}: its MLflow run {run_id} is not reachable at {tried}; retry "
        f"with `hlm sync {out_dir}` once the server is back, or name the store that holds it: "
        f"`hlm sync {out_dir} --tracking-uri URI` (or set MLFLOW_TRACKING_URI)"
    )


def _open_untracked(out_dir: Path, tracking_uri: str | None) -> dict[str, Any]:
    """A run folder whose MLflow run was never opened (trained where mlflow was not installed):
    a new run in its experiment (`launch.json`), named after the folder, FINISHED when the
    folder has its summary, else FAILED."""
    if not (out_dir / "metrics.jsonl").is_file():
        raise HLMError(
            f"{out_dir} has no {RUN_ID_FILE} and no metrics.jsonl: not a run folder; pass the "
            "--output folder of an `hlm train` run"
        )
    from hlm_ray.tracking.mlflow_tracker import MlflowTracker
    from hlm_ray.tracking.store import default_tracking_uri, redact

    launch = out_dir / "launch.json"
    experiment = json.loads(launch.read_text()).get("experiment") if launch.is_file() else None
    uri = tracking_uri or default_tracking_uri()
    tracker = MlflowTracker(experiment or "hlm_ray", out_dir.name, tracking_uri=uri)
    if tracker.run_id is None:
        raise HLMError(
            f"cannot sync {out_dir}: no MLflow run could be started at {redact(uri)} "
            f"({tracker.disabled_reason}); its metrics stay in {out_dir / 'metrics.jsonl'}"
        )
    write_run_ref(out_dir, tracker.run_id, uri)
    record_status(out_dir, "FINISHED" if (out_dir / "summary.json").is_file() else "FAILED")
    return read_run_ref(out_dir)


def _missing_artifacts(client, run_id: str, out_dir: Path, status: str | None):
    """A finished run's config, model and loss curve, when the run has none of them."""
    if status != "FINISHED" or not (out_dir / "summary.json").is_file():
        return []
    present = {a.path for a in client.list_artifacts(run_id)}
    wanted = [
        (out_dir / "config.yaml", None),
        (out_dir / "model", "model"),
        (out_dir / "loss_curve.png", None),
    ]
    out = []
    for path, artifact_path in wanted:
        name = artifact_path or path.name
        if path.exists() and name not in present:
            out.append((path, artifact_path))
    return out


def sync_quietly(out_dir: str | Path, retry: str | None = None) -> str | None:
    """`sync_run` at the end of a run: a one-line note when something was sent or it failed
    (`retry`: what sends it later, when not `hlm sync` of the folder: a sweep trial's)."""
    try:
        report = sync_run(out_dir)
    except HLMError as err:
        return f"warning: {str(err).split('; ')[0]}; {retry}" if retry else f"warning: {err}"
    if report["metrics_logged"] or report["params_logged"] or report["artifacts_logged"]:
        return (
            f"MLflow: replayed {report['metrics_logged']} metric point(s) the tracking server "
            f"missed to run {report['run_id']}"
        )
    return None


class SkipLogged:
    """Wraps a run's MLflow tracker after a resume or a restart: metric points at steps it was
    already sent (up to `through`: the last step the run holds, or that `metrics.jsonl` held
    before a resume) are not sent again, so the redone steps add no duplicate points."""

    def __init__(self, tracker, through: int):
        self.tracker = tracker
        self.through = through

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step > self.through:
            self.tracker.log_metrics(metrics, step)

    def __getattr__(self, name: str):
        return getattr(self.tracker, name)


def last_logged_step(out_dir: str | Path) -> int:
    from hlm_ray.tracking import read_metrics

    return max((int(r["step"]) for r in read_metrics(out_dir)), default=-1)
