"""One sweep trial: pretrain through a TorchTrainer (Train inside Tune), run the downstream
protocol, report the final metrics to Tune.

    trainable = tune.with_resources(tune.with_parameters(run_trial, runtime=runtime),
                                    TRIAL_RESOURCES)

Tune calls `run_trial(params)`; `params["config"]` is a whole `Config` as a dict (the grid values
already in it) and `params["value"]` the axis value it stands for. The trial's run folder is named from its cell and trial id, never a timestamp, so
a retried or resumed trial finds its own folder: the TorchTrainer (same storage path and name)
continues from its last checkpoint, the MLflow child run (its id is in the folder) continues,
and finished stages (`summary.json`, `downstream.json`) are not redone.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hlm_ray.cluster import alive_nodes, pin_prepared
from hlm_ray.config import Config, apply_overrides
from hlm_ray.errors import TrainingDiverged
from hlm_ray.flops import config_step_flops
from hlm_ray.tracking.base import DOWNSTREAM_FILE, RUN_REF_FILE, read_run_ref
from hlm_ray.train.run_mirror import RunMirror

# The trial function itself only waits on its trainer and downstream task: it takes no CPU
# (0.01 CPU per trial would leave a 2-CPU machine unable to run two 1-CPU trials side by side),
# only a token of memory, because a placement group bundle cannot be empty.
TRIAL_RESOURCES = {"cpu": 0, "memory": 64 * 2**20}
DONE_FILES = ("summary.json", DOWNSTREAM_FILE, RUN_REF_FILE)
"""What tells a retried trial which stages are done, and its MLflow run."""
NO_DOWNSTREAM = "none"  # `sweep.recipe=none`: pretraining only
TRIAL_ERROR = "trial/error"
"""What a trial that ended without retries reports: why it failed (a diverged run)."""


@dataclass(frozen=True)
class TrialRuntime:
    """What the trials of one invocation share; kept out of Tune's `param_space` because it
    may change when the sweep is resumed (a new tracking server, other resources)."""

    sweep: str
    kind: str
    experiment: str
    parent_run_id: str | None
    trials_dir: str
    recipe: str
    workers: int
    cpus_per_worker: float
    gpus_per_worker: float
    env: dict[str, str] = field(default_factory=dict)
    """Environment for the trial, its workers and its downstream task: the tracking URI and
    the driver's cache folder (where the tokenizers and corpora were prepared)."""
    short: str = ""
    """The axis's run-name prefix (`Axis.short`)."""
    max_failures: int = 0
    """Restarts of the trial's Train worker group (`sweep.max_failures`)."""
    report_steps: bool = True
    """Pass each checkpoint's metrics on to Tune (`TuneReportCallback`): what ASHA compares.
    A grid sweep without a scheduler goes without: the callback's queue is one more actor
    process per trial (1.4 s of CPU on 2 cores), and each trial's MLflow run and progress bar
    already show its steps."""
    storage: str | None = None
    """The trials' Ray Train storage (`SweepStorage.trials`); None: their run folders in
    `trials_dir`, which every node then mounts. Else each trial's run folder is mirrored there
    (`RunMirror`), wherever its trial, its rank 0 and its downstream step run."""
    prepared: dict[str, str] = field(default_factory=dict)
    """The prepared corpora published for a cluster's nodes (`cluster.pin_prepared`)."""
    placement_timeout_s: float | None = None
    """How long its worker group may wait to be placed (`sweep.placement_timeout_s`)."""
    local: bool = False
    """Train in the trial's own process (`hlm_ray.train.local_mode`; the trial then holds the
    worker's CPUs, `trial_resources`); Tune's retries stand in for worker-group restarts."""


def local_trials(
    spec, nodes: list[dict[str, float]], search: bool, storage: str | None = None
) -> bool:
    """Whether the trials of sweep `spec` (a `SweepSpec`) train in their own process: one CPU
    worker each on a one-node cluster (`nodes`), `sweep.local_trials` on, not a search (ASHA
    compares the reports that only a worker group passes on to Tune), and the run folders are
    the trials' storage (`storage` None: local mode hands Ray no checkpoint to mirror)."""
    from hlm_ray.train.local_mode import local_mode

    if not spec.local_trials or search or storage is not None:
        return False
    return local_mode(spec.workers_per_trial, spec.gpus_per_worker > 0, nodes)


