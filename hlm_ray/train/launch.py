"""Run the per-worker loop on Ray Train, recorded in MLflow.

    summary = launch(cfg, num_workers=2)                     # local Ray, CPU workers over gloo
    summary = launch(cfg, num_workers=8, use_gpu=True)       # a GPU cluster (RAY_ADDRESS), NCCL

Three layers, as in Ray's docs: `ray_worker.ray_worker` (per worker: builds the `WorkerEnv` and
reporter, then runs `train_worker`), `launch` (checks the cluster, opens the MLflow run, builds and fits
the `TorchTrainer`), and the CLI. Everything that can be wrong with the request (workers the
cluster can never place, GPUs that do not exist, an unreachable cluster, an unwritable storage
path) is an `HLMError` before any worker starts.

Ray storage: `<storage_path>/<name>` is the run folder itself (`storage_path` defaults to the
parent of `run.output_dir`), so Ray's checkpoints land in `run.output_dir/checkpoint_NNNNNNNN/`
next to `metrics.jsonl` and `model/`, and a trainer rebuilt with the same folder resumes from the
latest one. With another `storage_path` (s3://..., a shared volume) the checkpoints go there, and
so does a mirror of the run folder (`run_mirror.py`): rank 0 may run on another node, and the
driver takes its results from the storage after the fit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from hlm_ray import cluster
from hlm_ray.cluster import alive_nodes, check_tracking, machines, worker_paths
from hlm_ray.config import Config, apply_overrides
from hlm_ray.errors import HLMError, TrainingDiverged, one_line
from hlm_ray.local_ray import local_cluster_options, quiet_token_notice, starts_local
from hlm_ray.paths import CACHE_ENV
from hlm_ray.train import checkpoint as ckpt
from hlm_ray.train import run_lock
from hlm_ray.train.inputs import build_corpus, build_prepared, build_tokenizer
from hlm_ray.train.preflight import check_output, check_storage, check_workers
from hlm_ray.train.ray_worker import ray_worker, take_divergence
from hlm_ray.train.run_mirror import PROGRESS, RESULTS, RUN_REF, RunMirror

# Ray Train settings, unless the user set them: for short runs, the controller polls its workers
# every 2 s by default, which every report, the start and the end of a fit wait on (seconds per
# trial in a sweep); the preemption watcher (observability only) is one more actor process per
# fit. Ray passes both on from the driver (or trial) to the controller.
RAY_TRAIN_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    # A worker's print as a print (Ray forwards it to the console once), not also as a log
    # record of Ray Train's print patch, which put it on the console a second time.
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}
_own_cluster = False  # whether `connect` started the local cluster this process is on
SWEEP_SYNCS = "the sweep sends its records at its end (`hlm_ray.tune.replay`)"


def connect() -> None:
    """Join the cluster named by RAY_ADDRESS (set by `ray job submit` too) or started on this
    machine by `ray start`, else start a local one of this process (`local_cluster_options`)."""
    global _own_cluster
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address and address not in ("auto", "local"):
        _probe(address)  # ray.init retries an unreachable address for minutes
    local = starts_local(address)
    if local:
        quiet_token_notice()
    attempts = LOCAL_START_ATTEMPTS if local else 1
    for attempt in range(1, attempts + 1):
        try:
            options = local_cluster_options() if local else {}  # a fresh dashboard port each try
            ray.init(address=address or None, log_to_driver=True, **options)
            _own_cluster = local
            return
        except Exception as err:
            first = one_line(err)
            if local and cluster.STARTUP_TIMEOUT in first:  # Ray's bare Exception: a busy machine
                ray.shutdown()
                if attempt < attempts:
                    continue
                raise HLMError(cluster.startup_timeout_message()) from None
            if not isinstance(err, ConnectionError | TimeoutError | RuntimeError | ValueError):
                raise
            if not local:
                raise HLMError(
                    f"cannot reach the Ray cluster at RAY_ADDRESS={address}: {first}; start one "
                    "with `ray start --head` or unset RAY_ADDRESS to run locally"
                ) from None
            ray.shutdown()  # whatever part of the cluster did start
            # A port chosen free can be taken before Ray binds it (another cluster starting at
            # the same moment): a new choice of ports usually succeeds.
            if attempt < attempts and _port_taken(str(err)):
                continue
            raise HLMError(
                f"could not start a local Ray cluster on this machine: {first}; check that "
                "/tmp has free space and the ports are free, or join a running cluster with "
                "RAY_ADDRESS=HOST:6379"
            ) from None


LOCAL_START_ATTEMPTS = 2


def stop_own_cluster() -> None:
    """Shut down the local cluster `connect` started, now, as exit would; a joined one stays."""
    global _own_cluster
    if _own_cluster:
        import ray

        _own_cluster = False
        ray.shutdown()


def _port_taken(message: str) -> bool:
    return "Failed to bind" in message or "already in use" in message or "occupied" in message


def _probe(address: str) -> None:
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError) as err:
        raise HLMError(
            f"cannot reach the Ray cluster at RAY_ADDRESS={address} ({err}); start one with "
            "`ray start --head` or unset RAY_ADDRESS to run locally"
        ) from None


def check_resources(
    num_workers: int, use_gpu: bool, cpus_per_worker: float, gpus_per_worker: float = 1.0
) -> None:
    import ray

    total = ray.cluster_resources()
    if use_gpu and total.get("GPU", 0) < num_workers * gpus_per_worker:
        raise HLMError(
            f"asked for {num_workers} GPU worker(s) × {gpus_per_worker:g} GPU but the cluster has "
            f"{total.get('GPU', 0):g} GPU(s); drop --gpu or lower --num-workers"
        )
    need = num_workers * cpus_per_worker
    if total.get("CPU", 0) < need:
        raise HLMError(
            f"--num-workers {num_workers} × {cpus_per_worker:g} CPU needs {need:g} CPUs but the "
            f"cluster has {total.get('CPU', 0):g}; lower --num-workers or --cpus-per-worker"
        )


def prepare_resume(
    out_dir: Path, resume_from: str | Path | None, cfg: Config | None = None
) -> Path | None:
    """The checkpoint this run continues from (the named one, else the run folder's newest
    valid one, else None for a fresh folder); damaged and superseded checkpoints are moved out
    of the way and Ray's snapshot dropped when it disagrees (see `checkpoint.prepare_resume`)."""
    from hlm_ray.train.resume import check_compatible

    chosen = ckpt.resolve_resume(resume_from) if resume_from else None
    if chosen is None and ckpt.folders(out_dir):
        chosen = ckpt.latest_valid(out_dir, warn=False)
    if chosen is not None and cfg is not None:
        check_compatible(cfg, chosen)  # one line here, not a failing worker group
    # Named, and older than the newest valid one: the later checkpoints are superseded.
    # (Compared resolved: `--resume runs/x` names it relative, the run folder is absolute.)
    newest = ckpt.latest_valid(out_dir, warn=False)
    explicit = chosen is not None and (newest is None or chosen.resolve() != newest.resolve())
    for note in ckpt.prepare_resume(out_dir, chosen, explicit=explicit):
        print(f"warning: {note}", file=sys.stderr)
    if chosen is not None and chosen.parent.resolve() != out_dir.resolve():
        # A checkpoint from another run folder: its files are read in place, not moved.
        return chosen
    return ckpt.latest_valid(out_dir, warn=False) if chosen is not None else None


