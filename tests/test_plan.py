"""The cost plan: --dry-run prints trials, tokens, FLOPs, GPU-hours and wall time, starting
nothing (no Ray, no data, no MLflow)."""

import importlib.util
from pathlib import Path

import pytest

from hlm_ray.errors import HLMError
from hlm_ray.flops import PEAK_FLOPS, config_step_flops
from hlm_ray.plan import Assumptions, format_plan, plan_metrics, sweep_plan, train_plan
from hlm_ray.presets import get_preset
from hlm_ray.tune.placement import plan_concurrency
from hlm_ray.tune.spec import get_sweep

ROOT = Path(__file__).resolve().parents[1]


def _script(kind: str):
    spec = importlib.util.spec_from_file_location(f"plan_{kind}", ROOT / "sweeps" / f"{kind}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _main(kind: str):
    return _script(kind).main


def test_paper_vocab_dry_run_prints_the_plan_and_starts_nothing(tmp_path, monkeypatch, capsys):
    import ray

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    started = []  # (the session's shared cluster may be up already: watch ray.init instead)
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append((a, k)))
    assert _main("vocab")(["--preset", "paper", "--dry-run", "--cluster-gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "12 trial(s), nothing started" in out
    assert "H100 bf16, peak 989 TFLOP/s, at 40% MFU" in out
    assert "8 trial(s) at a time" in out
    assert not started
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


def test_plan_figures_come_from_the_flop_model():
    spec = get_sweep(_script("vocab").PRESETS, "paper", [])
    a = Assumptions(gpu="A100", mfu=0.5, cluster_gpus=2, cluster_cpus=64, overhead_s=0)
    plan = sweep_plan(spec, a, fit=lambda nodes: plan_concurrency(spec, 12, nodes))
    assert len(plan.trials) == len(spec.cells()) and plan.concurrency == 2
    cell = spec.cells()[0]
    cfg = spec.cell_config(cell["value"], cell["objective"], cell["seed"])
    step = config_step_flops(cfg, cfg.tokenizer.vocab_size)
    micro = cfg.optim.global_batch_size // cfg.optim.micro_batch_size
    assert plan.trials[0].flops == pytest.approx(step.total * micro * cfg.optim.max_steps)
    assert plan.trials[0].tokens == cfg.optim.max_steps * cfg.optim.global_batch_size * 128
    assert plan.gpu_hours == pytest.approx(plan.total_flops / (0.5 * PEAK_FLOPS["A100"]) / 3600)
    # Two GPUs, one per trial: the wall time is at least half the GPU time, at most all of it.
    assert plan.gpu_hours * 3600 / 2 <= plan.wall_seconds <= plan.gpu_hours * 3600
    metrics = plan_metrics(plan)
    assert metrics["plan/gpu_hours"] == pytest.approx(plan.gpu_hours)
    assert metrics["plan/concurrency"] == 2
    # Vanilla costs more than headless at every vocabulary (the head), both grow with V.
    by = {(t.label.split()[0], t.vocab_size): t.flops for t in plan.trials}
    assert all(by[("vanilla", v)] > by[("headless", v)] for v in spec.values)


def test_train_plan_and_bad_assumptions():
    cfg = get_preset("pythia-70m")
    plan = train_plan(
        cfg,
        Assumptions(cluster_gpus=8, overhead_s=0),
        workers=8,
        gpus_per_worker=1,
        cpus_per_worker=1,
    )
    text = format_plan(plan)
    assert "1 trial(s)" in text and "8 GPU(s)" in text
    assert plan.wall_seconds == pytest.approx(plan.gpu_hours * 3600 / 8)
    with pytest.raises(HLMError, match="gpu-type"):
        Assumptions(gpu="TPUv9")
    with pytest.raises(HLMError, match="mfu"):
        Assumptions(mfu=1.5)


def test_hlm_train_dry_run(tmp_path, monkeypatch, capsys):
    from hlm_ray.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["train", "--preset", "tiny-decoder", "--dry-run", "--gpu-type", "A100", "--mfu", "0.3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "A100 bf16" in out and "30% MFU" in out and "nothing started" in out
    assert not (tmp_path / "runs").exists()


def test_a_plan_reads_a_hub_tokenizer_from_the_local_cache_only(monkeypatch):
    """`--dry-run` offline: a tokenizer named by the hub (the paper preset's multilingual one)
    is looked up in Hugging Face's cache only, never requested (5 retries each, minutes), and
    the config's vocabulary size stands in when it is not there."""
    import transformers

    from hlm_ray import plan

    asked = []

    def from_pretrained(name, **kwargs):
        asked.append(kwargs.get("local_files_only"))
        raise OSError(f"{name} is not in the cache")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    plan._file_vocab_size.cache_clear()
    assert plan._file_vocab_size("someone/not-cached-model", 119_547) == 119_547
    assert asked == [True]
