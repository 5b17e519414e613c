"""A sweep's parent MLflow run: opened (or reopened on resume) with the sweep's settings as
params, and given the results: a metric per (score, arm) over the swept values and the report as
its description."""

from __future__ import annotations

import json
from pathlib import Path

from hlm_ray.tune import summary as summary_mod
from hlm_ray.tune.spec import SweepSpec
from hlm_ray.tune.storage import STATE_FILE


def open_parent(spec, name, uri, state, search, concurrency, real_vocab):
    from hlm_ray.config import flatten
    from hlm_ray.tracking import MlflowTracker

    run_id = state.get("parent_run_id") if state else None
    parent = MlflowTracker(
        spec.experiment,
        name,
        tracking_uri=uri,
        run_id=run_id,
        tags={
            "sweep": name,
            "sweep_kind": spec.axis.name,
            "sweep_axis": spec.axis.field,
            "sweep_role": "parent",
            "search": search,
        },
    )
    params = dict(flatten({"sweep": spec.identity()}))
    params["sweep.max_concurrent_trials"] = concurrency
    params.update({f"sweep.real_vocab.{k}": v for k, v in real_vocab.items()})
    parent.log_params(params)
    return parent


def log_results(
    parent, rows, spec: SweepSpec, name: str, folder: Path, files: list[Path] = ()
) -> None:
    """The results on the parent run: a metric per (score, objective) over the swept values
    (its chart compares the arms with no clicks) and the description, with the figures among
    `files` shown in it. A resumed sweep logs only the points that changed (kept in
    sweep.json): a step logged twice draws twice."""
    from hlm_ray.tracking.mlflow_tracker import NOTE_TAG
    from hlm_ray.tracking.store import artifact_url

    path = folder / STATE_FILE
    state = json.loads(path.read_text())
    logged = state.get("results", {})
    for step, metrics in sorted(summary_mod.result_metrics(rows, spec.axis).items()):
        before = logged.get(str(step), {})
        new = {k: v for k, v in metrics.items() if before.get(k) != v}
        if new:
            parent.log_metrics(new, step=step)
        logged[str(step)] = {**before, **metrics}
    logged_files = {p.name for p in files}  # the figures were logged as artifacts just before
    images = [
        (f.label, artifact_url(parent.run_id, f.filename))
        for f in spec.axis.figures
        if parent.run_id is not None and f.filename in logged_files
    ]
    note = summary_mod.results_note(rows, spec.axis, name, images)
    parent.set_tags({NOTE_TAG: note})
    if parent.active:  # the note is kept for a report that adds to it (sweeps/headline.py)
        path.write_text(json.dumps({**state, "results": logged, "note": note}, indent=1))
