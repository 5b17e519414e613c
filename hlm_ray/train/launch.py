"""Run the per-worker loop on Ray Train, recorded in MLflow.

    summary = launch(cfg, num_workers=2)                     # local Ray, CPU workers over gloo
    summary = launch(cfg, num_workers=8, use_gpu=True)       # a GPU cluster (RAY_ADDRESS), NCCL

Three layers, as in Ray's docs: `_ray_worker` (per worker: builds the `WorkerEnv` and reporter,
then runs `train_worker`), `launch` (checks the cluster, opens the MLflow run, builds and fits
the `TorchTrainer`), and the CLI. Everything that can be wrong with the request (workers the
cluster can never place, GPUs that do not exist, an unreachable cluster, an unwritable storage
path) is an `HLMError` before any worker starts.

Ray storage: `<storage_path>/<name>` is the run folder itself (`storage_path` defaults to the
parent of `run.output_dir`), so Ray's checkpoints land in `run.output_dir/checkpoint_NNNNNNNN/`
next to `metrics.jsonl` and `model/`, and a trainer rebuilt with the same folder resumes from the
latest one. With a remote `storage_path` (s3://..., a shared file system) the checkpoints go there
and `run.output_dir` keeps the local files of rank 0.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hlm_ray.config import Config, apply_overrides
from hlm_ray.errors import HLMError
from hlm_ray.paths import CACHE_ENV
from hlm_ray.train import checkpoint as ckpt
from hlm_ray.train.inputs import build_corpus, build_tokenizer


class RayReporter:
    """Hands each checkpoint to `ray.train.report`; every rank calls `report` at the same steps
    (Ray requires it: the call is a barrier). Only rank 0 passes a checkpoint folder."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="hlm-ckpt-"))

    def checkpoint_folder(self, step: int) -> Path:
        return self.root / f"{ckpt.PREFIX}{step:08d}"

    def report(self, metrics: dict[str, float], checkpoint_dir: Path | None) -> None:
        import ray.train

        step = int(metrics["step"])
        checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        ray.train.report(
            metrics, checkpoint=checkpoint, checkpoint_dir_name=f"{ckpt.PREFIX}{step:08d}"
        )
        if checkpoint_dir is not None:
            shutil.rmtree(checkpoint_dir, ignore_errors=True)  # Ray copied it to storage


