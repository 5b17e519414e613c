"""The intervals' coverage, simulated: the compute multiplier's and the headline difference's
nominal 95% intervals must cover the true value at least 90% of the time, at the 3 and 5 seeds the
sweeps use, on known curves with noise like the measured one (a seed's whole curve moves together
by a per-seed offset, each point by its own noise; the cpu reports' sd over seeds is 0.006 to
0.022 bits per byte).

A percentile bootstrap of the seeds' mean spans about ±0.9 sd at 3 seeds: in this simulation it
covered 0.73 of the time at 3 seeds and 0.80-0.82 at 5 (checked by hand), so these tests fail on it;
the t interval covered 0.94-0.96."""

import math

import numpy as np
import pytest

from hlm_ray.tune.scaling_fit import OUTSIDE, Point, compare_arms
from hlm_ray.tune.stats import welch

BUDGETS = [1e12 * 2**i for i in range(4)]  # 8× span, as the cpu preset
EXPERIMENTS = 300
SEED_SD, POINT_SD = 0.010, 0.010


def vanilla(c):
    """A saturating power law like the cpu preset's fits (bits per byte)."""
    return 3.0 + 0.6 * (c / 1e12) ** -0.35


def experiment(rng, multiplier: float, seeds: int) -> list[Point]:
    """Both arms at every budget and seed; the headless arm's curve is vanilla's with every
    FLOP worth `multiplier` FLOPs: its true multiplier is `multiplier` at every budget."""
    out = []
    for arm, m in (("vanilla", 1.0), ("headless", multiplier)):
        for seed in range(seeds):
            offset = rng.normal(0, SEED_SD)
            for c in BUDGETS:
                loss = vanilla(m * c) + offset + rng.normal(0, POINT_SD)
                out.append(Point(arm, seed, f"{c:.3g}", c, loss))
    return out


@pytest.mark.parametrize("seeds", [3, 5])
@pytest.mark.parametrize("multiplier", [1.6, 0.6])
def test_the_multipliers_interval_covers_the_true_value(seeds, multiplier):
    rng = np.random.default_rng(seeds * 100 + int(multiplier * 10))
    covered = given = readable = 0
    for _ in range(EXPERIMENTS):
        for row, c in zip(compare_arms(experiment(rng, multiplier, seeds)).rows, BUDGETS,
                          strict=True):  # fmt: skip
            if not BUDGETS[0] * 1.05 <= multiplier * c <= BUDGETS[-1] / 1.05:
                continue  # the true value lies outside the measured range: no number owed
            readable += 1
            if math.isfinite(row.low):
                given += 1
                covered += row.low <= multiplier <= row.high
    assert given >= 0.8 * readable, (given, readable)  # intervals are given, not withheld
    coverage = covered / given
    assert coverage >= 0.90, f"{coverage:.3f} of {given} intervals covered {multiplier}"


def test_a_bound_is_never_read_outside_the_measured_range():
    """A true multiplier of 3 at the largest headless budget needs vanilla at 3× its largest
    budget: the row says so instead of a number."""
    rng = np.random.default_rng(7)
    row = compare_arms(experiment(rng, 3.0, 3)).rows[-1]
    assert row.verdict == OUTSIDE and not math.isfinite(row.estimate)
    assert "more than the baseline's largest budget" in row.note


@pytest.mark.parametrize("seeds", [3, 5])
def test_the_headline_differences_welch_interval_covers_the_true_difference(seeds):
    """The headline report's interval (Welch) on two arms with unequal spread, 3 and 5 seeds."""
    rng = np.random.default_rng(seeds)
    covered = 0
    for _ in range(2000):
        a = rng.normal(3.10, 0.02, size=seeds)
        b = rng.normal(3.15, 0.006, size=seeds)
        d = welch(a, b)
        covered += d.low <= -0.05 <= d.high
    assert covered / 2000 >= 0.90, covered / 2000
