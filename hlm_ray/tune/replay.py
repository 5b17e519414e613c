"""The end of a sweep: every trial's records reach MLflow and the parent run is closed, wherever
an earlier attempt died or the tracking server went away.

    sent = replay_trials(["headless-v512-s0-abc", ...], "runs/sweeps/x/trials", tracking_uri)
    parent = reopened(parent)         # before the sweep's end logs its results on it
    report = sync_sweep("runs/sweeps/x")              # `hlm sync runs/sweeps/x`

A run replays what its tracking server missed when it ends (`hlm_ray.tracking.sync`), but a
sweep killed at the wrong moment leaves a worker that wrote its last steps after the sweep's
server died, and the resumed sweep may not run that stage again (training complete) or that
trial at all (Tune had it finished); a downstream step that met an outage keeps its scores in
the trial's folder alone. So the sweep driver syncs every trial folder at its end, after
`SweepStorage.pull_trials` brought each trial's records to it. A server still out of reach
then is one line, which names what sends everything once it answers: the sweep's command
again, or `hlm sync` of the sweep's folder (`sync_sweep`).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hlm_ray.console import say
from hlm_ray.errors import HLMError
from hlm_ray.tracking.base import read_run_ref
from hlm_ray.tracking.sync import maybe_unsynced, sync_run

PARENT_FILES = (".csv", ".md", ".png")
"""What of a sweep's folder goes on its parent run: the summary, the report, the figures."""


def replay_trials(runs: list[str], trials_dir: str | Path, tracking_uri: str) -> int:
    """Send each trial's MLflow run (folder `trials_dir/<run>`) the records it lacks (steps of
    its `metrics.jsonl`, downstream scores), with one line per trial that lacked some; returns
    how many points were sent. A store out of reach is one warning line for all the trials,
    never an exception: the sweep's results stand."""
    sent, unsent, reason = 0, [], ""
    for run in runs:
        folder = Path(trials_dir) / run
        if read_run_ref(folder) is None:  # killed before its MLflow run was opened
            continue
        if not maybe_unsynced(folder):  # its run's own end-of-run sync saw every row
            continue
        try:
            report = sync_run(folder, tracking_uri=tracking_uri)
        except HLMError as err:
            unsent.append(run)
            reason = reason or str(err).split("; ")[0]
            continue
        if report["metrics_logged"]:
            say(
                f"sweep: MLflow lacked {report['metrics_logged']} metric point(s) of trial "
                f"{run} (written while its tracking server was gone); sent them now"
            )
        sent += report["metrics_logged"]
    if unsent:
        sweep = shown(Path(trials_dir).parent)
        say(
            f"warning: {reason}; MLflow lacks records of {len(unsent)} trial(s), kept in their "
            f"folders: once the server answers, run this sweep's command again (no trial runs "
            f"again) or `hlm sync {sweep}`"
        )
    return sent


def reopened(parent):
    """The sweep's parent run (an `MlflowTracker`), reopened with a new client when its tracker
    turned off (the tracking server stopped or restarted while the trials ran): the sweep's end
    logs the results on it and closes it. The tracker as it is when it is on, or when the
    server still does not answer."""
    if parent.active or parent.run_id is None:
        return parent
    from hlm_ray.tracking import MlflowTracker

    again = MlflowTracker(parent.experiment, run_id=parent.run_id, tracking_uri=parent.tracking_uri)
    return again if again.active else parent


def sync_sweep(folder: str | Path, tracking_uri: str | None = None) -> dict[str, Any]:
    """`hlm sync runs/sweeps/<name>`: what a tracking outage left of a finished sweep sent to
    MLflow: every trial's records (`replay_trials`), then the parent run's summary, report and
    figures when it lacks them, and its status (KILLED if a trial was, else FINISHED) once the
    sweep wrote its summary. HLMError if the parent's store cannot be reached."""
    from hlm_ray.tracking import MlflowTracker, default_tracking_uri
    from hlm_ray.tune.storage import STATE_FILE, TRIALS_DIR

    folder = Path(folder)
    state = json.loads((folder / STATE_FILE).read_text())
    uri = tracking_uri or default_tracking_uri()
    trials = folder / TRIALS_DIR
    runs = sorted(p.name for p in trials.iterdir() if p.is_dir()) if trials.is_dir() else []
    points = replay_trials(runs, trials, uri)
    run_id = state.get("parent_run_id")
    parent = MlflowTracker(state["spec"]["experiment"], run_id=run_id, tracking_uri=uri)
    if not parent.active:
        raise HLMError(
            f"cannot sync sweep {folder.name}: its parent run {run_id} is not reachable at "
            f"{uri} ({parent.disabled_reason}); retry once the server is back, or name the "
            "store that holds it with --tracking-uri"
        )
    logged = parent.artifacts()
    files = sorted(p for p in folder.iterdir() if p.suffix in PARENT_FILES and p.is_file())
    for path in files:
        if path.name not in logged:
            parent.log_artifact(path)
    summary = folder / "summary.csv"
    if summary.is_file():
        with summary.open() as f:
            statuses = {row["status"] for row in csv.DictReader(f)}
        status = "KILLED" if "KILLED" in statuses else "FINISHED"
        parent.finish(status)
    else:  # the sweep did not end: reopening the run set it RUNNING, as the sweep left it
        status = "RUNNING"
    return {
        "run_id": run_id,
        "trials": len(runs),
        "metrics_logged": points,
        "artifacts_logged": [p.name for p in files if p.name not in logged],
        "status": status,
    }


def say_if_unclosed(parent, folder: Path) -> None:
    """One line when the sweep's end could not close its parent run (the tracking server did
    not answer): it names what does, once the server is back."""
    if parent.run_id is not None and not parent.active:
        say(
            f"warning: the sweep's parent run {parent.run_id} is not closed: {parent.disabled_reason}"
            f"; once the server answers, run this sweep's command again (no trial runs again) "
            f"or `hlm sync {shown(folder)}`"
        )


def shown(folder: Path) -> Path:
    """`folder` as a command names it: relative to where relative outputs go (a job's
    `hlm sync runs/sweeps/x` finds it there, on whichever machine runs the job), else as is."""
    from hlm_ray.paths import work_dir

    folder = Path(folder)
    return folder.relative_to(work_dir()) if folder.is_relative_to(work_dir()) else folder
