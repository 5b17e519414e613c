"""The benchmark harness (not its timings): the smoke preset end to end with the files and
columns it promises, the FLOP figures its rows carry against hand counts, the target verdicts,
the CPU peak-memory counter, and the command line."""

import argparse
import csv
import math

import pytest
import torch
import torch.nn.functional as F

from hlm_ray.bench import report
from hlm_ray.bench.cli import add_parser, main
from hlm_ray.bench.common import LiveTensorBytes, peak_bytes, spread
from hlm_ray.bench.loss_head import FUSED, head_flops
from hlm_ray.bench.presets import SMOKE, get_bench_preset
from hlm_ray.bench.report import Target
from hlm_ray.bench.suite import parse_only
from hlm_ray.errors import HLMError
from hlm_ray.fused_ce import unavailable_reason


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One `python -m hlm_ray.bench --preset smoke` run (loss head + training step), logged to
    the test session's MLflow store."""
    out = tmp_path_factory.mktemp("bench")
    headline = out / "figures" / "headline.png"
    args = ["--preset", "smoke", "--only", "loss_head,train_step", "--output", str(out)]
    code = main([*args, "--no-progress", "--mlflow", "--headline", str(headline)])
    assert code == 0
    return out


def test_smoke_run_writes_every_table_and_figure(smoke) -> None:
    for name in ("loss_head.png", "train_step.png", "speedup.png", "headline.png"):
        data = (smoke / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 300_000, name
    assert (smoke / "figures" / "headline.png").read_bytes() == (
        smoke / "headline.png"
    ).read_bytes()
    text = (smoke / "results.md").read_text()
    for heading in ("## Targets", "## Training step", "## Loss head: forward + backward"):
        assert heading in text

    columns, rows = read_csv(smoke / "loss_head.csv")
    assert columns == report.LOSS_COLUMNS
    cells = sum(len(s.values) for s in SMOKE.loss_head.sweeps)
    assert len(rows) == cells * len(SMOKE.loss_head.methods)
    compiled = [r for r in rows if r["method"] in ("ce_compiled", "ce_cce_compile")]
    assert {r["status"] for r in compiled} == {"skipped"} and all(r["note"] for r in compiled)
    # The fused GPU kernels: each its own rows, skipped with the reason where they cannot run.
    fused = [r for r in rows if r["method"] in ("ce_liger", "ce_cce")]
    for r in fused:
        reason = unavailable_reason(FUSED[r["method"]], "cpu")
        assert (r["status"], r["note"]) == ("skipped", reason) and reason
    measured = [r for r in rows if r["status"] == "ok"]
    assert len(measured) == len(rows) - len(compiled) - len(fused)
    for r in measured:
        assert float(r["time_ms_min"]) <= float(r["time_ms"]) <= float(r["time_ms_max"])
        assert float(r["peak_mb"]) > 0

    columns, rows = read_csv(smoke / "train_step.csv")
    assert columns == report.STEP_COLUMNS
    arms = {(r["model"], r["arm"]) for r in rows}
    assert ("neox-smoke", "headless/lazy") in arms and ("bert-smoke", "vanilla/full-seq") in arms
    for model in ("neox-smoke", "bert-smoke"):
        for vocab in ("64", "256"):
            here = [r for r in rows if r["model"] == model and r["V"] == vocab]
            assert sum(r["strongest_vanilla"] == "True" for r in here) == 1
            lazy = next(r for r in here if r["arm"] == "headless/lazy")
            assert lazy["status"] == "ok" and float(lazy["tokens_per_s"]) > 0
            assert float(lazy["peak_mb"]) > 0
            liger = next(r for r in here if r["arm"] == "vanilla/liger")
            assert liger["status"] == "skipped" and "vanilla_impl=liger" in liger["note"]
    assert (
        "vanilla/liger | skipped: HLMError: objective.vanilla_impl=liger"
        in (smoke / "results.md").read_text()
    )
    # The step with no loss head at all, at the preset's no-head vocabulary only, and the
    # headless step against it.
    none = [r for r in rows if r["arm"] == "no-head/lazy"]
    assert {(r["model"], r["V"], r["status"]) for r in none} == {
        ("neox-smoke", "256", "ok"), ("bert-smoke", "256", "ok")
    }  # fmt: skip
    assert all(r["objective"] == "none" and float(r["head_share"]) == 0 for r in none)
    table = text.split("## Headless against no loss head at all")[1]
    for model in ("neox-smoke", "bert-smoke"):
        [row] = [line for line in table.splitlines() if line.startswith(f"| {model} | 256 |")]
        ratio = float(row.split("|")[6])
        assert ratio > 0


def test_smoke_targets_and_mlflow_run(smoke) -> None:
    columns, rows = read_csv(smoke / "targets.csv")
    assert columns == report.TARGET_COLUMNS
    by_target = {}
    for r in rows:
        by_target.setdefault(r["target"], []).append(r)
    assert len(by_target["headless tokens/s flat in V"]) == 2  # one per model
    assert len(by_target["speed-up / FLOP-model speed-up"]) == 4  # every (model, V)
    (mfu,) = by_target["GPU MFU, headless GPT-2-small-size decoder, bf16"]
    assert mfu["verdict"] == "PENDING"
    for r in rows:
        if r["verdict"] != "PENDING":
            assert r["verdict"] in ("PASS", "MISS") and r["margin"].endswith("%")

    mlflow = pytest.importorskip("mlflow")
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name("hlm_bench")
    (run,) = client.search_runs([experiment.experiment_id], "tags.preset = 'smoke'")
    assert run.data.params["env.device"] == "cpu"
    assert any(k.startswith("target/") for k in run.data.metrics)
    history = client.get_metric_history(run.info.run_id, "tokens_per_s/neox-smoke/B2/headless/lazy")
    assert sorted(m.step for m in history) == [64, 256]  # plotted against V
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"train_step.csv", "loss_head.csv", "results.md", "headline.png"} <= artifacts


