"""Ray Train end to end on the shared local cluster: 2 CPU workers, a worker killed mid-run,
MLflow on a temporary sqlite store. Few tests, each a whole run: a TorchTrainer costs 15-40 s."""

import pytest
from tiny_runs import expected_target_counts, tiny_run_cfg
from transformers import AutoModelForCausalLM

from hlm_ray.errors import HLMError
from hlm_ray.tracking import read_metrics
from hlm_ray.train import checkpoint as ckpt
from hlm_ray.train.launch import launch
from hlm_ray.train.loop import train_worker
from hlm_ray.unigram import COUNTS_FILE, load_counts

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def cfg_for(out, **extra):
    # Micro-batches of 8: 2 workers × 8 == 1 process × 8 × 2 accumulation steps.
    return tiny_run_cfg(out, steps=16, every=(1, 16, 8), batch=(16, 8), **extra)


def test_two_workers_survive_a_killed_worker_and_log_one_mlflow_run(
    ray_cluster, mlflow_store, tmp_path
):
    from mlflow import MlflowClient

    cfg = cfg_for(tmp_path / "ray-run", **{"run.fail_at_step": 11})
    summary = launch(cfg, num_workers=2, max_failures=2, experiment="test-ray")

    # The last rank raised at step 11; the group restarted from checkpoint 8 and finished.
    assert (tmp_path / "ray-run" / ".failed_at_11").exists()
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path / "ray-run")] == [8, 16]
    assert summary["steps"] == 16

    # After the restart, the losses match an uninterrupted single-process run step for step.
    reference = cfg_for(tmp_path / "bare")
    train_worker(reference.to_dict(), progress=False)
    expected = {
        r["step"]: r["train/loss"] for r in read_metrics(tmp_path / "bare") if "train/loss" in r
    }
    got = {
        r["step"]: r["train/loss"] for r in read_metrics(tmp_path / "ray-run") if "train/loss" in r
    }
    assert sorted(got) == list(range(1, 17))
    for step in range(9, 17):
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step

    # The target tokens it trained on, counted on 2 workers, summed over them and continued
    # across the restart: exactly the 16 global batches once, as the one-process run counts.
    counts, meta = load_counts(tmp_path / "ray-run" / "model" / COUNTS_FILE)
    assert (meta["workers"], meta["steps"], meta["source"]) == (2, 16, "training")
    assert (counts == expected_target_counts(cfg, 16)).all()
    assert (counts == load_counts(tmp_path / "bare" / "model" / COUNTS_FILE)[0]).all()

    # One MLflow run (the restarted workers continued it), with params, step metrics, model.
    client = MlflowClient(mlflow_store)
    experiment = client.get_experiment_by_name("test-ray")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["objective.name"] == "headless"
    assert run.data.tags["objective"] == "headless" and run.data.tags["world_size"] == "2"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted({m.step for m in history}) == list(range(1, 17))
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"model", "config.yaml", "loss_curve.png"} <= artifacts

    model = AutoModelForCausalLM.from_pretrained(summary["model_dir"])
    assert model.config.hlm_objective == "headless"


def test_impossible_requests_fail_before_any_worker_starts(ray_cluster, tmp_path):
    cfg = cfg_for(tmp_path / "x")
    with pytest.raises(HLMError, match="needs 16 CPUs but the cluster has 2"):
        launch(cfg, num_workers=2, cpus_per_worker=8)
    with pytest.raises(HLMError, match="GPU"):
        launch(cfg, num_workers=2, use_gpu=True)
    with pytest.raises(HLMError, match="not writable"):
        launch(cfg, storage_path="/proc/hlm-cannot-write-here")
    with pytest.raises(HLMError, match="not divisible"):
        launch(cfg, num_workers=3)
    assert not (tmp_path / "x").exists()


def test_a_run_that_keeps_failing_reports_the_error_and_keeps_its_checkpoints(
    ray_cluster, mlflow_store, tmp_path
):
    from mlflow import MlflowClient

    cfg = cfg_for(tmp_path / "doomed", **{"run.fail_at_step": 11})
    with pytest.raises(HLMError, match="injected failure at step 11") as err:
        launch(cfg, num_workers=2, max_failures=0, experiment="test-ray-fail")
    assert "last checkpoint" in str(err.value)
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path / "doomed")] == [8]
    client = MlflowClient(mlflow_store)
    experiment = client.get_experiment_by_name("test-ray-fail")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FAILED"