def trial_resources(runtime: TrialRuntime) -> dict[str, float]:
    """What a trial's own process reserves: a token (its TorchTrainer's workers hold the CPUs),
    or in local mode the one worker's CPUs, since it trains there."""
    if not runtime.local:
        return TRIAL_RESOURCES
    return {**TRIAL_RESOURCES, "cpu": runtime.cpus_per_worker}


def run_name(objective: str, short: str, value: Any, seed: int, trial_id: str) -> str:
    """`headless-v512-s0-<trial id>`: readable in `mlflow ui`, stable across retries."""
    return f"{objective}-{short}{value}-s{seed}-{trial_id}"


def run_trial(params: dict[str, Any], runtime: TrialRuntime) -> None:
    started = time.perf_counter()
    cfg = Config.from_dict(params["config"])
    import ray.tune

    os.environ.update(runtime.env)
    trial_id = ray.tune.get_context().get_trial_id()
    name = run_name(cfg.objective.name, runtime.short, params["value"], cfg.run.seed, trial_id)
    out_dir = Path(runtime.trials_dir) / name
    cfg = pin_prepared(apply_overrides(cfg, {"run.output_dir": str(out_dir)}), runtime.prepared)
    mirror = RunMirror(f"{runtime.storage}/{name}") if runtime.storage else None
    if mirror is not None:  # an earlier attempt's stages, perhaps done on another node
        mirror.pull(out_dir, (*DONE_FILES, "model"))
    try:
        summary, trained_now = _pretrain(cfg, runtime, out_dir, trial_id)
    except TrainingDiverged as err:
        # Its settings diverge: Tune's retries (sweep.max_failures) would diverge again. The
        # trial ends here, reporting why; the sweep counts it FAILED (`sweep._rows`).
        ray.tune.report({TRIAL_ERROR: str(err)})
        return
    pretrained = time.perf_counter()
    scores = _downstream(runtime, out_dir, Path(summary["model_dir"]), mirror)
    finished = time.perf_counter()
    metrics = final_metrics(cfg, summary, scores, runtime.workers)
    metrics.update(trial_times(summary, started, pretrained, finished, trained_now=trained_now))
    _log_times(runtime, out_dir, metrics)
    ray.tune.report(metrics)


def trial_times(
    summary: dict[str, Any],
    started: float,
    pretrained: float,
    finished: float,
    *,
    trained_now: bool = True,
) -> dict[str, float]:
    """Where this attempt's wall time went (seconds). `trial/overhead_s` is all but the
    optimizer steps: Ray Train start-up and teardown (`trainer`), the worker's model and data
    set-up, checkpoints with their reports, and the downstream step. A trial whose training
    finished in an earlier attempt (a resumed sweep) ran no step now: its summary's seconds are
    that attempt's, so this attempt's overhead is all of its wall time (it was negative)."""
    worker = (summary.get("seconds") or {}) if trained_now else {}
    train = float(worker.get("train", 0.0))
    pretrain = pretrained - started
    out = {
        "trial/wall_s": finished - started,
        "trial/pretrain_s": pretrain,
        "trial/train_s": train,
        "trial/downstream_s": finished - pretrained,
        "trial/overhead_s": finished - started - train,
        # Neither optimizer steps nor the downstream protocol: Ray Train's start and teardown,
        # the worker's set-up, evaluation and checkpoints.
        "trial/pretrain_overhead_s": pretrain - train,
    }
    if worker:  # this attempt trained
        out["trial/worker_setup_s"] = float(worker["setup"])
        out["trial/checkpoint_s"] = float(worker["checkpoint"])
        out["trial/trainer_s"] = pretrain - float(worker["worker"])
    for key in ("before_fit", "ray_start", "ray_end"):  # launch's split of trainer_s
        if key in worker:
            out[f"trial/{key}_s"] = float(worker[key])
    return out


def _log_times(runtime: TrialRuntime, out_dir: Path, metrics: dict[str, float]) -> None:
    """The time accounting on the trial's own MLflow run too (the child run is closed)."""
    ref = read_run_ref(out_dir)
    if ref is None:
        return
    from hlm_ray.tracking import MlflowTracker

    times = {k: v for k, v in metrics.items() if k.startswith("trial/")}
    # Reopened (set back to RUNNING) to log, then closed again.
    tracker = MlflowTracker(runtime.experiment, run_id=ref["run_id"])
    tracker.log_metrics(times, step=0)
    tracker.finish("FINISHED")


