"""The cost plan: --dry-run prints trials, tokens, FLOPs, GPU-hours and wall time, starting
nothing (no Ray, no data, no MLflow)."""

import importlib.util
import json
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


# ------------------------------------------------------------------- plans on this machine's CPUs


def test_a_plan_without_a_gpu_is_priced_on_this_machines_cpus(tmp_path, monkeypatch, capsys):
    """`hlm train --dry-run` without --gpu on a machine without one: not an assumed 8-GPU node
    and 0 s, but the run's own step timed here (once: kept per machine and shape) times its
    steps, with validation; the plan says where its times come from."""
    from hlm_ray.cli import main
    from hlm_ray.cpu_plan import machine

    rates = tmp_path / "rates.json"
    monkeypatch.setenv("HLM_PLAN_RATES", str(rates))
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--preset", "tiny-decoder", "--dry-run", "--set", "optim.max_steps=300"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert first.err.count("plan: timing a step of tiny-decoder headless") == 1
    assert "GPU(s), 64" not in first.out and "H100" not in first.out and "assumed" not in first.out
    assert "each trial's step timed here on its own model, 1 thread(s) per worker" in first.out
    [kept] = json.loads(rates.read_text())["rates"][machine()].values()
    assert kept["step_s"] > 0 and kept["eval_batch_s"] > 0 and kept["threads"] == 1
    assert main(argv) == 0  # the second plan reads the kept rate
    second = capsys.readouterr()
    assert second.err == "" and second.out == first.out
    cfg = get_preset("tiny-decoder")
    evals = 300 // cfg.run.eval_every  # and at the end: 300 is a multiple of eval_every
    seconds = 300 * kept["step_s"] + evals * cfg.run.eval_batches * kept["eval_batch_s"]
    [row] = [line for line in first.out.splitlines() if "headless tiny-decoder" in line]
    assert row.split()[-1] == f"{seconds:,.0f}"
    assert not (tmp_path / "runs").exists()


def test_a_seconds_budget_is_priced_at_its_deadline():
    from hlm_ray.config import apply_overrides
    from hlm_ray.cpu_plan import StepRate, trial_train_seconds

    rate = StepRate(step_s=0.5, eval_batch_s=0.1, threads=1, load=0.0, measured_at="now")
    cfg = apply_overrides(get_preset("tiny-decoder"), {"run.eval_every": 50})
    assert trial_train_seconds(cfg, 120, rate) == (pytest.approx(60 + 3 * 4 * 0.1), 120)
    timed = apply_overrides(cfg, {"budget.seconds": 20.0})
    # The run stops at the first step that ends past its deadline: 41 steps of 0.5 s.
    assert trial_train_seconds(timed, 120, rate) == (pytest.approx(20.5 + 1 * 4 * 0.1), 41)
    assert trial_train_seconds(timed, 30, rate)[1] == 30  # the step cap comes first


def test_a_sweeps_fixed_costs_are_measured_here_and_priced_into_later_plans(
    tmp_path, monkeypatch, capsys
):
    """A finished CPU sweep keeps its trials' mean start-up and, per model family, downstream
    seconds; a later plan on this machine includes them (said "measured"), where it assumed
    before (said "assumed"). Inside a sweep a plan times nothing: a shape without a kept rate
    is said not priced."""
    from dataclasses import replace

    from hlm_ray.cpu_plan import fixed_costs, record_fixed_costs

    monkeypatch.setenv("HLM_PLAN_RATES", str(tmp_path / "rates.json"))
    spec = get_sweep(_script("vocab").PRESETS, "tiny", ["sweep.values=[512]", "sweep.num_seeds=1"])
    fit = lambda nodes: 1  # noqa: E731
    unpriced = sweep_plan(spec, replace(Assumptions(), measure=False), fit=fit)
    assert "not priced           2 trial(s) without a step time" in format_plan(unpriced)
    before = sweep_plan(spec, Assumptions(), fit=fit)
    start, downstream = fixed_costs(spec.recipe, "encoder")
    assert not start.measured and "assumed" in format_plan(before)
    rows = [
        {"status": "FINISHED", "trial/pretrain_overhead_s": s, "trial/train_s": 9.0,
         "trial/downstream_s": d, "value": 512, "objective": "headless", "seed": 0}
        for s, d in ((20.0, 40.0), (30.0, 50.0))
    ] + [{"status": "FAILED", "trial/pretrain_overhead_s": 500.0, "value": 512}]  # fmt: skip
    assert "the sweep's own      45 s" in format_plan(before)  # assumed: no sweep yet
    kept = record_fixed_costs(rows, spec.recipe, "vocab-here", lambda r: "encoder", sweep_s=12.0)
    assert kept["start"]["s"] == 25.0 and kept["downstream"]["tiny encoder"]["s"] == 45.0
    after = sweep_plan(spec, Assumptions(), fit=fit)
    text = format_plan(after)
    assert "start-up, validation, checkpoints 25 s (measured: mean of 2 trial(s) of sweep " in text
    assert "downstream 45 s (measured: mean of 2 trial(s) of sweep vocab-here" in text
    assert "the sweep's own      12 s: Ray's start, the inputs, the MLflow server, the " in text
    training = sum(after.trial_seconds(t) for t in after.trials)
    assert after.wall_seconds == pytest.approx(training + 2 * 70.0 + 12.0)  # one at a time
    assert "including the fixed costs above" in text
    given = sweep_plan(spec, Assumptions(overhead_s=5.0), fit=fit)
    assert given.wall_seconds == pytest.approx(training + 2 * 5.0 + 12.0)