def test_a_diverged_run_fails_at_once_and_is_not_retried(ray_cluster, mlflow_store, tmp_path):
    """A divergence on Ray Train was handled as a lost node: `--max-failures 2` started the run
    three times (173 s, 134 lines, 7 tracebacks before the one-line error) and metrics.jsonl
    held the step-0 row three times. Now both workers stop at the step and the run fails once."""
    from mlflow import MlflowClient

    out = tmp_path / "nan"
    with pytest.raises(HLMError) as err:
        launch(cfg_for(out, **{"optim.lr": 1e30}), num_workers=2, max_failures=2,
               experiment="test-ray-diverged")  # fmt: skip
    message = str(err.value)
    assert type(err.value).__name__ == "TrainingDiverged", message
    assert message.startswith("training diverged: the loss is ") and "\n" not in message
    assert "restart" not in message  # not "training failed after 2 restart(s): ..."
    rows = read_metrics(out)
    assert [r["step"] for r in rows].count(0) == 1
    assert not ckpt.folders(out) and not (out / "summary.json").exists()
    assert not (out / "diverged.json").exists()  # read and removed by the driver
    client = MlflowClient(mlflow_store)
    (run,) = client.search_runs([client.get_experiment_by_name("test-ray-diverged").experiment_id])
    assert run.info.status == "FAILED"


def test_ctrl_c_damaged_checkpoints_and_resume_on_ray(ray_cluster, mlflow_store, tmp_path, capsys):
    """Issue 14's Ray faults in one run: Ctrl-C (KILLED, no traceback), a damaged newest
    checkpoint and a half-copied one (skipped, set aside; Ray's snapshot does not decide), the
    resume adds no duplicate MLflow points, and an explicit older checkpoint is honoured."""
    import os
    import signal
    import threading
    import time

    from mlflow import MlflowClient

    from hlm_ray.config import apply_overrides
    from hlm_ray.train.interrupt import RunInterrupted

    out = tmp_path / "faulty"
    cfg = cfg_for(out, **{"optim.max_steps": 400, "run.log_every": 4, "run.eval_every": 400})

    def ctrl_c_after_two_checkpoints():
        deadline = time.monotonic() + 300
        while len(ckpt.list_checkpoints(out)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c_after_two_checkpoints, daemon=True).start()
    with pytest.raises(RunInterrupted):
        launch(cfg, num_workers=1, experiment="test-ray-faults")
    client = MlflowClient(mlflow_store)
    (run,) = client.search_runs([client.get_experiment_by_name("test-ray-faults").experiment_id])
    assert run.info.status == "KILLED"
    steps = [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(out)]
    assert len(steps) >= 2 and steps[-1] < 400

    # The newest checkpoint's weights are truncated and a copy was cut short after it.
    newest = ckpt.list_checkpoints(out)[-1]
    weights = newest / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    half = out / f"checkpoint_{steps[-1] + 8:08d}"
    half.mkdir()
    (half / "config.yaml").write_text("partial")
    fallback = steps[-2]
    end = steps[-1] + 8
    summary = launch(
        apply_overrides(cfg, {"optim.max_steps": end}),
        num_workers=1,
        experiment="test-ray-faults",
        resume=True,
    )
    err = capsys.readouterr().err
    assert f"set aside damaged checkpoint(s): {newest.name}" in err and half.name in err
    assert summary["steps"] == end
    assert (out / f"damaged-{newest.name}").is_dir() and (out / f"damaged-{half.name}").is_dir()
    assert ckpt.verify(half) is None  # the step was saved again, whole
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(out)][-1] == end
    # The checkpoint it fell back to is pruned with the rest: run.keep_checkpoints, not one more.
    assert len(ckpt.list_checkpoints(out)) == cfg.run.keep_checkpoints
    metric_steps = [r["step"] for r in read_metrics(out) if "train/loss" in r]
    assert metric_steps == list(range(4, end + 1, 4))  # redone steps replaced, not repeated
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(4, end + 1, 4))  # no duplicates
    resumed = client.get_run(run.info.run_id)
    assert resumed.info.status == "FINISHED"
    assert resumed.data.params["optim.max_steps"] == "400"  # what the run started with
    assert resumed.data.tags["param_changed.optim.max_steps"] == str(end)
    assert fallback < steps[-1]

    # An explicit older checkpoint is honoured: later ones go, the run continues from it.
    first = ckpt.list_checkpoints(out)[0]
    launch(
        apply_overrides(cfg, {"optim.max_steps": ckpt.checkpoint_step(first) + 8}),
        num_workers=1,
        experiment="test-ray-faults",
        resume_from=first,
    )
    kept = [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(out)]
    assert kept == [ckpt.checkpoint_step(first), ckpt.checkpoint_step(first) + 8]


