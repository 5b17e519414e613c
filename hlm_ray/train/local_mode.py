"""Ray Train's local mode for one-worker trials: the training function in the trial's process.

    if local_mode(workers, use_gpu, alive_nodes):
        launch(cfg, num_workers=1, local=True)      # ScalingConfig(num_workers=0)

A `TorchTrainer` with workers starts a controller, a placement-group cleaner and a worker
process, each importing Ray Train (the worker torch and transformers too): 15-25 s before the
first step on 2 cores, most of a small trial. With `ScalingConfig(num_workers=0)` Ray Train
runs the function in the calling process instead. What changes, and what does not:

- the function (`local_worker`) is `hlm train --local`'s: inside a Tune trial the `ray.train`
  API refuses to run (it points to `ray.tune`'s), and in local mode Ray would keep no
  checkpoint anyway (its `report` only remembers the last one). So the worker writes its
  checkpoints to the run folder itself; the run folder is Ray's storage anyway, so a resumed or
  retried trial finds them where it always looks;
- failures: no worker-group restarts (`FailureConfig` is the controller's); Tune's retries of
  the trial (`sweep.max_failures`) resume from the run folder's newest valid checkpoint;
- reports: Train callbacks do not run, so trials whose reports Tune needs (ASHA's `--search`)
  keep a worker group;
- storage: Ray gets no checkpoint to copy, so a run stored elsewhere than its folder's parent
  (`--storage-path`, mirrored by `RunMirror`) keeps a worker group; `launch` refuses the pair.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def local_mode(num_workers: int, use_gpu: bool, nodes: list[dict[str, Any]]) -> bool:
    """Whether a trial's training can run in the trial's own process (Ray Train's local mode,
    `ScalingConfig(num_workers=0)`): one CPU worker on a one-node cluster (`nodes`: the alive
    ones). It saves a TorchTrainer's start (a controller, a placement-group cleaner and a worker
    process, each importing Ray Train and torch: 15-25 s on 2 cores); the checkpoints go to the
    run folder as `hlm train --local` writes them, so a retried trial (Tune's retries: local
    mode has no worker-group restarts) resumes from them. Several nodes, several workers or a
    GPU keep a worker group (where the trial's process runs is not where Train would place
    the worker, and its checkpoints are local files)."""
    return num_workers == 1 and not use_gpu and len(nodes) == 1


def local_worker(loop_config: dict[str, Any]) -> None:
    """The training function of a local-mode trainer (the `launch` loop config): rank 0 of 1 on
    the CPU, checkpoints in the run folder, continuing from its newest valid one."""
    import os

    from hlm_ray.train import checkpoint as ckpt
    from hlm_ray.train.loop import train_worker
    from hlm_ray.train.ray_worker import divergence_ends_the_run

    os.environ.update(loop_config.get("env", {}))  # the driver's cache folder
    cfg = loop_config["config"]
    out_dir = Path(cfg["run"]["output_dir"])
    resume = ckpt.latest_valid(out_dir) if out_dir.is_dir() else None
    with divergence_ends_the_run(out_dir, loop_config.get("writer"), None, is_main=True):
        train_worker(cfg, tracking=loop_config["tracking"], resume_from=resume)
