"""What MLflow's browser shows: experiments marked as model training, a sweep's results as
charts and a description on its parent run, links that still answer after the sweep, and K
tags that agree with the `train/K` metric. Against the session's real sqlite store."""

import importlib.util
import json
from pathlib import Path

import pytest

from hlm_ray.paths import PROJECT_ROOT
from hlm_ray.tracking import MlflowTracker, browse_hint
from hlm_ray.tracking.mlflow_tracker import EXPERIMENT_KIND_TAG, NOTE_TAG
from hlm_ray.tune import summary
from hlm_ray.tune.parent_run import log_results
from hlm_ray.tune.sweep import STATE_FILE, _trial_env

mlflow = pytest.importorskip("mlflow")


def _axis(script: str):
    spec = importlib.util.spec_from_file_location(script, PROJECT_ROOT / "sweeps" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.AXIS, module.PRESETS


def _row(objective, value, seed=0, status="FINISHED", **metrics):
    return summary.trial_row(
        trial_id=f"{objective}-{value}-{seed}",
        run=f"{objective}-x{value}-s{seed}",
        status=status,
        value=value,
        objective=objective,
        seed=seed,
        metrics=metrics,
        error="worker died" if status == "FAILED" else "",
    )


@pytest.fixture
def client(mlflow_store):
    return mlflow.MlflowClient(mlflow_store)


def test_experiments_say_they_are_model_training(client, request):
    name = f"kind-{request.node.name}"
    run = MlflowTracker(name, "a")
    assert run.active and run.experiment_id is not None
    assert client.get_experiment(run.experiment_id).tags[EXPERIMENT_KIND_TAG] == (
        "custom_model_development"
    )
    # An experiment made without the tag (by hand, or by an older hlm) gets it on its next run.
    bare = client.create_experiment(f"{name}-bare")
    MlflowTracker(f"{name}-bare", "b")
    assert client.get_experiment(bare).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"


def test_browse_hints_point_at_what_still_answers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hint = browse_hint("sqlite:///sub/mlflow.db", "3", "abc")
    assert hint == (
        f"MLflow: mlflow ui --backend-store-uri sqlite:///{tmp_path.resolve()}/sub/mlflow.db\n"
        "  then open http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    )
    assert browse_hint("https://u:pw@mlflow.example:8443/", "3", "abc") == (
        "MLflow: https://mlflow.example:8443/#/experiments/3/runs/abc?workflowType=machine_learning"
    )
    assert browse_hint("postgresql://u:pw@db/mlflow") == (
        "MLflow: mlflow ui --backend-store-uri postgresql://db/mlflow\n"
        "  then open http://127.0.0.1:5000"
    )


def test_trials_inherit_the_quiet_links_of_a_temporary_server(monkeypatch):
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    assert "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT" not in _trial_env("http://127.0.0.1:1")
    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    assert _trial_env("http://127.0.0.1:1")["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"


def test_results_are_one_metric_per_score_and_arm_over_the_values():
    axis, _ = _axis("vocab")
    rows = [
        _row("headless", 512, 0, **{"downstream/score": 0.6, "tokens_per_s": 100.0}),
        _row("headless", 512, 1, **{"downstream/score": 0.8, "tokens_per_s": 300.0}),
        _row("vanilla", 512, **{"downstream/score": 0.5, "tokens_per_s": 50.0}),
        _row("headless", 1024, **{"downstream/score": 0.7, "tokens_per_s": 90.0}),
        _row("vanilla", 1024, status="FAILED", **{"downstream/score": 0.9}),
    ]
    # Steps are the vocabulary sizes; the mean over seeds; failed trials count for nothing.
    assert summary.result_metrics(rows, axis) == {
        512: {
            "ablation/downstream_score/headless": pytest.approx(0.7),
            "ablation/downstream_score/vanilla": 0.5,
            "ablation/tokens_per_s/headless": 200.0,
            "ablation/tokens_per_s/vanilla": 50.0,
            # One chart that compares the arms (MLflow scales each chart alone).
            "ablation/downstream_score/headless_minus_vanilla": pytest.approx(0.2),
            "ablation/tokens_per_s/headless_minus_vanilla": 150.0,
        },
        1024: {"ablation/downstream_score/headless": 0.7, "ablation/tokens_per_s/headless": 90.0},
    }
    note = summary.results_note(rows, axis, "vocab-tiny")
    assert "4 finished, 1 failed of 5 trials" in note and "× 2 seeds" in note
    assert "step = vocabulary size" in note
    assert "| vocab (asked) | downstream score, headless | downstream score, vanilla |" in note
    assert "| 512 | 0.7000 | 0.5000 | 200 | 50 |" in note
    assert "| 1024 | 0.7000 | - | 90 | - |" in note
    assert "`vanilla-x1024-s0`: worker died" in note


def test_category_and_fraction_axes_step_by_position():
    assert summary.result_steps(["own", "all_workers", 64]) == {"own": 0, "all_workers": 1, 64: 2}
    assert summary.result_steps([0.1, 1.0]) == {0.1: 0, 1.0: 1}
    assert summary.result_steps([8, 16]) == {8: 8, 16: 16}
    axis, _ = _axis("negatives")
    rows = [_row("headless", v, **{"lambada/accuracy": 0.1 * i}) for i, v in enumerate(["own", 64])]
    assert "step = position: 0 = own, 1 = 64" in summary.results_note(rows, axis, "n")
    assert summary.result_metrics(rows, axis)[1] == {"ablation/lambada_accuracy/headless": 0.1}


def test_the_parent_run_gets_charts_and_a_description_once(client, tmp_path, request):
    axis, presets = _axis("vocab")
    parent = MlflowTracker(f"parent-{request.node.name}", "vocab-t")
    (tmp_path / STATE_FILE).write_text(json.dumps({"parent_run_id": parent.run_id}))
    rows = [
        _row(o, v, **{"downstream/score": s, "tokens_per_s": 10.0})
        for o, v, s in [("headless", 512, 0.6), ("vanilla", 512, 0.5), ("headless", 1024, 0.7)]
    ]

    def history(key):
        return [(m.step, m.value) for m in client.get_metric_history(parent.run_id, key)]

    files = [tmp_path / "summary.md", tmp_path / "fig7a_score_vs_vocab.png"]  # as logged
    log_results(parent, rows, presets["tiny"], "vocab-t", tmp_path, files)
    assert history("ablation/downstream_score/headless") == [(512, 0.6), (1024, 0.7)]
    assert history("ablation/downstream_score/vanilla") == [(512, 0.5)]
    note = client.get_run(parent.run_id).data.tags[NOTE_TAG]
    # The table first (MLflow shows a description's first lines), then the logged figure.
    assert note.splitlines()[2].startswith("| vocab (asked) | downstream score, headless |")
    figure = f"get-artifact?path=fig7a_score_vs_vocab.png&run_uuid={parent.run_id}"
    assert f"![downstream score]({figure})" in note.splitlines()
    assert "fig7b" not in note  # not logged, not shown
    # Resumed with one more finished trial: only the new point is sent (no doubled steps).
    rows.append(_row("vanilla", 1024, **{"downstream/score": 0.4, "tokens_per_s": 10.0}))
    log_results(parent, rows, presets["tiny"], "vocab-t", tmp_path)
    assert history("ablation/downstream_score/headless") == [(512, 0.6), (1024, 0.7)]
    assert history("ablation/downstream_score/vanilla") == [(512, 0.5), (1024, 0.4)]
    assert "| 1024 | 0.7000 | 0.4000 |" in client.get_run(parent.run_id).data.tags[NOTE_TAG]


def test_the_k_tag_is_the_mean_k_the_metric_logs(client, tmp_path, monkeypatch, request):
    """A masked LM's K (masked positions) differs from micro-batch to micro-batch: `train/K`
    is their mean over the log window, and the `K` tag says the same (it said the FLOP model's
    expected K, and `train/K` was the last micro-batch's count)."""
    from tiny_runs import tiny_run_cfg

    from hlm_ray.train import loop
    from hlm_ray.train import step as step_module  # where the step looks load_batch up
    from hlm_ray.train.launch import open_mlflow_run

    counts = []  # (step, masked positions) of every training micro-batch, as the loss sees them
    real_batch = step_module.load_batch  # training's batches (validation has its own binding)

    def counting(blocks, idx, env, masking, seed, step, micro):
        input_ids, labels = real_batch(blocks, idx, env, masking, seed, step, micro)
        counts.append((step, int((labels != -100).sum())))
        return input_ids, labels

    monkeypatch.setattr(step_module, "load_batch", counting)
    cfg = tiny_run_cfg(tmp_path / "run", "tiny-encoder", steps=6, every=(3, 6, 6))
    tracker, tracking = open_mlflow_run(
        cfg, Path(cfg.run.output_dir), experiment=f"k-{request.node.name}", resume=False
    )
    loop.train_worker(cfg.to_dict(), tracking=tracking, progress=False)
    tracker.finish()
    history = client.get_metric_history(tracker.run_id, "train/K")
    last_window = [n for step, n in counts if step >= 3]
    assert len(last_window) == 3 * 2  # 3 steps × 2 accumulated micro-batches
    assert len(set(last_window)) > 1  # the case that matters: K varies by micro-batch
    assert [m.step for m in history] == [3, 6]
    assert history[-1].value == pytest.approx(sum(last_window) / len(last_window))
    tags = client.get_run(tracker.run_id).data.tags
    assert float(tags["K"]) == pytest.approx(history[-1].value, abs=0.005)
    assert float(tags["K_over_V"]) == pytest.approx(history[-1].value / 512, abs=1e-4)
