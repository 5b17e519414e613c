"""What the end-to-end sweep tests share: loading a `sweeps/` script, its runs in MLflow, its
summary, and the check that every trial carries its own value of the axis.

    main = sweep_main("vocab")                         # sweeps/vocab.py's main, in-process
    assert main(["--preset", "tiny", *set_args(FAST)]) == 0
    rows = check_trials_carry_their_values(folder, spec, uri, "vocab-e2e")
"""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import yaml

from hlm_ray.config import flatten
from hlm_ray.tune.spec import SweepSpec

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "hlm_ray-sweeps"
# Tiny runs: 8 steps, one checkpoint (one ~2 s report), a 300 kB BPE training text.
FAST = [
    "optim.max_steps=8",
    "run.checkpoint_every=8",
    "run.eval_every=8",
    "run.log_every=4",
    "tokenizer.train_sample_bytes=300000",
]


def set_args(items: list[str]) -> list[str]:
    """`--set` flags of a sweep script."""
    return [arg for item in items for arg in ("--set", item)]


def load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"sweep_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sweep_main(kind: str):
    """`main(argv)` of sweeps/<kind>.py, called in this process: it joins the test cluster."""
    return load_script(ROOT / "sweeps" / f"{kind}.py").main


def sweep_runs(uri: str, sweep: str):
    """(client, parent runs, child runs) of sweep `sweep` in the store or server at `uri`."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], f"tags.sweep = '{sweep}'")
    parents = [r for r in runs if r.data.tags.get("sweep_role") == "parent"]
    children = [r for r in runs if r.data.tags.get("sweep_role") != "parent"]
    return client, parents, children


def summary_rows(folder: Path) -> list[dict[str, str]]:
    with open(folder / "summary.csv") as f:
        return list(csv.DictReader(f))


def _plain(value):
    return json.loads(json.dumps(value))  # tuples and lists alike


def check_trials_carry_their_values(
    folder: Path, spec: SweepSpec, uri: str, sweep: str
) -> list[dict[str, str]]:
    """Every cell of `spec` ran as one trial whose summary row, config.yaml and MLflow run
    (params) carry its own value of the axis: each config field that tells the cells apart (the
    axis's field, and what its value also sets), as `spec.cell_config` builds it. The parent
    run lists them all (each child's `mlflow.parentRunId`), and each child's MLflow history
    holds every step of the trial's metrics.jsonl. Returns the summary rows."""
    rows = summary_rows(folder)
    column = spec.axis.column[1]
    cells = sorted((c["objective"], str(c["value"]), str(c["seed"])) for c in spec.cells())
    assert sorted((r["objective"], r[column], r["seed"]) for r in rows) == cells

    def expected(row):
        value = next(v for v in spec.values if str(v) == row[column])
        cfg = spec.cell_config(value, row["objective"], int(row["seed"]))
        return dict(flatten(cfg.to_dict()))

    wanted = {r["trial_id"]: expected(r) for r in rows}
    first = next(iter(wanted.values()))
    differ = {k for flat in wanted.values() for k, v in flat.items() if _plain(v) != first[k]}
    keys = sorted(differ | {spec.axis.field})
    assert len(rows) == 1 or spec.axis.field in differ, "the cells do not differ on the axis"

    _, (parent,), children = sweep_runs(uri, sweep)
    by_trial = {c.data.tags["trial_id"]: c for c in children}
    assert sorted(by_trial) == sorted(wanted)
    for row in rows:
        want = wanted[row["trial_id"]]
        child = by_trial[row["trial_id"]]
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        saved = dict(
            flatten(yaml.safe_load((folder / "trials" / row["run"] / "config.yaml").read_text()))
        )
        for key in keys:
            assert _plain(saved[key]) == _plain(want[key]), (row["run"], key)
            assert child.data.params[key] == str(want[key]), (row["run"], key)
        check_every_logged_step_in_mlflow(folder / "trials" / row["run"], uri, child.info.run_id)
    return rows


def check_every_logged_step_in_mlflow(run_folder: Path, uri: str, run_id: str) -> None:
    """Every (metric, step) of the folder's metrics.jsonl is in run `run_id`'s history."""
    from mlflow import MlflowClient

    from hlm_ray.tracking import read_metrics
    from hlm_ray.tracking.store import is_number

    logged = {
        (key, int(row["step"]))
        for row in read_metrics(run_folder)
        for key, value in row.items()
        if key != "step" and is_number(value)
    }
    client = MlflowClient(uri)
    have = {
        (key, m.step)
        for key in {k for k, _ in logged}
        for m in client.get_metric_history(run_id, key)
    }
    assert logged and logged <= have, (run_folder.name, sorted(logged - have)[:5])


# ------------------------------------------------------------ processes a sweep subprocess starts


def started_at(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None when it is gone or a zombie:
    with the pid, it names one process (pids are reused; Ray workers retitle themselves)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def descendants(pid: int) -> dict[int, tuple[str, str]]:
    """{pid: (start time, command line)} of every live descendant of `pid` (Linux /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and ")"
        parents.setdefault(ppid, []).append(int(entry.name))
    found: dict[int, tuple[str, str]] = {}
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if (start := started_at(child)) is not None:
                found[child] = (start, cmdline.decode(errors="replace"))
                todo.append(child)
    return found


def still_running(seen: dict[int, tuple[str, str]]) -> dict[int, str]:
    return {pid: cmd for pid, (start, cmd) in seen.items() if started_at(pid) == start}


def use_mlflow_server(uri: str, setenv) -> None:
    """Log to the session's server as a sweep logs to the one it starts (`setenv(key, value)`)."""
    from hlm_ray.tracking.server import QUIET_LINKS

    setenv("MLFLOW_TRACKING_URI", uri)
    for key, value in QUIET_LINKS.items():
        setenv(key, value)
