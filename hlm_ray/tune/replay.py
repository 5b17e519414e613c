"""The end of a sweep: every trial's logged steps reach MLflow, wherever an earlier attempt died.

    sent = replay_trials(["headless-v512-s0-abc", ...], "runs/sweeps/x/trials", tracking_uri)

A run replays what its tracking server missed when it ends (`hlm_ray.tracking.sync`), but a
sweep killed at the wrong moment leaves a worker that wrote its last steps after the sweep's
server died, and the resumed sweep may not run that stage again (training complete) or that
trial at all (Tune had it finished). So the sweep driver syncs every trial folder at its end,
after `SweepStorage.pull_trials` brought each trial's records to it.
"""

from __future__ import annotations

from pathlib import Path

from hlm_ray.console import say
from hlm_ray.errors import HLMError
from hlm_ray.tracking.base import read_run_ref
from hlm_ray.tracking.sync import maybe_unsynced, sync_run


def replay_trials(runs: list[str], trials_dir: str | Path, tracking_uri: str) -> int:
    """Send each trial's MLflow run (folder `trials_dir/<run>`) the steps of its `metrics.jsonl`
    it lacks, with one line per trial that lacked some; returns how many points were sent. A
    store out of reach is one warning line, never an exception: the sweep's results stand."""
    sent = 0
    for run in runs:
        folder = Path(trials_dir) / run
        if read_run_ref(folder) is None:  # killed before its MLflow run was opened
            continue
        if not maybe_unsynced(folder):  # its run's own end-of-run sync saw every row
            continue
        try:
            report = sync_run(folder, tracking_uri=tracking_uri)
        except HLMError as err:
            say(f"warning: {err}")
            continue
        if report["metrics_logged"]:
            say(
                f"sweep: MLflow lacked {report['metrics_logged']} metric point(s) of trial "
                f"{run} (written while its tracking server was gone); sent them now"
            )
        sent += report["metrics_logged"]
    return sent