def finish(tracker, out_dir: Path, status: str, mirror: RunMirror | None = None) -> None:
    """End the MLflow run; the status is also kept in the run folder (and its mirror) so that
    a run whose server was down gets it from `hlm sync`."""
    from hlm_ray.tracking.sync import record_status

    record_status(out_dir, status)
    if mirror is not None:
        mirror.push(out_dir, RUN_REF)
    tracker.finish(status)


def open_mlflow_run(
    cfg: Config,
    out_dir: Path,
    *,
    experiment: str,
    resume: bool,
    parent_run_id: str | None = None,
    tags: dict[str, Any] | None = None,
):
    """The MLflow run of this training run: reopened on --resume (its id is kept in the run
    folder), so a continued run or a restarted worker group never starts a second one.
    `parent_run_id` nests it under a sweep's run."""
    from hlm_ray.tracking import MlflowTracker, default_tracking_uri, read_run_ref, write_run_ref
    from hlm_ray.tracking.base import copied_from

    ref = read_run_ref(out_dir) if resume else None
    run_id = ref["run_id"] if ref else None
    original = copied_from(out_dir, ref) if ref else None
    if original is not None:  # a copy must not write into the original's MLflow run
        print(
            f"warning: {out_dir} is a copy of {original} (both name MLflow run {run_id}): "
            "the copy continues in a new MLflow run",
            file=sys.stderr,
        )
        run_id = None
    uri = default_tracking_uri()
    tracker = MlflowTracker(
        experiment,
        out_dir.name,
        tracking_uri=uri,
        run_id=run_id,
        parent_run_id=parent_run_id,
        tags=tags,
    )
    try:
        if tracker.run_id is not None:
            write_run_ref(out_dir, tracker.run_id, uri)
            tracker.set_tags({"launcher": "ray_train"})
    except BaseException as err:  # a Ctrl-C here must not leave the run RUNNING
        finish(tracker, out_dir, "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED")
        if isinstance(err, KeyboardInterrupt):
            from hlm_ray.train.interrupt import RunInterrupted

            raise RunInterrupted() from None  # the run exists and is KILLED
        raise
    return tracker, {"experiment": experiment, "uri": uri, "run_id": tracker.run_id}


