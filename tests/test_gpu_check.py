"""The gpu-check's tier, table and JSON logic as plain functions on the CPU (fake checks)."""

import json

import pytest
import torch

from hlm_ray import gpu_check
from hlm_ray.gpu_check.table import Row, exit_status, format_table, write_results


def _fake(verdict: str, figures: str):
    def check(out):
        return Row("ignored", verdict, figures)

    return check


def _boom(out):
    raise ValueError("the GPU caught fire\nsecond line")


def test_a_raising_check_is_a_miss_and_the_others_still_run(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.TIERS, "first", ("bare", ()))
    monkeypatch.setitem(gpu_check.TIERS, "broken", ("bare", ()))
    monkeypatch.setitem(gpu_check.TIERS, "last", ("bare", ()))
    runners = {"first": _fake("PASS", "1 s"), "broken": _boom, "last": _fake("PASS", "2 s")}
    rows = gpu_check.run_checks(["first", "broken", "last"], tmp_path, runners)
    assert [(r.check, r.verdict) for r in rows] == [
        ("first", "PASS"),
        ("broken", "MISS"),
        ("last", "PASS"),
    ]
    assert rows[1].figures == "ValueError: the GPU caught fire"
    assert exit_status(rows) == 1 and exit_status([rows[0], rows[2]]) == 0


def test_a_missing_module_gives_skip_rows_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.TIERS, "needs_ray", ("full", ("no_such_module_xyz", "json")))
    ran = []
    rows = gpu_check.run_checks(["needs_ray"], tmp_path, {"needs_ray": ran.append})
    assert ran == []
    (row,) = rows
    assert (row.verdict, row.tier) == ("SKIP", "full")
    assert row.figures == "no_such_module_xyz not installed (full tier)"
    assert exit_status(rows) == 0  # a SKIP is reported, not failed


def test_every_check_has_a_tier_and_a_runner():
    assert set(gpu_check.TIERS) == set(gpu_check.RUNNERS) == set(gpu_check.CHECKS)
    full = [c for c, (tier, _) in gpu_check.TIERS.items() if tier == "full"]
    assert full and all({"ray", "mlflow"} <= set(gpu_check.TIERS[c][1]) for c in full)
    bare = [c for c, (tier, needs) in gpu_check.TIERS.items() if tier == "bare"]
    assert {"losses", "train", "attention", "bench", "generate", "classify"} <= set(bare)


def test_table_has_a_section_per_tier_and_the_json_holds_every_row(tmp_path):
    rows = [
        Row("losses", "PASS", "worst 1e-05", 1.4, "bare"),
        Row("sweep", "SKIP", "ray, mlflow not installed (full tier)", 0.0, "full"),
        Row("generate", "MISS", "2/4 | equal", 3.0, "bare"),
    ]
    info = {"python": "3.12.1", "torch": "2.11.0", "gpu": "NVIDIA H100"}
    table = write_results(rows, "cuda:0 (NVIDIA H100)", info, tmp_path)
    assert (tmp_path / "gpu_check.md").read_text() == table + "\n"
    bare_at, full_at = table.index("bare tier:"), table.index("full tier:")
    assert bare_at < table.index("| losses | PASS |") < table.index("| generate | MISS |") < full_at
    assert "| generate | MISS | 2/4 / equal | 3 |" in table  # a | in figures would split the cell
    assert "torch 2.11.0" in table and "gpu NVIDIA H100" in table
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["versions"] == info and [r["check"] for r in record["rows"]] == [
        "losses",
        "sweep",
        "generate",
    ]
    assert record["rows"][1] == {
        "check": "sweep",
        "verdict": "SKIP",
        "figures": "ray, mlflow not installed (full tier)",
        "seconds": 0.0,
        "tier": "full",
    }
    assert format_table([], "cpu").startswith("gpu-check on cpu")


