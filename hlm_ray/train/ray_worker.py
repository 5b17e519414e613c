"""What runs in each Ray Train worker: the `WorkerEnv` from Ray's context, the reporter that
hands checkpoints to Ray, the checkpoint to continue from, then `train_worker`.

    TorchTrainer(ray_worker, train_loop_config={"config": ..., "tracking": ..., "env": ...,
                                                "mirror": ...})
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hlm_ray.errors import HLMError, is_divergence
from hlm_ray.train import checkpoint as ckpt
from hlm_ray.train import run_lock
from hlm_ray.train.run_mirror import PROGRESS, RESULTS, RunMirror
from hlm_ray.train.storage_wait import waiting_on_storage


class RayReporter:
    """Hands each checkpoint to `ray.train.report`; every rank calls `report` at the same steps
    (Ray requires it: the call is a barrier). Only rank 0 passes a checkpoint folder, and first
    brings the run's mirror (when it has one) up to this step: a rank 0 restarted elsewhere
    from this checkpoint then finds the history that leads to it."""

    def __init__(self, out_dir: Path | None = None, mirror: RunMirror | None = None):
        self.root = Path(tempfile.mkdtemp(prefix="hlm-ckpt-"))
        self.out_dir, self.mirror = out_dir, mirror

    def checkpoint_folder(self, step: int) -> Path:
        return self.root / f"{ckpt.PREFIX}{step:08d}"

    def report(self, metrics: dict[str, float], checkpoint_dir: Path | None) -> None:
        import ray.train

        step = int(metrics["step"])
        name = f"{ckpt.PREFIX}{step:08d}"
        if checkpoint_dir is None:  # the other ranks' part of the barrier
            ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=name)
            return
        where = self.mirror.uri if self.mirror is not None else str(Path(self.out_dir).parent)
        with waiting_on_storage(where, step):  # a store that stops answering is said
            if self.mirror is not None:
                self.mirror.push(self.out_dir, PROGRESS)
            checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir)
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)
        shutil.rmtree(checkpoint_dir, ignore_errors=True)  # Ray copied it to storage
        # One line per checkpoint, once it is in the storage (Ray Train's own INFO lines are
        # kept off the console): what a restart continues from, and what the cluster box waits
        # on before it cuts a node.
        print(f"{name} saved", flush=True)


def ray_worker(loop_config: dict[str, Any]) -> None:
    import logging

    import ray.train
    import ray.train.torch

    # A `TrainingReport(...)` dump per checkpoint on the driver's console: Ray Train logs it at
    # INFO through a logger named by its file's path, outside `ray.train`, which the run's
    # `LoggingConfig(log_level="WARNING")` covers. Kept to warnings here.
    with contextlib.suppress(ImportError):
        from ray.train.v2._internal.execution import context as train_context

        logging.getLogger(train_context.__file__).setLevel(logging.WARNING)

    from hlm_ray.train.loop import WorkerEnv, train_worker

    # The driver's cache folder (when it set one): its tokenizer and tokenized corpus are here.
    os.environ.update(loop_config.get("env", {}))
    ctx = ray.train.get_context()
    env = WorkerEnv(
        rank=ctx.get_world_rank(),
        world_size=ctx.get_world_size(),
        device=ray.train.torch.get_device(),
        nodes=worker_nodes(ctx.get_world_size()),
    )
    if env.is_main:  # where the group landed, in the job's log (and the run's tags)
        # Flushed: a worker's stdout is a file (block-buffered), which Ray forwards only once
        # written, at the worker's exit at the latest (after a sweep's summary, once).
        nodes = ", ".join(f"rank {r} {ip}" for r, ip in enumerate(env.nodes))
        print("workers on nodes: " + nodes, flush=True)
    out_dir = Path(loop_config["config"]["run"]["output_dir"])
    if env.is_main:  # the one rank that writes the run folder: only while its driver lives
        run_lock.watch(out_dir, loop_config.get("writer"))
    mirror = RunMirror(loop_config["mirror"]) if loop_config.get("mirror") else None
    reporter = RayReporter(out_dir, mirror if env.is_main else None)
    kwargs = dict(env=env, reporter=reporter, tracking=loop_config["tracking"])
    checkpoint = ray.train.get_checkpoint()  # Ray's latest, after a restart or on --resume
    if checkpoint is not None and mirror is not None and env.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        mirror.pull(out_dir, PROGRESS)  # perhaps another node's: the history so far
    writer = loop_config.get("writer")
    with divergence_ends_the_run(out_dir, writer, mirror if env.is_main else None, env.is_main):
        if checkpoint is None:
            folder = ckpt.latest_valid(out_dir, warn=env.is_main)
            train_worker(loop_config["config"], **kwargs, resume_from=folder, progress=env.is_main)
        else:
            with checkpoint.as_directory() as ray_folder:
                folder = choose_resume(out_dir, Path(ray_folder), warn=env.is_main)
                train_worker(
                    loop_config["config"], **kwargs, resume_from=folder, progress=env.is_main
                )
    if mirror is not None and env.is_main:
        mirror.push(out_dir, RESULTS)  # the driver takes them from there


DIVERGED_FILE = "diverged.json"
"""In a run folder (and its mirror): {"writer": the driver's token, "message": the error}."""


@contextlib.contextmanager
def divergence_ends_the_run(out_dir: Path, writer: str | None, mirror, is_main: bool):
    """A diverged run ends here instead of failing: Ray Train restarts a failed worker group
    (`--max-failures`), which diverged again each time (3 attempts, 173 s, 7 tracebacks and
    the step-0 row three times). The loss every rank checks is averaged over all of them, so
    every rank gets here at the same step and returns; rank 0 first leaves the error for its
    driver (`take_divergence`), which fails the run with it."""
    try:
        yield
    except HLMError as err:
        if not is_divergence(err):
            raise
        if is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            record = {"writer": writer, "message": str(err)}
            (out_dir / DIVERGED_FILE).write_text(json.dumps(record))
            if mirror is not None:
                mirror.push(out_dir, (DIVERGED_FILE,))


def take_divergence(out_dir: Path, writer: str | None, mirror) -> str | None:
    """The divergence this driver's workers left (its own `writer` token: an earlier run's
    file says nothing of this one), removed once read; None when they left none."""
    if mirror is not None:
        mirror.pull(out_dir, (DIVERGED_FILE,))
    path = out_dir / DIVERGED_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError:
        record = {}
    path.unlink()
    return record.get("message") if record.get("writer") == writer else None


def worker_nodes(world_size: int) -> tuple[str, ...]:
    """Every rank's node address, in rank order (all ranks call it: a collective)."""
    import ray.util

    ip = ray.util.get_node_ip_address()
    if world_size == 1:
        return (ip,)
    import torch.distributed as dist

    gathered: list[str | None] = [None] * world_size
    dist.all_gather_object(gathered, ip)
    return tuple(str(g) for g in gathered)


def choose_resume(out_dir: Path, ray_folder: Path | None, *, warn: bool = True) -> Path | None:
    """Where a (re)started worker continues: the newest valid checkpoint in the run folder,
    or Ray's when it is newer (a remote storage path) and valid. Ray's own pick can lag the
    disk (a report still in flight when a worker died) or point at a damaged copy."""
    disk = ckpt.latest_valid(out_dir, warn=warn) if out_dir.is_dir() else None
    ray_ok = ray_folder is not None and ckpt.verify(ray_folder) is None
    if ray_ok and (disk is None or ckpt.checkpoint_step(ray_folder) > ckpt.checkpoint_step(disk)):
        return ray_folder
    return disk