@run_lock.holding(check_output)
def train_local(
    cfg: Config,
    *,
    experiment: str = "hlm_ray",
    resume_from: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The same run in this process, without Ray (`hlm train --local`, fine-tunes in a trial):
    one MLflow run, marked KILLED on Ctrl-C and FAILED if training raises."""
    from hlm_ray.tracking.sync import sync_quietly
    from hlm_ray.train.interrupt import RunInterrupted
    from hlm_ray.train.loop import train_worker

    out_dir = Path(cfg.run.output_dir)
    check_output(out_dir)
    # Bad input (an unreadable corpus, a tokenizer that cannot be built) fails before an MLflow
    # run exists; both are cached, so the training function finds them built.
    build_corpus(cfg, build_tokenizer(cfg))
    if resume_from is not None:
        resume_from = prepare_resume(out_dir, resume_from, cfg) or resume_from
    tracker, tracking = open_mlflow_run(
        cfg, out_dir, experiment=experiment, resume=resume_from is not None
    )
    try:
        summary = train_worker(
            cfg.to_dict(), tracking=tracking, resume_from=resume_from, progress=progress
        )
    except KeyboardInterrupt:
        finish(tracker, out_dir, "KILLED")
        raise RunInterrupted() from None
    except BaseException:
        finish(tracker, out_dir, "FAILED")
        raise
    finish(tracker, out_dir, "FINISHED")
    if tracker.run_id is not None:
        note = sync_quietly(out_dir)
        if note:
            print(note, file=sys.stderr)
    return summary


@run_lock.holding(check_output)  # one writer per run folder, its workers included
def launch(
    cfg: Config,
    *,
    num_workers: int = 1,
    use_gpu: bool | None = None,
    cpus_per_worker: float = 1.0,
    max_failures: int = 2,
    storage_path: str | None = None,
    experiment: str = "hlm_ray",
    resume: bool = False,
    resume_from: str | Path | None = None,
    gpus_per_worker: float = 1.0,
    parent_run_id: str | None = None,
    tags: dict[str, Any] | None = None,
    callbacks: list[Any] | None = None,
    local: bool = False,
    placement_timeout_s: float | None = None,
) -> dict[str, Any]:
    """Train `cfg` on `num_workers` Ray Train workers; returns rank 0's run summary.

    `resume` continues the run folder from its newest valid checkpoint; `resume_from` names a
    checkpoint folder to continue from instead (later ones are removed). A sweep trial (Train
    inside Tune) passes `parent_run_id` (its MLflow run nests under the sweep's), `tags`, and
    `callbacks=[TuneReportCallback()]` (reports reach Tune); `local`: one worker, in-process.
    `placement_timeout_s`: how long, in all, the run waits for the cluster to place its workers
    (`placement_wait.PLACEMENT_TIMEOUT_S` by default) before it fails."""
    launched_at = time.time()
    for key, value in RAY_TRAIN_ENV.items():
        os.environ.setdefault(key, value)
    import ray.train

    from hlm_ray.tracking.sync import sync_quietly
    from hlm_ray.train import placement_wait as placement
    from hlm_ray.train.interrupt import RunInterrupted, restore_sigint, trainer_class
    from hlm_ray.train.local_mode import local_worker
    from hlm_ray.train.network import torch_config

    check_workers(num_workers)
    cfg.optim.grad_accum_steps(num_workers)  # fails here, not in the workers
    out_dir = Path(cfg.run.output_dir).resolve()
    resume = resume or resume_from is not None
    check_output(out_dir)
    storage = storage_path or str(out_dir.parent)
    check_storage(storage)
    if local and RunMirror.of(out_dir, storage) is not None:
        # local mode hands Ray no checkpoint: they stay in the run folder, never mirrored
        raise HLMError(
            f"local mode trains with the run folder as its storage, not {storage}: "
            "leave --storage-path out, or train on Ray Train workers"
        )
    # Tokenizer and tokenized corpus are built here, once: bad input (a missing corpus, a
    # vocabulary too small, an unreadable tokenizer) fails before any worker starts, and
    # workers on this machine find both in the cache.
    build_corpus(cfg, build_tokenizer(cfg))
    connect()
    if use_gpu is None:
        import ray

        use_gpu = ray.cluster_resources().get("GPU", 0) >= num_workers
    check_resources(num_workers, use_gpu, cpus_per_worker, gpus_per_worker)
    mirror = RunMirror.of(out_dir, storage)
    if not resume:
        ckpt.refuse_existing(out_dir)
        if mirror is not None and mirror.has_checkpoints():
            raise HLMError(
                f"{mirror.uri} holds checkpoints of an earlier run named {out_dir.name}; "
                f"continue it with `hlm train --resume {mirror.uri}`, or choose another --output"
            )
    elif mirror is None:
        # The run folder is Ray's storage: the newest valid checkpoint in it decides.
        prepare_resume(out_dir, resume_from, cfg)

    # Workers run elsewhere (another cwd, another node): give them absolute paths, the one
    # tracking server and the prepared corpus they all reach (`hlm_ray.cluster`).
    from hlm_ray.tracking import default_tracking_uri

    num_machines = machines(alive_nodes())
    check_tracking(default_tracking_uri(), num_machines)
    paths = worker_paths(cfg, storage, num_machines, prepared=lambda: build_prepared(cfg))
    cfg = apply_overrides(cfg, {"run.output_dir": str(out_dir), **paths})
    tracker, tracking = open_mlflow_run(
        cfg, out_dir, experiment=experiment, resume=resume, parent_run_id=parent_run_id, tags=tags
    )
    if mirror is not None:  # the run's MLflow id, for a driver on another node (a sweep's)
        mirror.push(out_dir, RUN_REF)
    resources = {"CPU": cpus_per_worker, **({"GPU": gpus_per_worker} if use_gpu else {})}
    cache = os.environ.get(CACHE_ENV)
    env = {CACHE_ENV: str(Path(cache).expanduser().resolve())} if cache else {}
    loop_config = {
        "config": cfg.to_dict(),
        "tracking": tracking,
        "env": env,
        "mirror": mirror.uri if mirror else None,
        "writer": run_lock.token(out_dir),  # rank 0 stops writing once this driver is gone
    }
    workers, worker_fn = (0, local_worker) if local else (num_workers, ray_worker)
    waits = placement.placement_wait(num_workers, resources, placement_timeout_s)
    trainer = None
    fit_at = time.time()
    # The MLflow run is open from here: a Ctrl-C anywhere below, building the trainer included
    # (before fit() installs its handler), ends it KILLED, never RUNNING.
    try:
        trainer = trainer_class()(
            worker_fn,
            train_loop_config=loop_config,
            torch_config=torch_config(),  # gloo on the address other nodes reach
            scaling_config=ray.train.ScalingConfig(
                num_workers=workers, use_gpu=use_gpu, resources_per_worker=resources
            ),
            run_config=ray.train.RunConfig(
                name=out_dir.name,
                storage_path=storage,
                checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
                failure_config=ray.train.FailureConfig(
                    max_failures=max_failures, controller_failure_limit=waits.retries
                ),
                callbacks=[*(callbacks or []), waits],
                # Ray Train's INFO lines (a `TrainingReport(...)` dump per checkpoint) stay in
                # the session's log files, off the console.
                logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            ),
        )
        fit_at = time.time()
        with restore_sigint():
            result = trainer.fit()
        if trainer.interrupted:
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        finish(tracker, out_dir, "KILLED", mirror)
        raise RunInterrupted() from None
    except Exception as err:
        if trainer is not None and trainer.interrupted:  # Ray's abort surfaced as an error
            finish(tracker, out_dir, "KILLED", mirror)
            raise RunInterrupted() from None
        finish(tracker, out_dir, "FAILED", mirror)
        if mirror is not None:  # the history so far, for `hlm sync`; checkpoints stay there
            mirror.pull(out_dir, PROGRESS)
        last = ckpt.latest_valid(out_dir, warn=False)
        kept = f"; last checkpoint: {last}" if last else ""
        if mirror is not None and last is None:
            kept = f"; its checkpoints are in {mirror.uri}"
        why = waits.failure(err) or (
            f"training failed after {max_failures} restart(s): {str(err).strip().splitlines()[-1]}"
        )
        raise HLMError(f"{why}{kept}") from err
    except BaseException:
        finish(tracker, out_dir, "FAILED", mirror)
        raise
    diverged = take_divergence(out_dir, loop_config["writer"], mirror)
    if diverged is not None:  # every worker stopped at that step: no restart, no retry
        finish(tracker, out_dir, "FAILED", mirror)
        raise TrainingDiverged(diverged)
    fit_s = time.time() - fit_at
    if mirror is not None:  # rank 0's results, from whichever node it ran on
        mirror.pull(out_dir, RESULTS)
    else:
        # Ray keeps `num_to_keep` of the checkpoints it reported; the one a resume fell back to
        # (Ray's snapshot dropped) is not among them and would stay forever.
        ckpt.prune_checkpoints(out_dir, cfg.run.keep_checkpoints)
    finish(tracker, out_dir, "FINISHED", mirror)
    if tracker.run_id is not None:  # what the workers could not send (a tracking outage)
        note = sync_quietly(out_dir, SWEEP_SYNCS if parent_run_id else None)
        if note:
            print(note, file=sys.stderr)
    summary_file = out_dir / "summary.json"
    if not summary_file.exists():
        return {"metrics": result.metrics or {}, "model_dir": str(out_dir / "model")}
    summary = json.loads(summary_file.read_text())
    worker = summary.get("seconds") or {}
    if "entered_at" in worker:
        # Ray Train's share of the fit: controller and worker processes starting, placement,
        # process group, and after the loop: the last report, polling and teardown.
        start = worker["entered_at"] - fit_at
        worker.update(fit=fit_s, ray_start=start, ray_end=fit_s - start - worker["worker"])
        worker.update(before_fit=fit_at - launched_at)
    return summary