# ---- the FLOP figures in the rows, by hand ---------------------------------------------------


def test_train_step_rows_carry_hand_counted_flops(smoke) -> None:
    """neox-smoke: GPT-NeoX, 1 layer, D=16, MLP 4D=64, B=2 sequences of L=16 tokens."""
    D, I, L, B = 16, 64, 16, 2  # noqa: E741
    tokens, K = B * L, B * (L - 1)  # 32 tokens, 30 next-token rows
    # Forward matmul FLOPs per token (2 per multiply-add); the embedding look-up is a gather.
    embedding = 0
    attention_proj = 2 * D * 3 * D + 2 * D * D  # QKV and output projections: 2048
    attention_scores = 2 * L * D + 2 * L * D  # q·Kᵀ and A·V over the full 16×16 square: 1024
    mlp = 2 * D * I + 2 * I * D  # 4096
    body = 3 * tokens * (embedding + attention_proj + attention_scores + mlp)  # fwd + 2× bwd
    assert body == 688_128
    _, rows = read_csv(smoke / "train_step.csv")
    for r in (r for r in rows if r["model"] == "neox-smoke"):
        V = int(r["V"])
        if r["objective"] == "vanilla":
            head = 3 * K * 2 * D * V  # logits h·Wᵀ at every target row
        elif r["objective"] == "none":  # the no-head arm: the body alone
            head = 0
        else:
            U = int(r["U"])  # distinct target ids: the dedup CWT's columns
            assert 0 < U <= min(K, V)
            head = 3 * 2 * K * U * D  # O (K×D) · Eᵀ (D×U)
        assert int(r["K"]) == K
        assert float(r["gflop_per_step"]) * 1e9 == pytest.approx(body + head, rel=1e-5)
        assert float(r["head_share"]) == pytest.approx(head / (body + head), rel=1e-4)


def test_loss_head_flops_by_hand() -> None:
    K, V, U, D = 6, 50, 4, 8
    assert head_flops("ce_full", K, V, U, D) == 3 * 2 * K * V * D == 14_400
    assert head_flops("ce_linear", K, V, U, D) == 14_400  # same model FLOPs, another kernel
    assert head_flops("cwt_plain", K, V, U, D) == 3 * 2 * K * K * D == 1_728
    assert head_flops("cwt_dedup", K, V, U, D) == 3 * 2 * K * U * D == 1_152
    assert head_flops("cwt_chunked", K, V, U, D) == 1_152  # recomputation is not counted