def _pretrain(
    cfg: Config, runtime: TrialRuntime, out_dir: Path, trial_id: str
) -> tuple[dict[str, Any], bool]:
    """The run's summary, and whether this attempt trained (False: an earlier one finished)."""
    done = _finished_summary(out_dir, cfg.optim.max_steps)
    if done is not None:  # a retry (or a resumed sweep): training is complete
        _replay_missed(out_dir)
        return done, False
    from ray.tune.integration.ray_train import TuneReportCallback

    from hlm_ray.train.launch import launch

    tags = {
        "sweep": runtime.sweep,
        "sweep_kind": runtime.kind,
        "trial_id": trial_id,
        "seed": cfg.run.seed,
        "ray_train": "local" if runtime.local else "workers",  # where the training ran
    }
    summary = launch(
        cfg,
        storage_path=runtime.storage,
        num_workers=runtime.workers,
        use_gpu=runtime.gpus_per_worker > 0,
        cpus_per_worker=runtime.cpus_per_worker,
        gpus_per_worker=runtime.gpus_per_worker,
        # A lost worker (its node gone): Train restarts the group from the last checkpoint,
        # waiting until it can be placed again. Tune retries the trial itself (its actor lost,
        # training failing `max_failures` times), which continues from the same checkpoints;
        # a retried trial fails at once when the cluster has too few CPUs left.
        max_failures=0 if runtime.local else runtime.max_failures,
        experiment=runtime.experiment,
        resume=True,  # a fresh folder starts fresh; a retried trial's folder continues
        parent_run_id=runtime.parent_run_id,
        tags=tags,
        callbacks=[TuneReportCallback()] if runtime.report_steps else [],
        local=runtime.local,
        placement_timeout_s=runtime.placement_timeout_s,
    )
    return summary, True


def _replay_missed(out_dir: Path) -> None:
    """Send MLflow the steps of `metrics.jsonl` it lacks. A worker that outlived a SIGKILLed
    sweep wrote its last steps with the sweep's tracking server gone; the run that would have
    replayed them never ended, and a resumed sweep skips the finished training."""
    from hlm_ray.tracking.sync import sync_quietly

    if read_run_ref(out_dir) is not None:
        note = sync_quietly(out_dir)
        if note:
            print(f"{out_dir.name}: {note}", file=sys.stderr)


def _finished_summary(out_dir: Path, max_steps: int) -> dict[str, Any] | None:
    path = out_dir / "summary.json"
    if not path.is_file() or not (out_dir / "model").is_dir():
        return None
    summary = json.loads(path.read_text())
    budget = summary.get("budget")  # a budgeted run's steps are what its budget became
    if budget and budget.get("budget/kind") == "seconds":
        max_steps = summary.get("steps")  # stopped at its deadline (or at optim.max_steps)
    elif budget:
        max_steps = budget.get("budget/steps", max_steps)
    speed = summary.get("tokens_per_s")
    if summary.get("steps") != max_steps or not isinstance(speed, int | float):
        return None
    if not math.isfinite(speed):
        return None
    return summary


def _downstream(
    runtime: TrialRuntime, out_dir: Path, model_dir: Path, mirror: RunMirror | None = None
) -> dict[str, float]:
    """`run_downstream`, logging into the trial's MLflow run (nothing for `sweep.recipe=none`).
    With GPU workers, or on a cluster of several nodes, it runs in an actor holding one worker's
    resources (the trial function holds none, and may sit on a head node sized for drivers),
    started again elsewhere if its node is lost (`remote_step`); on one machine's CPUs it runs
    here, in the trial's process, once its trainer has given the worker's CPUs back. On another
    node the step finds the model through the run's mirror."""
    if runtime.recipe == NO_DOWNSTREAM:
        return {}
    path = out_dir / DOWNSTREAM_FILE
    if path.is_file():
        return json.loads(path.read_text())
    ref = read_run_ref(out_dir)
    run_id = ref["run_id"] if ref else None
    args = (str(model_dir), runtime.recipe, str(out_dir / "downstream"), runtime.experiment)
    try:
        if runtime.gpus_per_worker > 0 or len(alive_nodes()) > 1:
            from hlm_ray.tune.remote_step import run_on_a_node

            scores, logged = run_on_a_node(
                _downstream_task,
                (*args, run_id, runtime.env, mirror),
                cpus=runtime.cpus_per_worker,
                gpus=runtime.gpus_per_worker,
                attempts=1 + max(1, runtime.max_failures),
            )
        else:
            scores, logged = _downstream_task(*args, run_id, runtime.env)
    except BaseException:
        if run_id:  # the task may never have started: the child run must not say FINISHED
            from hlm_ray.tracking import MlflowTracker

            MlflowTracker(runtime.experiment, run_id=run_id).finish("FAILED")
        raise
    path.write_text(json.dumps(scores, indent=1))
    if logged:  # else the scores wait in the folder for a sync (the sweep's end, `hlm sync`)
        from hlm_ray.tracking.sync import logged_downstream

        logged_downstream(out_dir)
    if mirror is not None:
        mirror.push(out_dir, (DOWNSTREAM_FILE, RUN_REF_FILE))
    return scores


