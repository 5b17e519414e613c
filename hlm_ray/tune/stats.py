"""Statistics of a comparison across seeds: mean ± sd per arm, the difference with a 95% interval,
whether a score is distinguishable from its baseline, and a verdict in words.

    from hlm_ray.tune.stats import describe, difference, verdict, near_baseline
    describe([0.81, 0.83, 0.80])             # Summary(n=3, mean=0.8133, sd=0.0153, low, high)
    d = difference(headless, vanilla)        # Welch t interval of mean(headless) - mean(vanilla)
    d = difference(h, v, paired=True)        # paired by seed: t interval of the per-seed gaps
    verdict(d, higher_is_better=True)        # "holds" | "reversed" | "cannot be told apart ..."
    near_baseline(describe(scores), 0.5)     # True: the 95% interval of the mean includes it

Plain numpy plus the t quantile from scipy (checked against scipy.stats in the tests). A
difference has no interval, and its verdict is "cannot be told apart from noise", in two cases,
and its `reason` says which: an arm with fewer than MIN_SEEDS scores (one run per arm cannot
separate a difference from seed noise), and zero spread (every seed of both arms, or every
per-seed gap, alike: two classifiers collapsed to their majority class score exactly alike, and
that says nothing about how far apart seed noise can put them, so the interval is not zero-width).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

HOLDS = "holds"
REVERSED = "reversed"
NOISE = "cannot be told apart from noise"
WITHHELD = "no verdict"
"""An arm does not beat its floor or baseline: the comparison is not read (the row says why)."""
MIN_SEEDS = 2
"""Scores per arm an interval needs: with one, seed noise cannot be estimated."""
ZERO_SPREAD = "zero spread: each arm's seeds scored exactly alike, which says nothing of seed noise"
ZERO_SPREAD_PAIRED = "zero spread: every seed's gap is the same, which says nothing of seed noise"


@dataclass(frozen=True)
class Summary:
    """Scores of one arm over seeds: mean, sample sd (ddof=1) and the 95% t interval of the
    mean."""

    n: int
    mean: float
    sd: float
    low: float
    high: float


@dataclass(frozen=True)
class Difference:
    """mean(a) - mean(b) with its 95% interval; `method` says how it was computed; `reason`
    says why there is no interval (too few seeds, zero spread), empty when there is one."""

    estimate: float
    low: float
    high: float
    df: float
    method: str
    reason: str = ""


def t_quantile(df: float, level: float = 0.95) -> float:
    """The two-sided t critical value (scipy.stats.t.ppf((1 + level) / 2, df))."""
    from scipy.stats import t

    return float(t.ppf((1.0 + level) / 2.0, df))


def _clean(values: Sequence[float]) -> np.ndarray:
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return x[np.isfinite(x)]


def describe(values: Sequence[float], level: float = 0.95) -> Summary:
    """Mean, sample sd and the t interval of the mean of the finite `values`."""
    x = _clean(values)
    n = len(x)
    if n == 0:
        return Summary(0, math.nan, math.nan, math.nan, math.nan)
    mean = float(x.mean())
    if n == 1:
        return Summary(1, mean, math.nan, math.nan, math.nan)
    sd = float(x.std(ddof=1))
    half = t_quantile(n - 1, level) * sd / math.sqrt(n)
    return Summary(n, mean, sd, mean - half, mean + half)


def welch(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Difference:
    """Welch's unequal-variance t interval of mean(a) - mean(b) (Welch-Satterthwaite df)."""
    x, y = _clean(a), _clean(b)
    if len(x) == 0 or len(y) == 0:
        return Difference(math.nan, math.nan, math.nan, math.nan, "welch", "an arm has no score")
    estimate = float(x.mean() - y.mean())
    if len(x) < MIN_SEEDS or len(y) < MIN_SEEDS:
        return _no_interval(estimate, "welch", _too_few(len(x), len(y)))
    va, vb = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    se2 = va + vb
    if se2 == 0.0:
        return _no_interval(estimate, "welch", ZERO_SPREAD)
    df = se2**2 / (va**2 / (len(x) - 1) + vb**2 / (len(y) - 1))
    half = t_quantile(df, level) * math.sqrt(se2)
    return Difference(estimate, estimate - half, estimate + half, float(df), "welch")


def paired(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Difference:
    """The t interval of the mean per-seed difference a[i] - b[i] (pairs with a NaN dropped)."""
    if len(a) != len(b):
        raise ValueError(f"paired scores need equal lengths, got {len(a)} and {len(b)}")
    gaps = _clean([x - y for x, y in zip(a, b, strict=True) if _finite(x) and _finite(y)])
    s = describe(gaps, level)
    if s.n < MIN_SEEDS:
        reason = _too_few(s.n, s.n) if s.n else "no seed scored in both arms"
        return _no_interval(s.mean, "paired", reason)
    if s.sd == 0.0:
        return _no_interval(s.mean, "paired", ZERO_SPREAD_PAIRED)
    return Difference(s.mean, s.low, s.high, float(s.n - 1), "paired")


def _too_few(n_headless: int, n_vanilla: int) -> str:
    if n_headless == n_vanilla == 1:
        return "one seed per arm gives no interval"
    return (
        f"{min(n_headless, n_vanilla)} seed(s) in an arm: an interval needs {MIN_SEEDS} or more "
        "per arm"
    )


def _no_interval(estimate: float, method: str, reason: str) -> Difference:
    return Difference(estimate, math.nan, math.nan, math.nan, method, reason)


def difference(
    a: Sequence[float], b: Sequence[float], *, paired_by_seed: bool = False, level: float = 0.95
) -> Difference:
    """mean(a) - mean(b): paired by seed (a[i], b[i] share seed i) or Welch (unpaired)."""
    return paired(a, b, level) if paired_by_seed else welch(a, b, level)


def verdict(d: Difference, *, higher_is_better: bool) -> str:
    """ "holds" when the interval of (headless - vanilla) excludes 0 in the direction the paper
    reports (headless better), "reversed" when it excludes 0 the other way, else noise (always
    when there is no interval: `d.reason` says why)."""
    if d.reason or not (_finite(d.low) and _finite(d.high)) or d.low == d.high:
        return NOISE
    better = d.low > 0 if higher_is_better else d.high < 0
    worse = d.high < 0 if higher_is_better else d.low > 0
    return HOLDS if better else REVERSED if worse else NOISE


def near_baseline(
    s: Summary, baseline: float | None, *, higher_is_better: bool = True, tolerance: float = 1e-9
) -> bool:
    """Whether an arm's score cannot be told apart from its baseline: the 95% interval of its
    mean includes the baseline, or the mean is no better than the baseline (one seed: no
    interval, only the score)."""
    if baseline is None or not _finite(s.mean):
        return False
    gain = s.mean - baseline if higher_is_better else baseline - s.mean
    if gain <= tolerance:
        return True
    return (
        _finite(s.low) and _finite(s.high) and s.low - tolerance <= baseline <= s.high + tolerance
    )


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)