# ---- targets ---------------------------------------------------------------------------------


def test_target_verdicts_and_margins() -> None:
    assert Target("t", "s", 0.97, 0.95, True).verdict == "PASS"
    short = Target("t", "s", 0.9025, 0.95, True)
    assert (short.verdict, short.margin) == ("MISS", "-5.0%")
    over = Target("ray", "s", 1.1025, 1.05, False)
    assert (over.verdict, over.margin) == ("MISS", "-5.0%")
    assert Target("ray", "s", 1.0, 1.05, False).margin == "+4.8%"
    assert Target("mfu", "s", None, 0.4, True).verdict == "PENDING"
    assert Target("mfu", "s", math.nan, 0.4, True).row()["margin"] == ""


def _step(model, vocab, arm, ms, flops_ratio=1.0, strongest=False, peak_mb=None):
    return {
        "model": model, "V": vocab, "micro_batch": 8, "arm": arm, "status": "ok",
        "objective": arm.split("/")[0], "step_ms": ms, "tokens_per_s": 1000 / ms,
        "flops_vs_headless": flops_ratio, "strongest_vanilla": strongest, "peak_mb": peak_mb,
    }  # fmt: skip


def test_evaluate_targets_on_synthetic_rows() -> None:
    preset = get_bench_preset("cpu")
    model = preset.train_step.models[0]
    name, batch = model.name, model.points[0][1]
    rows = [
        _step(name, 8192, "headless/dense", 110),
        _step(name, 8192, "headless/lazy", 100),
        _step(name, 8192, "vanilla/full", 200, 2.5, True),  # 2.0× measured vs 2.5× predicted
        _step(name, 131072, "headless/lazy", 104, peak_mb=300.0),
        _step(name, 131072, "headless/dense", 120, peak_mb=500.0),
        _step(name, 131072, "vanilla/full", 1000, 9.0, True, peak_mb=2000.0),  # 9.6× vs 9.0×
        _step(name, 131072, "vanilla/cce", 1100, 9.0, peak_mb=400.0),  # the lowest vanilla
        _step(name, 131072, "vanilla/liger", 1200, 9.0),  # no peak measured
    ]
    for r in rows:
        r["micro_batch"] = batch
    ray = [
        {"arm": "bare", "step_ms": 10.0, "preset": "tiny-decoder"},
        {"arm": "ray", "step_ms": 10.4, "preset": "tiny-decoder"},
        {"arm": "bare", "step_ms": 10.0, "preset": "tiny-decoder"},
    ]
    targets = {(t.target, t.scope): t for t in report.evaluate_targets(preset, [], rows, ray)}
    flat = targets[("headless tokens/s flat in V", f"{name} B={batch}: V=131072 / V=8192")]
    assert flat.measured == pytest.approx(100 / 104) and flat.verdict == "PASS"
    small = targets[("speed-up / FLOP-model speed-up", f"{name} V=8192 B={batch}")]
    assert small.measured == pytest.approx(2.0 / 2.5) and small.verdict == "MISS"
    large = targets[("speed-up / FLOP-model speed-up", f"{name} V=131072 B={batch}")]
    assert large.measured == pytest.approx(9.615 / 9.0, rel=1e-3) and large.verdict == "PASS"
    (ray_target,) = [t for t in targets.values() if t.target.startswith("Ray")]
    assert ray_target.measured == pytest.approx(1.04) and ray_target.verdict == "PASS"
    (mfu,) = [t for t in targets.values() if t.target.startswith("GPU MFU")]
    assert mfu.verdict == "PENDING"
    # Peak memory at V = 131k: the lower headless arm against the lowest vanilla arm.
    memory = targets[("headless peak memory / lowest vanilla", f"{name} V=131072 B={batch}")]
    assert memory.measured == pytest.approx(300 / 400) and memory.verdict == "PASS"
    assert "vanilla/cce 400 MB" in memory.detail and "not measured: vanilla/liger" in memory.detail
    rows[-2]["peak_mb"] = 250.0  # a fused kernel below headless: a miss
    targets = report.evaluate_targets(preset, [], rows, ray)
    (memory,) = [t for t in targets if t.target.startswith("headless peak memory")]
    assert memory.verdict == "MISS"