def test_workers_the_cluster_cannot_place_wait_a_bounded_time_then_fail_in_one_line(
    ray_cluster, mlflow_store, tmp_path, monkeypatch
):
    """Ray Train retries a worker group it cannot place forever, each try a "Training failed
    due to controller error" while the job stays RUNNING (the cluster box, a node cut off and
    not back). The run waits `placement_timeout_s` in all, then fails with one line that says
    why. Here another job holds the cluster's CPUs; Ray gives each try 2 s."""
    import time

    import ray
    from mlflow import MlflowClient

    @ray.remote(num_cpus=2)
    class Holder:
        def ping(self) -> int:
            return 1

    holder = Holder.remote()
    ray.get(holder.ping.remote())
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "2")
    started = time.monotonic()
    try:
        with pytest.raises(HLMError, match=r"could not place 1 worker\(s\) of 1 CPU in 4 s"):
            launch(cfg_for(tmp_path / "unplaced"), num_workers=1, placement_timeout_s=4,
                   experiment="test-ray-unplaced")  # fmt: skip
    finally:
        ray.kill(holder)
    assert time.monotonic() - started < 90  # two tries of 2 s, and a controller's start
    client = MlflowClient(mlflow_store)
    experiment = client.get_experiment_by_name("test-ray-unplaced")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FAILED"


def test_the_train_console_carries_progress_and_the_summary_not_rays_dumps(ray_cluster, tmp_path):
    """`hlm train` on Ray, as a user runs it: a process of its own on a local cluster of its
    own. Its console has the start line, the worker's progress as whole lines and the summary;
    not Ray Train's INFO lines (a `TrainingReport(...)` dump per checkpoint), Ray's token
    authentication warning, a worker's print twice, carriage returns (a bar refresh drawn over
    the worker's prefix) or a `(RayTrainWorker pid=...)` prefix over an empty line. (In the
    Ray group, for its cluster start: not beside the session cluster's other tests.)"""
    import os
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["RAY_ADDRESS"] = "local"
    argv = ["train", "--preset", "tiny-decoder", "--output", str(tmp_path / "run"),
            "--set", "optim.max_steps=20", "--set", "run.checkpoint_every=10"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "hlm_ray.cli", *argv],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    console = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)  # Ray's colours
    (tmp_path / "console.txt").write_text(console)
    assert done.returncode == 0, console[-3000:]
    assert "training tiny-decoder (gpt_neox, headless) on Ray Train, 1 worker(s)" in console
    assert re.search(r"\(RayTrainWorker pid=\d+\) headless gpt_neox: 100%.*20/20", console)
    assert "| headless | gpt_neox | 20 |" in console  # the summary
    for noise in ("TrainingReport(", "Reporting training result", "Checkpoint successfully",
                  "Requesting resources", "Token authentication", "\r"):  # fmt: skip
        assert noise not in console, (noise, console[-3000:])
    assert not re.search(r"\((RayTrainWorker|TrainController) pid=\d+\)\s*$", console, re.M)
    assert console.count("workers on nodes: rank 0") == 1
    assert re.search(r"\(RayTrainWorker pid=\d+\) checkpoint_00000010 saved", console)