def test_no_gpu_prints_the_versions_runs_nothing_and_exits_0(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = []
    monkeypatch.setattr(gpu_check, "RUNNERS", {c: ran.append for c in gpu_check.CHECKS})
    assert gpu_check.main(["--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "transformers" in out and "python" in out
    assert "no CUDA GPU is visible" in out and "nothing was run" in out
    assert ran == [] and not (tmp_path / "out").exists()
    assert gpu_check.main(["--only", "nope"]) == 2  # an unknown check: one clear error


def test_on_a_gpu_main_writes_the_table_and_json_and_fails_on_a_miss(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("hlm_ray.device.resolve_device", lambda name: torch.device("cpu"))
    runners = {c: _fake("PASS", f"{c} ok") for c in gpu_check.CHECKS}
    runners["bench"] = _boom
    monkeypatch.setattr(gpu_check, "RUNNERS", runners)
    monkeypatch.setattr(gpu_check, "missing_modules", lambda names: [])
    monkeypatch.setattr(gpu_check, "versions", lambda: {"torch": "x"})
    out = tmp_path / "out"
    assert gpu_check.main(["--only", "losses,bench", "--output", str(out)]) == 1
    rows = json.loads((out / "gpu_check.json").read_text())["rows"]
    assert [(r["check"], r["verdict"]) for r in rows] == [("losses", "PASS"), ("bench", "MISS")]
    assert gpu_check.main(["--only", "losses", "--output", str(out)]) == 0


@pytest.mark.parametrize("only", ["nope", "losses,nope"])
def test_an_unknown_check_is_one_error_line(only, capsys):
    assert gpu_check.main(["--only", only]) == 2
    assert "unknown check 'nope'" in capsys.readouterr().err


def _csv(path, rows):
    import csv

    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_bench_figures_list_every_arm_of_the_csv(tmp_path):
    from hlm_ray.gpu_check.bare import bench_figures

    target = {"target": "GPU MFU", "scope": "gpt2-small", "measured": "0.43", "threshold": "≥ 0.4"}
    _csv(tmp_path / "targets.csv", [{**target, "verdict": "PASS"}])
    arm = {"experiment": "points", "model": "gpt2-small", "V": "32768", "micro_batch": "8",
           "status": "ok", "note": "", "strongest_vanilla": "False", "peak_mb": "2048.4"}  # fmt: skip
    _csv(
        tmp_path / "train_step.csv",
        [
            {**arm, "arm": "headless/lazy", "tokens_per_s": "91000.2", "mfu": "0.431"},
            {
                **arm,
                "arm": "vanilla/liger",
                "tokens_per_s": "80000",
                "mfu": "0.38",
                "strongest_vanilla": "True",
            },  # fmt: skip
            {
                **arm,
                "arm": "vanilla/cce",
                "status": "unsupported",
                "note": "not installed",
                "tokens_per_s": "",
                "mfu": "",
                "peak_mb": "",
            },  # fmt: skip
        ],
    )
    ok, figures = bench_figures(tmp_path)
    assert ok and figures[0] == "GPU MFU (gpt2-small): 0.43 vs ≥ 0.4 PASS"
    assert figures[1:] == [
        "gpt2-small V=32768 B=8 headless/lazy: 91,000 tok/s, MFU 43.1%, peak 2,048 MB",
        "gpt2-small V=32768 B=8 vanilla/liger*: 80,000 tok/s, MFU 38.0%, peak 2,048 MB",
        "gpt2-small V=32768 B=8 vanilla/cce: unsupported not installed",
    ]
    _csv(tmp_path / "targets.csv", [{**target, "verdict": "MISS"}])
    assert not bench_figures(tmp_path)[0]


def test_the_loss_and_attention_checks_run_their_code_on_the_cpu(tmp_path, monkeypatch):
    """The CUDA checks' code paths with the device swapped for the CPU (bf16 autocast exists
    there too): a smoke test, not a GPU claim."""
    from hlm_ray.gpu_check import bare

    monkeypatch.setattr(bare, "DEVICE", "cpu")
    monkeypatch.setattr(bare, "ATTENTION_SHAPE", (2, 128, 64, 2))
    row = bare.check_losses(tmp_path)
    assert row.verdict == "PASS" and "extreme (largest logit" in row.figures
    assert "cwt" in row.figures and "ce_chunked" in row.figures
    monkeypatch.setattr(bare, "EXTREME_TOL", 0.0)
    assert bare.check_losses(tmp_path).verdict == "MISS"
    row = bare.check_attention(tmp_path)
    assert row.figures.startswith("default: ") and "flash" in row.figures