# ---- measurement helpers ---------------------------------------------------------------------


def test_live_tensor_bytes_counts_logits_and_frees() -> None:
    K, V, D = 64, 1000, 16
    h = torch.randn(K, D, requires_grad=True)
    w = torch.randn(V, D, requires_grad=True)
    y = torch.randint(0, V, (K,))

    def ce():
        return torch.autograd.grad(F.cross_entropy(h @ w.T, y), [h, w])

    logits = K * V * 4
    peak = peak_bytes(ce, torch.device("cpu"))
    # The K×V logits, their log-softmax and its gradient at least; the V×D weight gradient too.
    assert 3 * logits <= peak <= 3 * logits + V * D * 4 + 64 * 1024
    table = torch.randn(V, D, requires_grad=True)
    with LiveTensorBytes() as counter:
        rows = F.embedding(y, table, sparse=True)
        (grad,) = torch.autograd.grad(rows.sum(), [table])
        assert grad.is_sparse
    assert counter.peak < logits  # a sparse gradient of K rows, never V×D
    del rows, grad
    assert counter.live == 0  # everything it counted was freed


def test_spread() -> None:
    s = spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median"], s["min"], s["max"], s["p25"], s["p75"]) == (3.0, 1.0, 5.0, 2.0, 4.0)
    assert spread([2.0])["p75"] == 2.0


# ---- command line ----------------------------------------------------------------------------


def test_command_line_wiring_and_errors(capsys) -> None:
    parser = argparse.ArgumentParser(prog="hlm")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--preset", "smoke", "--only", "train_step"])
    assert (args.command, args.preset, args.only, args.mlflow) == (
        "bench",
        "smoke",
        "train_step",
        False,
    )
    assert parse_only("train_step, loss_head") == ("train_step", "loss_head")
    with pytest.raises(HLMError, match="unknown benchmark"):
        parse_only("loss_head,speed")
    with pytest.raises(HLMError, match="repeats"):
        get_bench_preset("cpu", repeats=0)
    assert main(["--preset", "smoke", "--only", "nothing"]) == 2
    assert "error: --only" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["--preset", "gpu", "--only", "loss_head"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.ray
@pytest.mark.slow
def test_ray_overhead_rows(ray_cluster) -> None:
    from hlm_ray.bench.ray_overhead import overhead_ratio, run_ray_overhead

    rows = run_ray_overhead(SMOKE.ray_overhead, log=lambda _: None)
    assert [r["arm"] for r in rows] == ["bare", "ray", "bare"]
    assert all(r["windows"] >= 1 and r["step_ms"] > 0 for r in rows)
    assert overhead_ratio(rows) > 0


def test_the_threads_benchmark_times_each_arm_in_a_process_of_its_own(monkeypatch) -> None:
    """`python -m hlm_ray.bench.threads` (its harness, not its timings): an arm is a process with
    its OpenMP settings (one real one here, the passive arm); the rounds alternate the arms
    beside the busy loops asked for, which are stopped after, and each arm's figure is its
    median (the other arms' processes replaced by fixed times, for speed)."""
    import psutil

    from hlm_ray.bench import threads

    assert threads.time_arm("passive", "tiny-decoder", 0.05) > 0
    assert threads.ARMS["passive"] == {"OMP_WAIT_POLICY": "PASSIVE"}
    made = {"spin": iter([30.0, 10.0, 20.0]), "passive": iter([2.0, 3.0, 1.0]),
            "1 thread": iter([4.0, 4.0, 5.0])}  # fmt: skip
    monkeypatch.setattr(threads, "time_arm", lambda arm, preset, seconds: next(made[arm]))
    lines = []
    before = {p.pid for p in psutil.Process().children()}
    [row] = threads.run("tiny-decoder", [1], rounds=3, seconds=0.1, log=lines.append)
    assert (row["busy"], row["spin"], row["passive"], row["1 thread"]) == (1, 20.0, 2.0, 4.0)
    assert (
        lines[0].startswith("1 busy loop(s): spin 20.0 ms") and "spin ÷ passive 10.00" in lines[0]
    )
    assert {p.pid for p in psutil.Process().children()} <= before  # the busy loop is gone
