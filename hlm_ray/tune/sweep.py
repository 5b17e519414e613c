"""The sweep driver: a grid of Train-inside-Tune trials, one MLflow parent run, resume by name.

    spec = get_sweep(PRESETS, "tiny")                   # PRESETS of a sweeps/*.py script
    outcome = run_sweep(spec, name="vocab-tiny")        # again with the same name: resumes
    print(outcome.table); outcome.failed                # trials that kept failing

What `run_sweep` does, in order; everything that can be wrong fails before any trial starts:
1. joins the Ray cluster (RAY_ADDRESS, a `ray start` cluster on this machine, or a new local
   one) and derives how many trials run at once from its CPUs and GPUs (`plan_concurrency`);
2. checks the grid (an empty one; what the axis's `check` refuses) and prepares the shared
   inputs once per distinct tokenizer: the BPE and the tokenized corpus are cached by their
   inputs, so concurrent trials of one size find them built (`prepare_inputs`; then the axis's
   `prepared` hook sees the real vocabulary sizes);
3. opens the parent MLflow run (through a local tracking server unless one is configured) and
   runs the `Tuner`, or `Tuner.restore`s it when `runs/sweeps/<name>/tune` exists: finished
   trials are kept, unfinished and failed ones run again (each up to `max_failures` retries);
4. writes the summary (one row per trial) and the figures, logs them to the parent run with
   the results as charts (`results/<score>/<objective>`, one step per swept value) and a
   description (the per-value table), then prints how to open it (`mlflow ui ...`: the local
   tracking server the trials used is gone by then).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hlm_ray.config import Config
from hlm_ray.console import say
from hlm_ray.errors import HLMError, one_line
from hlm_ray.paths import CACHE_ENV, resolve_output
from hlm_ray.tracking import TRACKING_URI_ENV, browse_hint, default_tracking_uri
from hlm_ray.tracking.server import QUIET_LINKS
from hlm_ray.tune import summary as summary_mod
from hlm_ray.tune.parent_run import log_results, open_parent
from hlm_ray.tune.placement import plan_concurrency
from hlm_ray.tune.replay import reopened, replay_trials, say_if_unclosed
from hlm_ray.tune.spec import SweepSpec
from hlm_ray.tune.storage import STATE_FILE, TUNE_DIR, SweepStorage
from hlm_ray.tune.trial import (
    TRIAL_ERROR,
    TrialRuntime,
    local_trials,
    run_name,
    run_trial,
    trial_resources,
)

SWEEPS_DIR = "runs/sweeps"
ASHA_METRIC = "val/loss"


@dataclass
class SweepOutcome:
    name: str
    folder: Path
    rows: list[dict[str, Any]]
    table: str
    files: list[Path]
    parent_run_id: str | None
    resumed: bool
    seconds: float
    real_vocab: dict[int, int] = field(default_factory=dict)
    interrupted: bool = False
    """Ctrl-C ended the sweep: unfinished trials are KILLED (their runs too), as is the parent."""
    link: str | None = None
    """How to open the parent run in MLflow's browser (`browse_hint`)."""

    @property
    def failed(self) -> list[dict[str, Any]]:
        """Trials that errored (after their retries); ASHA's early stops are not failures."""
        return [r for r in self.rows if r["status"] == "FAILED"]

    def best(self, key: str = "loss", lowest: bool = True) -> dict[str, Any] | None:
        """The finished trial with the lowest (`lowest`) or highest `key`: by default the
        validation loss at the last step, what ASHA compared (a search's trials share one cell,
        so their losses compare). Trials ASHA stopped are left out."""
        done = [r for r in self.rows if r["status"] == "FINISHED" and r.get(key) is not None]
        if not done:
            return None
        pick = min if lowest else max
        return pick(done, key=lambda r: r[key])


# ------------------------------------------------------------------------------ checks


def prepare_inputs(
    spec: SweepSpec,
    values: tuple[int, ...] | None = None,
    *,
    progress: bool = True,
    publish: str | None = None,
) -> tuple[dict[int, int], dict[str, str]]:
    """Prepare each distinct (tokenizer, data) setting once, before any trial: in parallel as
    Ray tasks, into the cache (`hlm_ray.prepare`), where every trial finds its folder. Returns
    {requested size: real size}, after the axis's `prepared` hook has seen it (it may refuse a
    size, or warn), and {`cluster.request_key`: folder} of the copies published under `publish`
    (a run storage every node reaches: a cluster's trials open those, `cluster.pin_prepared`)."""
    from hlm_ray.cluster import request_key
    from hlm_ray.prepare.tasks import prepare_many

    if spec.axis.check is not None:
        spec.axis.check(spec)
    cfgs = [spec.cell_config(v, spec.objectives[0], 0) for v in values or spec.values]
    done = prepare_many(cfgs, progress, publish=publish)
    real = {
        cfg.tokenizer.vocab_size: prepared.manifest["tokenizer"]["vocab_size"]
        for cfg, prepared in zip(cfgs, done, strict=True)
    }
    if spec.axis.prepared is not None:
        spec.axis.prepared(spec, real)
    located = {request_key(c): p.uri for c, p in zip(cfgs, done, strict=True)} if publish else {}
    return real, located