def _ray_worker(loop_config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    from hlm_ray.train.loop import WorkerEnv, train_worker

    # The driver's cache folder (when it set one): its tokenizer and tokenized corpus are here.
    os.environ.update(loop_config.get("env", {}))
    ctx = ray.train.get_context()
    env = WorkerEnv(
        rank=ctx.get_world_rank(),
        world_size=ctx.get_world_size(),
        device=ray.train.torch.get_device(),
    )
    checkpoint = ray.train.get_checkpoint()  # the latest one, after a restart or on --resume
    kwargs = dict(env=env, reporter=RayReporter(), tracking=loop_config["tracking"])
    if checkpoint is None:
        train_worker(loop_config["config"], **kwargs, progress=env.is_main)
        return
    with checkpoint.as_directory() as folder:
        train_worker(loop_config["config"], **kwargs, resume_from=folder, progress=env.is_main)


def connect() -> None:
    """Join the cluster named by RAY_ADDRESS (set by `ray job submit` too), else start one."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address and address not in ("auto", "local"):
        _probe(address)  # ray.init retries an unreachable address for minutes
    try:
        ray.init(address=address or None, log_to_driver=True)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as err:
        raise HLMError(
            f"cannot reach the Ray cluster at RAY_ADDRESS={address}: {str(err).splitlines()[0]}; "
            "start one with `ray start --head` or unset RAY_ADDRESS to run locally"
        ) from None


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


def check_storage(storage_path: str) -> None:
    if "://" in storage_path:
        return  # a remote URI: Ray's pyarrow filesystem reports its own errors
    path = Path(storage_path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".hlm-write-probe-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise HLMError(
            f"storage path {path} is not writable ({err.strerror}); "
            "choose another --output or --storage-path"
        ) from None


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

    ref = read_run_ref(out_dir) if resume else None
    run_id = ref["run_id"] if ref else None
    uri = default_tracking_uri()
    tracker = MlflowTracker(
        experiment,
        out_dir.name,
        tracking_uri=uri,
        run_id=run_id,
        parent_run_id=parent_run_id,
        tags=tags,
    )
    if tracker.run_id is not None:
        write_run_ref(out_dir, tracker.run_id, uri)
        tracker.set_tags({"launcher": "ray_train"})
    return tracker, {"experiment": experiment, "uri": uri, "run_id": tracker.run_id}


def train_local(
    cfg: Config,
    *,
    experiment: str = "hlm_ray",
    resume_from: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The same run in this process, without Ray (`hlm train --local`, fine-tunes in a trial):
    one MLflow run, marked FAILED if training raises."""
    from hlm_ray.train.loop import train_worker

    build_corpus(cfg, build_tokenizer(cfg))  # bad data fails before a run is opened
    tracker, tracking = open_mlflow_run(
        cfg, Path(cfg.run.output_dir), experiment=experiment, resume=resume_from is not None
    )
    try:
        summary = train_worker(
            cfg.to_dict(), tracking=tracking, resume_from=resume_from, progress=progress
        )
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish("FINISHED")
    return summary


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
    gpus_per_worker: float = 1.0,
    parent_run_id: str | None = None,
    tags: dict[str, Any] | None = None,
    callbacks: list[Any] | None = None,
) -> dict[str, Any]:
    """Train `cfg` on `num_workers` Ray Train workers; returns rank 0's run summary.

    A sweep trial (Train inside Tune) passes `parent_run_id` (its MLflow run nests under the
    sweep's), `tags`, and `callbacks=[TuneReportCallback()]` (reports reach Tune)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    cfg.optim.grad_accum_steps(num_workers)  # fails here, not in the workers
    out_dir = Path(cfg.run.output_dir).resolve()
    storage = storage_path or str(out_dir.parent)
    check_storage(storage)
    # Tokenizer and tokenized corpus are built here, once: bad input (a missing corpus, a
    # vocabulary too small, an unreadable tokenizer) fails before any worker starts, and
    # workers on this machine find both in the cache.
    build_corpus(cfg, build_tokenizer(cfg))
    connect()
    if use_gpu is None:
        import ray

        use_gpu = ray.cluster_resources().get("GPU", 0) >= num_workers
    check_resources(num_workers, use_gpu, cpus_per_worker, gpus_per_worker)
    if not resume:
        ckpt.refuse_existing(out_dir)

    # Workers run elsewhere (another cwd, another node): give them absolute paths.
    cfg = apply_overrides(
        cfg,
        {
            "run.output_dir": str(out_dir),
            "data.sources": [
                str(Path(s).resolve()) if Path(s).exists() else s for s in cfg.data.sources
            ],
            **(
                {"data.prepared": str(Path(cfg.data.prepared).resolve())}
                if cfg.data.prepared
                else {}
            ),
        },
    )
    tracker, tracking = open_mlflow_run(
        cfg, out_dir, experiment=experiment, resume=resume, parent_run_id=parent_run_id, tags=tags
    )
    resources = {"CPU": cpus_per_worker, **({"GPU": gpus_per_worker} if use_gpu else {})}
    cache = os.environ.get(CACHE_ENV)
    env = {CACHE_ENV: str(Path(cache).expanduser().resolve())} if cache else {}
    trainer = TorchTrainer(
        _ray_worker,
        train_loop_config={"config": cfg.to_dict(), "tracking": tracking, "env": env},
        scaling_config=ray.train.ScalingConfig(
            num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=resources
        ),
        run_config=ray.train.RunConfig(
            name=out_dir.name,
            storage_path=storage,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            callbacks=callbacks,
        ),
    )
    try:
        result = trainer.fit()
    except Exception as err:
        tracker.finish("FAILED")
        last = ckpt.list_checkpoints(out_dir)
        kept = f"; last checkpoint: {last[-1]}" if last else ""
        raise HLMError(
            f"training failed after {max_failures} restart(s): "
            f"{str(err).strip().splitlines()[-1]}{kept}"
        ) from err
    tracker.finish("FINISHED")
    summary_file = out_dir / "summary.json"
    if summary_file.exists():
        return json.loads(summary_file.read_text())
    return {"metrics": result.metrics or {}, "model_dir": str(out_dir / "model")}
