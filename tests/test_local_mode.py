"""Ray Train's local mode for one-worker sweep trials (`hlm_ray.train.local_mode`): the training
function a retried trial runs again, and what `launch(local=True)` refuses, as plain functions
(no Ray). Where trials choose it: test_sweeps; a sweep trained this way: test_scaling."""

import pytest
from tiny_runs import expected_target_counts, tiny_run_cfg

import hlm_ray.train.launch as launch_mod
import hlm_ray.train.setup as setup_mod
from hlm_ray.errors import HLMError
from hlm_ray.tracking import read_metrics
from hlm_ray.train import checkpoint as ckpt
from hlm_ray.train.local_mode import local_mode, local_worker
from hlm_ray.unigram import COUNTS_FILE, load_counts


def test_only_one_cpu_worker_on_one_node_trains_in_the_trials_process():
    one = [{"CPU": 2.0}]
    assert local_mode(1, False, one)
    assert not local_mode(2, False, one)  # a worker group: DDP
    assert not local_mode(1, True, one)  # a GPU worker goes where Ray places it
    assert not local_mode(1, False, one * 2)  # several nodes: not where Train would place it


def test_a_failed_local_trial_run_again_continues_from_its_newest_checkpoint(tmp_path, monkeypatch):
    """Local mode has no worker-group restarts: Tune runs the trial again, and the training
    function continues from the run folder's newest valid checkpoint (step 10, the failure at
    13), so steps 11-13 are redone once and nothing before them twice."""
    cfg = tiny_run_cfg(tmp_path / "run", steps=16, every=(1, 16, 10), **{"run.fail_at_step": 13})
    loop_config = {"config": cfg.to_dict(), "tracking": None, "env": {}}
    with pytest.raises(RuntimeError, match="injected failure at step 13"):
        local_worker(loop_config)
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path / "run")] == [10]
    restored = []

    def restore(folder, *args):
        restored.append(ckpt.checkpoint_step(folder))
        return real_restore(folder, *args)

    real_restore = setup_mod.restore
    monkeypatch.setattr(setup_mod, "restore", restore)
    local_worker(loop_config)  # Tune's retry: the same function, the same config
    assert restored == [10]
    steps = [r["step"] for r in read_metrics(tmp_path / "run") if "train/loss" in r]
    assert steps == list(range(1, 17))  # 11-13 redone once, nothing duplicated
    assert (tmp_path / "run" / "summary.json").is_file()
    # The tokens it trained on, counted exactly: 11-13 once, what came before the resume too.
    counts, meta = load_counts(tmp_path / "run" / "model" / COUNTS_FILE)
    assert (counts == expected_target_counts(cfg, 16)).all() and meta["steps"] == 16


def test_local_mode_with_a_storage_path_elsewhere_is_refused_before_anything_starts(
    tmp_path, monkeypatch
):
    """Local mode hands Ray no checkpoint, so a run mirrored to another storage would keep none
    there: refused before the corpus, Ray or an MLflow run."""

    def started(*args, **kwargs):
        raise AssertionError("launch went past its checks")

    monkeypatch.setattr(launch_mod, "build_tokenizer", started)
    cfg = tiny_run_cfg(tmp_path / "runs" / "r", steps=2, every=(1, 2, 2))
    with pytest.raises(HLMError, match="local mode trains with the run folder as its storage"):
        launch_mod.launch(cfg, local=True, storage_path=str(tmp_path / "elsewhere"))
    with pytest.raises(AssertionError, match="past its checks"):  # its own folder's parent: fine
        launch_mod.launch(cfg, local=True, storage_path=str(tmp_path / "runs"))