def check_resume(folder: Path, spec: SweepSpec, search: bool) -> dict[str, Any] | None:
    """The stored state of an existing sweep, or None; an HLMError if it was a different one."""
    path = folder / STATE_FILE
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    now = {"spec": spec.identity(), "search": search}
    before = {"spec": state["spec"], "search": state["search"]}
    if json.loads(json.dumps(now)) != before:
        diff = [k for k in now["spec"] if now["spec"][k] != before["spec"].get(k)]
        what = ", ".join(diff) if diff else "search mode"
        raise HLMError(
            f"sweep {folder.name} exists in {folder} with other settings ({what}); resume it "
            "with the same settings, choose another --name, or remove the folder"
        )
    return state


# ------------------------------------------------------------------------------ the driver


def run_sweep(
    spec: SweepSpec,
    *,
    name: str,
    search: bool = False,
    root: str | Path = SWEEPS_DIR,
    verbose: int = 0,
    assumptions=None,
    storage_path: str | None = None,
) -> SweepOutcome:
    """`storage_path`: where Tune's state and the trials go (`tune.storage`; default the
    sweep's folder)."""
    from hlm_ray.cluster import alive_nodes, check_tracking, machines, publish_root
    from hlm_ray.train.launch import connect

    started = time.perf_counter()
    folder = resolve_output(root) / name
    store = SweepStorage.of(folder, storage_path, name)
    store.pull_state()
    state = check_resume(folder, spec, search)
    store.check_same(state)
    if spec.axis.check is not None:
        spec.axis.check(spec)
    num_trials = spec.search_samples if search else len(spec.cells())
    ready: dict[str, Any] = {}

    phases: dict[str, float] = {}  # where the sweep's own time goes (seconds)

    def while_mlflow_starts() -> None:
        # Ray's start-up and the data preparation overlap the tracking server's start-up.
        t0 = time.perf_counter()
        connect()
        phases["ray_start"] = time.perf_counter() - t0
        from hlm_ray.tracking import default_tracking_uri

        alive = alive_nodes()
        check_tracking(default_tracking_uri(), machines(alive))
        nodes = [n["Resources"] for n in alive]
        ready["concurrency"] = plan_concurrency(spec, num_trials, nodes)
        ready["local"] = local_trials(spec, nodes, search, store.trials)
        ready["real_vocab"], ready["prepared"] = prepare_inputs(
            spec,
            spec.values[:1] if search else None,
            publish=publish_root(store.tune_path, machines(alive)),
        )
        phases["ray_and_inputs"] = time.perf_counter() - t0

    from hlm_ray.tracking.server import tracking_server

    log_file = folder / "mlflow_server.log"
    with tracking_server(log_file, while_starting=while_mlflow_starts) as uri:
        concurrency, real_vocab = ready["concurrency"], ready["real_vocab"]
        phases["until_mlflow_ready"] = time.perf_counter() - started
        parent = open_parent(spec, name, uri, state, search, concurrency, real_vocab)
        # From here on a Ctrl-C (before the trials start, during them, or while the summary is
        # written) ends the parent run KILLED and an error FAILED, never RUNNING.
        try:
            from hlm_ray import plan as plan_mod

            plan_mod.log_sweep_plan(parent, spec, name, assumptions, concurrency, folder, search)
            folder.mkdir(parents=True, exist_ok=True)
            same_parent = state is not None and state.get("parent_run_id") == parent.run_id
            (folder / STATE_FILE).write_text(
                json.dumps(
                    {
                        "spec": spec.identity(),
                        "search": search,
                        "parent_run_id": parent.run_id,
                        # what `log_results` logged on this parent run already
                        "results": state.get("results", {}) if same_parent else {},
                        "storage": store.remote,
                    },
                    indent=1,
                )
            )
            store.push_state()
            runtime = TrialRuntime(
                sweep=name,
                kind=spec.axis.name,
                experiment=spec.experiment,
                parent_run_id=parent.run_id,
                trials_dir=str(folder / "trials"),
                storage=store.trials,
                prepared=ready["prepared"],
                recipe=spec.recipe,
                workers=spec.workers_per_trial,
                cpus_per_worker=spec.cpus_per_worker,
                gpus_per_worker=spec.gpus_per_worker,
                env=_trial_env(uri),
                short=spec.axis.short,
                max_failures=spec.max_failures,
                placement_timeout_s=spec.placement_timeout_s,
                report_steps=search,  # ASHA compares the steps' reports
                local=ready["local"],  # not under ASHA: its reports need a worker group
            )
            resumed = store.tuner_exists()
            say(
                f"sweep {name}: {'resuming' if resumed else 'starting'} {num_trials} trial(s), "
                f"{concurrency} at a time, in {folder}"
            )
            from hlm_ray.train.interrupt import tune_interrupt

            phases["before_trials"] = time.perf_counter() - started
            with tune_interrupt() as stop:
                results = _tuner(
                    spec, store, runtime, search, concurrency, verbose, num_trials
                ).fit()
            phases["trials"] = time.perf_counter() - started - phases["before_trials"]
            rows = _rows(results, spec, runtime, search, interrupted=stop.interrupted)
            store.pull_trials([r["run"] for r in rows])  # what the report reads, from each trial
            _close_orphans(rows, spec, runtime)
            replay_trials(
                [r["run"] for r in rows], runtime.trials_dir, runtime.env[TRACKING_URI_ENV]
            )
            parent = reopened(parent)  # a tracking server stopped or restarted meanwhile
            files = summary_mod.write_summary(rows, folder, axis=spec.axis, figures=not search)
            for path in files:
                parent.log_artifact(path)
            log_results(parent, rows, spec, name, folder, files)
            store.push_state()
            counts = {s: sum(r["status"] == s for r in rows) for s in ("FINISHED", "FAILED")}
            parent.log_metrics({f"trials_{k.lower()}": v for k, v in counts.items()}, step=0)
            seconds = time.perf_counter() - started
            phases["after_trials"] = seconds - phases["before_trials"] - phases["trials"]
            parent.log_metrics(plan_mod.measured_metrics(rows, seconds), step=0)
            if spec.gpus_per_worker == 0 and not search:  # for later plans on this machine
                _record_fixed_costs(rows, spec, name, phases)
            parent.log_metrics({f"sweep/{k}_s": v for k, v in phases.items()}, step=0)
            status, outcome = summary_mod.sweep_status(rows, stop.interrupted)
            parent.set_tags({"sweep_outcome": outcome})
            parent.finish(status)
            say_if_unclosed(parent, folder)
        except (KeyboardInterrupt, SystemExit):
            parent.finish("KILLED")
            raise
        except BaseException:
            parent.finish("FAILED")
            raise
        stopping = time.perf_counter()
    phases["mlflow_stop"] = time.perf_counter() - stopping
    print("sweep time (s): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    link = None
    if parent.run_id is not None:  # the store, not the server that just exited
        link = browse_hint(default_tracking_uri(), parent.experiment_id, parent.run_id)
    table = summary_mod.markdown_table(rows, spec.axis)
    return SweepOutcome(
        name=name,
        folder=folder,
        rows=rows,
        table=table,
        files=files,
        parent_run_id=parent.run_id,
        resumed=resumed,
        seconds=time.perf_counter() - started,
        real_vocab=real_vocab,
        interrupted=stop.interrupted,
        link=link,
    )


def _record_fixed_costs(rows, spec: SweepSpec, name: str, phases: dict[str, float]) -> None:
    from hlm_ray.cpu_plan import record_fixed_costs

    def family(row) -> str:
        return spec.cell_config(row["value"], row["objective"], row["seed"]).model.family

    own = phases["before_trials"] + phases["after_trials"]  # the sweep's, around its trials
    record_fixed_costs(rows, spec.recipe, name, family, sweep_s=own)


def _trial_env(uri: str) -> dict[str, str]:
    env = {TRACKING_URI_ENV: uri}
    # MLflow's "View run" links to the sweep's temporary server would be dead once it exits.
    env.update({k: os.environ[k] for k in QUIET_LINKS if k in os.environ})
    if os.environ.get(CACHE_ENV):  # else every process on this machine uses the same default
        env[CACHE_ENV] = str(Path(os.environ[CACHE_ENV]).expanduser().resolve())
    return env


def _tuner(spec, store: SweepStorage, runtime, search, concurrency, verbose, num_trials):
    from ray import tune

    from hlm_ray.tune.progress import TrialProgress

    trainable = tune.with_resources(
        tune.with_parameters(run_trial, runtime=runtime), trial_resources(runtime)
    )
    TrialProgress.resumed = store.tuner_exists()  # its lines' times start with this run
    if TrialProgress.resumed:
        return tune.Tuner.restore(
            f"{store.tune_path}/{TUNE_DIR}",
            trainable,
            resume_unfinished=True,
            # Keeps the trial id (restart_errored would give a new one, hence a new run folder):
            # the trial finds its folder and continues from its last checkpoint.
            resume_errored=True,
        )
    scheduler = search_alg = None
    if search:
        from ray.tune.schedulers import ASHAScheduler
        from ray.tune.search.basic_variant import BasicVariantGenerator

        # No optuna here: random sampling (BasicVariantGenerator) with ASHA on the validation
        # loss, reported at every checkpoint (a Tune iteration); max_t stays above the number
        # of reports so ASHA never stops a trial that reached its last step.
        cfg = spec.base_config()
        reports = math.ceil(cfg.optim.max_steps / cfg.run.checkpoint_every) + 2
        scheduler = ASHAScheduler(
            time_attr="training_iteration",
            metric=ASHA_METRIC,
            mode="min",
            max_t=reports + 1,
            grace_period=1,
            reduction_factor=2,
        )
        # Given a search algorithm, Tune leaves max_concurrent_trials to it.
        search_alg = BasicVariantGenerator(random_state=0, max_concurrent=concurrency)
    return tune.Tuner(
        trainable,
        param_space=spec.param_space(search=search),
        tune_config=tune.TuneConfig(
            num_samples=spec.search_samples if search else 1,
            max_concurrent_trials=concurrency,
            scheduler=scheduler,
            search_alg=search_alg,
            # A finished trial's actor runs the next trial: no new process and imports. Not
            # under ASHA: a stopped trial's thread is still in its TorchTrainer, so its actor
            # cannot be reused (the next trial would fail) and must end, its trainer with it.
            reuse_actors=not search,
        ),
        run_config=tune.RunConfig(
            name=TUNE_DIR,
            storage_path=store.tune_path,
            failure_config=tune.FailureConfig(max_failures=spec.max_failures),
            # One line per trial start and end on the console; Tune's own tables only with verbose.
            callbacks=[TrialProgress(num_trials, spec.axis.name)],
            verbose=verbose,
        ),
    )


def _rows(
    results, spec: SweepSpec, runtime: TrialRuntime, search: bool, interrupted: bool = False
) -> list[dict]:
    rows = []
    for result in results:
        if result.config is None:  # cancelled before it ran (its actor never started)
            print(f"sweep: trial {Path(result.path).name} never ran; resume the sweep to run it")
            continue
        metrics = result.metrics or {}
        cfg = Config.from_dict(result.config["config"])
        value = result.config["value"]
        trial_id = metrics.get("trial_id", Path(result.path).name)
        error = result.error or metrics.get(TRIAL_ERROR)  # a diverged trial ends without one
        if error:
            status = "FAILED"
        elif "downstream/score" in metrics:
            status = "FINISHED"
        elif interrupted:
            status = "KILLED"  # stopped by Ctrl-C: it continues when the sweep is resumed
        else:
            status = "STOPPED"  # early-stopped by ASHA
        rows.append(
            summary_mod.trial_row(
                trial_id=trial_id,
                run=run_name(cfg.objective.name, spec.axis.short, value, cfg.run.seed, trial_id),
                status=status,
                value=value,
                objective=cfg.objective.name,
                seed=cfg.run.seed,
                metrics=metrics,
                # Ray's wrapped errors end with the real cause
                error=one_line(error, last=True, limit=200) if error else "",
                lr=cfg.optim.lr if search else None,
                warmup_steps=cfg.optim.warmup_steps if search else None,
            )
        )
    order = {v: i for i, v in enumerate(spec.values)}
    return sorted(
        rows,
        key=lambda r: (r["objective"], order.get(r["value"], len(order)), r["seed"], r["trial_id"]),
    )


KILL_SETTLE_S = 5.0


def _close_orphans(rows, spec: SweepSpec, runtime: TrialRuntime) -> None:
    """A trial stopped by ASHA or Ctrl-C was killed mid-run: mark its child MLflow run KILLED
    (and its folder, for `hlm sync`). Its process may still be going down, and what it says on
    its way out (FAILED) has been seen to land after this in CI, although `finish("FAILED")`
    leaves an ended run alone: so the runs are checked for `KILL_SETTLE_S` and marked again."""
    from hlm_ray.tracking import MlflowTracker, read_run_ref
    from hlm_ray.tracking.sync import record_status

    killed = []
    for row in rows:
        if row["status"] not in ("STOPPED", "KILLED"):
            continue
        folder = Path(runtime.trials_dir) / row["run"]
        ref = read_run_ref(folder)
        if ref is not None:
            record_status(folder, "KILLED")
            tracker = MlflowTracker(
                spec.experiment, run_id=ref["run_id"], tracking_uri=runtime.env[TRACKING_URI_ENV]
            )
            tracker.finish("KILLED")
            killed.append(tracker)
    deadline = time.monotonic() + KILL_SETTLE_S
    while killed and time.monotonic() < deadline:
        time.sleep(0.5)
        for tracker in killed:
            if tracker.status() not in ("KILLED", None):  # None: tracking off, or no answer
                tracker.finish("KILLED")