def _downstream_task(
    model_dir: str,
    recipe: str,
    output_dir: str,
    experiment: str,
    run_id: str | None,
    env: dict[str, str],
    mirror: RunMirror | None = None,
) -> tuple[dict[str, float], bool]:
    """The scores, and whether they reached the MLflow run (a tracking server that did not
    answer turns the tracker off: the scores then reach it from `downstream.json`)."""
    os.environ.update(env)
    import ray.util

    # Where it runs, on a cluster of several nodes (one may be lost); on one machine the line
    # would only reach the sweep's console through Ray's log forwarding, as noise.
    if ray.is_initialized() and len(ray.nodes()) > 1:
        where = ray.util.get_node_ip_address()
        print(f"{Path(output_dir).parent.name}: downstream step on node {where}", flush=True)
    if mirror is not None and not Path(model_dir).is_dir():  # a task on another node
        mirror.pull(Path(model_dir).parent, ("model",))
    from hlm_ray.downstream import run_downstream
    from hlm_ray.tracking import MlflowTracker, Tracker

    tracker = MlflowTracker(experiment, run_id=run_id) if run_id else Tracker()
    try:
        scores = run_downstream(
            Path(model_dir),
            recipe=recipe,
            output_dir=Path(output_dir),
            tracker=tracker,
            progress=False,
        )
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish("FINISHED")
    scores = {k: float(v) for k, v in scores.items() if isinstance(v, int | float)}
    return scores, bool(getattr(tracker, "active", False))


def final_metrics(
    cfg: Config, summary: dict[str, Any], scores: dict[str, float], workers: int
) -> dict[str, float]:
    """What a trial reports: downstream score, the two bits per byte (where the model has a head),
    the objective's loss, tokens/s, peak memory, the head's FLOP share, K, V and K/V."""
    metrics = summary.get("metrics") or {}
    vocab = int(summary["vocab_size"])
    U = metrics.get("train/U")  # measured; None: the min(W·K, V) bound
    step = config_step_flops(
        cfg, vocab, world_size=workers, unique_columns=None if U is None else int(U)
    )
    rows = float(metrics.get("train/K", step.target_rows))
    # Two different quantities, kept apart. text_bpb: held-out text scored by a model with a
    # head (decoders: the fine-tuned generator). token_bpb: pretraining validation of a
    # vocabulary head over the target tokens' bytes (a headless model has none).
    text_bpb = scores.get("bpb", scores.get("bpb/bits_per_byte", math.nan))
    out = {
        **{k: v for k, v in metrics.items() if isinstance(v, int | float)},
        **scores,
        "downstream/score": scores.get("downstream/score", math.nan),
        "text_bpb": text_bpb,
        "token_bpb": metrics.get("val/token_bpb", math.nan),
        "loss": metrics.get("val/loss", metrics.get("train/loss", math.nan)),
        "train/loss": metrics.get("train/loss", math.nan),
        "tokens_per_s": summary.get("tokens_per_s", math.nan),
        "peak_mem_mb": metrics.get("train/peak_mem_mb", math.nan),
        "head_flop_share": step.head_share,
        "K": rows,
        "V": float(vocab),
        "K_over_V": rows / vocab,
    }
    return {k: float(v) for k, v in out.items() if v is not None}
