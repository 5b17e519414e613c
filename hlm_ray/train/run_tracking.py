"""What a training run tells its tracker: where it logs, its tags, its artifacts.

    tracker = open_tracker(out_dir, tracking, resuming=False)  # metrics.jsonl (+ MLflow run)
    tracker.set_tags(run_tags(cfg, tokenizer, env, model, step_cost))
    log_artifacts(tracker, out_dir, cfg)    # config.yaml, the final model, the loss curve

MLflow itself is only reached through `hlm_ray.tracking`: with no MLflow run (`tracking` None,
or no run id) the run logs to `<output_dir>/metrics.jsonl` alone.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from hlm_ray.config import Config
from hlm_ray.flops import k_tags
from hlm_ray.model_card import write_model_card
from hlm_ray.models import num_parameters
from hlm_ray.tracking import JsonlTracker, MultiTracker, Tracker, read_metrics
from hlm_ray.train.run_lock import check_writer
from hlm_ray.train.run_state import WorkerEnv
from hlm_ray.train.summary import plot_loss_curve


def open_tracker(out_dir: Path, tracking: dict[str, Any] | None, resuming: bool = False) -> Tracker:
    """metrics.jsonl, plus the MLflow run `tracking` names ({"uri", "run_id", "experiment"})."""
    if not tracking or tracking.get("run_id") is None:  # no MLflow run could be opened
        return WriterJsonl(out_dir)
    from hlm_ray.tracking import MlflowTracker
    from hlm_ray.tracking.sync import SkipLogged, last_logged_step

    mlflow = MlflowTracker(
        tracking["experiment"], tracking_uri=tracking["uri"], run_id=tracking["run_id"]
    )
    # Steps redone after a restart (from a checkpoint, or from step 0 before the first one,
    # perhaps on another node) were sent to MLflow already by the attempt that died: the run
    # itself says up to where. What it lacks below that, the end of the run sends from
    # metrics.jsonl (`sync_quietly`).
    sent = mlflow.last_step("train/loss")
    if resuming:
        sent = max(sent, last_logged_step(out_dir))
    if sent >= 0:
        mlflow = SkipLogged(mlflow, sent)
    return MultiTracker(WriterJsonl(out_dir), mlflow)  # the file first: MLflow only after it


class WriterJsonl(JsonlTracker):
    """metrics.jsonl and params.json, written only while this worker's driver holds the run
    folder (`run_lock.check_writer`: an orphan stops here, before the MLflow run too)."""

    def log_params(self, params: dict[str, Any]) -> None:
        check_writer()
        super().log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        check_writer()
        super().log_metrics(metrics, step)


def run_tags(cfg: Config, tokenizer, env: WorkerEnv, model, step_cost) -> dict[str, Any]:
    """The tags a fresh run starts with: K and K/V, the head's FLOP share, what was trained."""
    return {
        **k_tags(step_cost.target_rows, len(tokenizer)),
        "head_flop_share": round(step_cost.head_share, 4),
        "cross_worker_negatives": cfg.objective.cross_worker_negatives,
        "objective": cfg.objective.name,
        "arch": cfg.model.arch,
        "family": cfg.model.family,
        "vocab_size": len(tokenizer),
        "world_size": env.world_size,
        **({"worker_nodes": ",".join(env.nodes)} if env.nodes else {}),
        "parameters": num_parameters(model),
    }


def log_artifacts(tracker: Tracker, out_dir: Path, cfg: Config) -> None:
    """The resolved config, the final model (HF format, tokenizer inside) and the loss curve."""
    config_path = out_dir / "config.yaml"
    cfg.save(config_path)
    tracker.log_artifact(config_path)
    write_model_card(out_dir / "model")  # README.md: headless or vanilla, corpus, steps, tokens
    tracker.log_artifact(out_dir / "model", "model")
    with contextlib.suppress(ModuleNotFoundError):  # no matplotlib (a bare node): no loss PNG
        tracker.log_artifact(plot_loss_curve(read_metrics(out_dir), out_dir / "loss_curve.png"))
