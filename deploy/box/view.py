"""What MLflow holds of a run or a sweep, as one JSON line: what the cluster box's scenarios
check from the client, through the tracking server alone (MLFLOW_TRACKING_URI).

    python deploy/box/view.py run hlm_ray box-train-s3        # status, tags, metric steps, files
    python deploy/box/view.py sweep hlm-vocab vocab-tiny       # the parent and its children
    python deploy/box/view.py sweep hlm-vocab vocab-tiny train/loss   # each with that history
    python deploy/box/view.py history RUN_ID train/loss        # {step: value}
    python deploy/box/view.py job SUBMISSION_ID                # {"status": ..., "logs": ...}
    python deploy/box/view.py wait SUBMISSION_ID PATTERN 600   # until PATTERN is in its logs
                                                               # (or the job ended), as job
    python deploy/box/view.py actors ServeReplica              # the node address of each alive
                                                               # actor of that class (prefix)
"""

from __future__ import annotations

import json
import re
import sys
import time

ENDED = ("SUCCEEDED", "FAILED", "STOPPED")


def _client():
    from mlflow import MlflowClient

    return MlflowClient()


def describe(run, client) -> dict:
    """A run's status, tags, params, the steps of each metric and its number of points, and its
    top-level artifacts."""
    steps, points = {}, {}
    for key in run.data.metrics:
        history = client.get_metric_history(run.info.run_id, key)
        steps[key] = sorted({m.step for m in history})
        points[key] = len(history)  # more than its steps: a step logged twice
    return {
        "run_id": run.info.run_id,
        "name": run.info.run_name,
        "status": run.info.status,
        "tags": {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.note")},
        "metrics": run.data.metrics,
        "params": run.data.params,
        "steps": steps,
        "points": points,
        "artifacts": sorted(a.path for a in client.list_artifacts(run.info.run_id)),
    }


def history(client, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def runs(experiment: str, where: str) -> list:
    client = _client()
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    return client.search_runs([found.experiment_id], where, max_results=1000)


def job_state(job: str) -> dict:
    from ray.job_submission import JobSubmissionClient

    jobs = JobSubmissionClient()
    return {"status": str(jobs.get_job_status(job).value), "logs": jobs.get_job_logs(job)}


def wait(job: str, pattern: str, timeout_s: float) -> dict:
    """The job's state once `pattern` (a regex; "" for none) is in its logs, or it ended, or
    `timeout_s` passed; `found`: whether the pattern was seen."""
    from ray.job_submission import JobSubmissionClient

    jobs = JobSubmissionClient()
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(jobs.get_job_status(job).value)
        logs = jobs.get_job_logs(job) if pattern or status in ENDED else ""
        found = bool(pattern) and re.search(pattern, logs) is not None
        if found or status in ENDED or time.monotonic() > deadline:
            return {"status": status, "logs": logs, "found": found}
        time.sleep(1)


def actor_nodes(prefix: str) -> list[str]:
    """The node address of each alive actor whose class name starts with `prefix`, through the
    state API at RAY_ADDRESS (the Job API's address)."""
    import os

    from ray.util.state import list_actors, list_nodes

    address = os.environ["RAY_ADDRESS"]
    ips = {n.node_id: n.node_ip for n in list_nodes(address=address)}
    alive = list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=10_000)
    return sorted(ips.get(a.node_id, "?") for a in alive if a.class_name.startswith(prefix))


def main(argv: list[str]) -> int:
    what, *rest = argv
    if what in ("run", "sweep", "history"):  # MLflow's client (seconds of imports) only here
        client = _client()
    if what == "run":
        experiment, name = rest
        out = [describe(r, client) for r in runs(experiment, f"attributes.run_name = '{name}'")]
    elif what == "sweep":  # and, given a metric, each run's {step: value} of it
        experiment, sweep, *metric = rest
        out = [describe(r, client) for r in runs(experiment, f"tags.sweep = '{sweep}'")]
        for run in out:
            if metric:
                run["history"] = history(client, run["run_id"], metric[0])
    elif what == "job":  # the Job API at RAY_ADDRESS, with the token in the environment
        (job,) = rest
        out = job_state(job)
    elif what == "wait":  # one process polling the Job API, not one process per poll
        job, pattern, timeout = rest
        out = wait(job, pattern, float(timeout))
    elif what == "actors":
        (prefix,) = rest
        out = actor_nodes(prefix)
    elif what == "history":
        run_id, key = rest
        out = history(client, run_id, key)
    else:
        raise SystemExit(f"unknown view {what!r}: run, sweep, history, job, wait or actors")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
