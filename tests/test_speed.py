"""Speed verdicts from the runs' own step times (`hlm_ray.tune.speed`), and the lazy embedding
update's probe (`hlm_ray.bench.update_probe`) as the vocabulary report shows it."""

import numpy as np
import pytest

from hlm_ray.tune import stats
from hlm_ray.tune.speed import MIN_WARMUP, speed_difference, steady, steady_tokens_per_s


def test_the_warm_up_steps_are_left_out():
    assert steady(list(range(10))) == list(range(MIN_WARMUP, 10))
    assert len(steady(list(range(100)))) == 90  # a tenth


def test_one_run_per_arm_is_told_apart_by_its_steps_when_the_gap_is_wide():
    """The demo's V = 32k row: 5,481 against 21,743 tokens/s, one seed each, dozens of steps
    with a spread of a few percent: far apart, so a verdict; two runs within their spread: none."""
    rng = np.random.default_rng(0)

    def run(speed, n=50):
        return list(speed * (1 + rng.normal(0, 0.05, n)))

    d = speed_difference([run(21_743)], [run(5_481)])
    assert d.method.startswith("welch over steps (50 + 50 steps)")
    assert stats.verdict(d, higher_is_better=True) == stats.HOLDS
    assert d.low > 15_000
    close = speed_difference([run(10_000)], [run(10_050)])
    assert stats.verdict(close, higher_is_better=True) == stats.NOISE
    three = speed_difference([run(2e4), run(2.1e4), run(1.9e4)], [run(5e3), run(5.5e3), run(6e3)])
    assert three.method == "welch" and three.df < 5  # over the runs' means: run-to-run noise


def test_a_runs_summary_gives_its_steady_tokens_per_s():
    summary = {"steps": 8, "tokens": 8 * 512, "step_seconds": {"first_step": 1, "values":
               [1.0, 0.5, 0.3, 0.25, 0.25, 0.5, 0.25, 0.25]}}  # fmt: skip
    assert steady_tokens_per_s(summary) == [2048.0, 2048.0, 1024.0, 2048.0, 2048.0]
    assert steady_tokens_per_s({"steps": 3, "tokens": 30}) == []  # an older run: no step times


def test_the_probe_times_both_updates_of_a_runs_own_model(tmp_path):
    from hlm_ray.bench.update_probe import REPEATS, read_probe, update_probe, write_probe
    from hlm_ray.presets import load_config

    cfg = load_config("tiny-gpt2", overrides={"optim.micro_batch_size": 4})
    times = update_probe(cfg, vocab_size=4096)
    assert set(times) == {"dense", "lazy"} and all(len(t) == REPEATS for t in times.values())
    write_probe(times, tmp_path, 4 * 64)
    assert read_probe(tmp_path)["seconds"] == times and read_probe(tmp_path / "x") is None


def test_the_vocab_report_gives_the_lazy_update_its_own_row():
    from hlm_ray.tune.vocab_report import LAZY_ARM, lazy_points, probe_table, speed_sentence

    def probe(dense, lazy):
        return {"tokens_per_step": 1024, "seconds": {"dense": [dense] * 5 + [dense * 1.02] * 5,
                                                     "lazy": [lazy] * 5 + [lazy * 1.02] * 5}}  # fmt: skip

    rows = [
        {"objective": "headless", "value": 1024, "tokens_per_s": 10_000.0, "probe": probe(0.1, 0.1)},
        {"objective": "headless", "value": 32768, "tokens_per_s": 4_000.0, "probe": probe(0.25, 0.1)},
        {"objective": "vanilla", "value": 32768, "tokens_per_s": 2_000.0, "probe": None},
    ]  # fmt: skip
    assert lazy_points(rows) == {1024: [10_000.0], 32768: [pytest.approx(10_000.0)]}
    table = "\n".join(probe_table(rows))
    assert "| 32,768 | 4,056 | 10,140 | +6,084 [" in table and "lazy faster" in table
    assert "| 1,024 | 10,140 | 10,140 | +0 [" in table and "cannot be told apart" in table
    said = speed_sentence({"headless": {1024: [10_000.0], 32768: [4_000.0]},
                           LAZY_ARM: lazy_points(rows)}, {"headless": "dense"})  # fmt: skip
    assert "headless's training speed (dense embedding update) falls" in said
    assert "headless's training speed (lazy embedding update) stays within 15%" in said
