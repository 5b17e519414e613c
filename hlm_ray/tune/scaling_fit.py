"""Loss against compute for two arms, and the compute multiplier between them, read at each
budget of the method arm with a t interval over seeds whose coverage the tests check by
simulation.

    points = [Point("headless", seed=0, budget="2e11", x=2.4e11, loss=3.91), ...]
    result = compare_arms(points, method="headless", baseline="vanilla", floor=3.24)
    for row in result.rows: print(row.budget, format_multiplier(row), row.verdict)
    curves = fit_arms(points)                  # L = E + A·(x/x0)^-alpha per arm: a description

The multiplier at a budget b of the method arm: the compute the baseline needs to reach the loss
the method reaches at b, over the method's compute there (> 1: the method saves compute). It is
read once per seed: seed i of the method arm (its measured loss at b) against seed i of the
baseline arm, whose measured points, made non-increasing (pool-adjacent violators), are joined
by straight lines in (ln compute, loss) and read at that loss. So it is read **between the
baseline's measured budgets only**: a seed whose loss lies outside them gives no number, and a
budget where any seed does is reported as *outside the measured range* (with the side, never an
extrapolated number). The estimate is the geometric mean of the seeds' multipliers, the interval
a t interval of their logarithms (n - 1 degrees of freedom): a seed's pair is one independent
replicate of the whole measurement, so no resampling is needed, and at 3 seeds the interval is
as wide as 3 seeds warrant (`tests/test_scaling_coverage.py` simulates its coverage).

Verdicts: *holds* when the interval lies above 1, *reversed* below 1, else *cannot be told
apart*; with fewer than `MIN_SEEDS` seeds, or seeds whose multipliers are all alike, no interval.
A floor (the unigram model's loss, `hlm_ray.unigram`) withholds every verdict read where either
arm does not beat it: an arm above its floor has learnt nothing a comparison can read.

The fit (for the report's description and figures, not for the reads): `L = E + A·(x/x0)^-alpha`
(x0 the geometric mean of the compute, 0 <= E < the lowest loss, alpha > 0) by least squares on
every seed's point, started from log-linear fits over a grid of E; with fewer than
`MIN_POWER_BUDGETS` distinct budgets, the log-linear `L = a - b·ln(x/x0)` (b >= 0), said so.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hlm_ray.tune.stats import HOLDS, REVERSED, t_quantile

CANNOT = "cannot be told apart"
OUTSIDE = "outside the measured range"
AT_FLOOR = "no verdict"
MIN_SEEDS = 2
"""Seeds per arm an interval needs (one pair gives no spread)."""
MIN_POWER_BUDGETS = 4
"""Distinct budgets a saturating power law needs (3 parameters and at least one left over)."""
LEVEL = 0.95


@dataclass(frozen=True)
class Point:
    """One finished trial: its arm, seed, nominal budget, compute spent (FLOPs or seconds) and
    loss (bits per byte)."""

    arm: str
    seed: int
    budget: str
    x: float
    loss: float


@dataclass(frozen=True)
class Curve:
    """A fitted loss-against-compute curve: `power` (L = E + A·(x/x0)^-alpha) or `loglinear`
    (L = a - b·ln(x/x0))."""

    kind: str
    params: dict[str, float]
    x0: float
    rss: float
    n: int

    def __call__(self, x) -> np.ndarray:
        t = np.log(np.asarray(x, dtype=np.float64) / self.x0)
        p = self.params
        if self.kind == "power":
            return p["E"] + p["A"] * np.exp(-p["alpha"] * t)
        return p["a"] - p["b"] * t

    def inverse(self, loss: float) -> float:
        """The compute at which the curve reaches `loss`: inf when it never gets that low, 0 when
        it starts below it."""
        p = self.params
        if self.kind == "power":
            if loss <= p["E"]:
                return math.inf
            return self.x0 * (p["A"] / (loss - p["E"])) ** (1.0 / p["alpha"])
        if p["b"] <= 0:
            return math.inf if loss < p["a"] else 0.0
        return self.x0 * math.exp((p["a"] - loss) / p["b"])

    def describe(self) -> str:
        p = self.params
        if self.kind == "power":
            return f"L = {p['E']:.4g} + {p['A']:.4g}·(C/{self.x0:.3g})^-{p['alpha']:.3g}"
        return f"L = {p['a']:.4g} - {p['b']:.4g}·ln(C/{self.x0:.3g}) (log-linear)"


def fit_curve(xs: Sequence[float], losses: Sequence[float], budgets: int | None = None) -> Curve:
    """The saturating power law through the points, or the log-linear line with fewer than
    `MIN_POWER_BUDGETS` budgets (`budgets`: how many the points were run at; default, their
    distinct compute values: the seeds of one budget spend slightly different compute)."""
    from scipy.optimize import least_squares

    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(losses, dtype=np.float64)
    if len(x) < 2 or len(np.unique(np.round(np.log(x), 6))) < 2:
        raise ValueError(f"a curve needs points at two or more compute values, got {list(x)}")
    x0 = float(np.exp(np.log(x).mean()))
    t = np.log(x / x0)
    if (budgets or len(np.unique(np.round(t, 6)))) < MIN_POWER_BUDGETS:
        slope, intercept = np.polyfit(t, y, 1)
        b = max(0.0, -float(slope))
        a = float(y.mean() + b * t.mean()) if b == 0.0 else float(intercept)
        rss = float(((a - b * t - y) ** 2).sum())
        return Curve("loglinear", {"a": a, "b": b}, x0, rss, len(x))
    top = float(y.min()) * (1 - 1e-6)

    def residuals(theta):
        e, log_a, alpha = theta
        return e + np.exp(log_a - alpha * t) - y

    best = None
    for e in np.linspace(0.0, top, 9)[:-1]:  # starts: log-linear fits of log(L - E)
        slope, intercept = np.polyfit(t, np.log(y - e), 1)
        start = [e, intercept, float(np.clip(-slope, 1e-3, 5.0))]
        fit = least_squares(residuals, start, bounds=([0.0, -50.0, 1e-4], [top, 50.0, 10.0]))
        if best is None or fit.cost < best.cost:
            best = fit
    e, log_a, alpha = (float(v) for v in best.x)
    params = {"E": e, "A": math.exp(log_a), "alpha": alpha}
    return Curve("power", params, x0, float(2 * best.cost), len(x))


@dataclass(frozen=True)
class Multiplier:
    """The multiplier at one budget of the method arm."""

    budget: str
    method_x: float
    """The method's mean compute at this budget (geometric mean over its seeds)."""
    target: float
    """The method's mean loss there: what the baseline must reach."""
    reads: tuple[float, ...]
    """Each seed pair's multiplier: math.inf where the baseline's largest budget does not reach
    the method seed's loss, 0.0 where its smallest is already below it."""
    estimate: float
    """The geometric mean of `reads` (nan when any read is outside the measured range)."""
    low: float
    high: float
    """The 95% t interval (nan without one)."""
    bound_high: float
    """The largest multiplier readable here: the baseline's largest compute / method_x."""
    bound_low: float
    """The smallest: the baseline's smallest compute / method_x."""
    verdict: str
    note: str = ""


@dataclass
class Comparison:
    method: str
    baseline: str
    rows: list[Multiplier]
    seeds: dict[str, int]
    pairs: int
    """Seed pairs read (seed i of the method against seed i of the baseline)."""
    points: list[Point] = field(default_factory=list)
    floor: float | None = None


def fit_arms(points: Sequence[Point]) -> dict[str, Curve]:
    """Each arm's fit over all its points (the report's description and figures; the
    multiplier is read from the measured points, not from these): arms that cannot be fitted
    are left out."""
    curves = {}
    for arm in dict.fromkeys(p.arm for p in points):
        mine = [p for p in points if p.arm == arm and math.isfinite(p.loss)]
        with contextlib.suppress(ValueError, np.linalg.LinAlgError):  # a figure without a fit
            curves[arm] = fit_curve([p.x for p in mine], [p.loss for p in mine],
                                    len({p.budget for p in mine}))  # fmt: skip
    return curves


def budget_means(points: list[Point]) -> dict[str, float]:
    """Mean compute per budget (geometric mean of the seeds'), in the order of increasing
    compute."""
    xs: dict[str, list[float]] = {}
    for p in points:
        xs.setdefault(p.budget, []).append(p.x)
    means = {b: float(np.exp(np.mean(np.log(v)))) for b, v in xs.items()}
    return dict(sorted(means.items(), key=lambda kv: kv[1]))


def non_increasing(ys: Sequence[float]) -> list[float]:
    """The least-squares non-increasing sequence closest to `ys` (pool-adjacent violators): one
    seed's losses at increasing budgets, made invertible without moving a point that needs no
    moving."""
    blocks: list[list[float]] = []  # [mean, weight]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return [m for m, w in blocks for _ in range(int(w))]


def read_compute(xs: Sequence[float], losses: Sequence[float], target: float) -> float:
    """The compute at which one seed's curve (its points at increasing `xs`, made
    non-increasing, joined by straight lines in (ln x, loss)) reaches `target`: math.inf when
    its last point is still above it, 0.0 when its first is already at or below it."""
    order = np.argsort(xs)
    x = np.log(np.asarray(xs, dtype=np.float64)[order])
    y = np.asarray(non_increasing(np.asarray(losses, dtype=np.float64)[order]))
    if target < y[-1]:
        return math.inf
    if target >= y[0]:
        return 0.0 if target > y[0] else float(np.exp(x[0]))
    j = int(np.nonzero(y <= target)[0][0])  # the first point at or below the target
    x0, x1, y0, y1 = x[j - 1], x[j], y[j - 1], y[j]
    return float(np.exp(x0 + (x1 - x0) * (y0 - target) / (y0 - y1)))


def compare_arms(
    points: Sequence[Point],
    *,
    method: str = "headless",
    baseline: str = "vanilla",
    floor: float | None = None,
) -> Comparison:
    """Read the multiplier at each of the method's budgets (module docstring); `floor`, the
    loss of the unigram model of the training tokens, withholds verdicts where an arm does not
    beat it."""
    arms = {
        a: [p for p in points if p.arm == a and math.isfinite(p.loss)] for a in (method, baseline)
    }
    for arm, mine in arms.items():
        # A nan or zero compute would read as nan and be shown as outside the range: refuse it.
        bad = [p for p in mine if not (math.isfinite(p.x) and p.x > 0)]
        if bad:
            p = bad[0]
            raise ValueError(f"arm {arm!r} seed {p.seed} at budget {p.budget} has compute "
                             f"{p.x}, not a positive number")  # fmt: skip
        if len({p.budget for p in mine}) < 2:
            raise ValueError(f"arm {arm!r} has finished trials at fewer than two budgets")
    seeds = {a: sorted({p.seed for p in mine}) for a, mine in arms.items()}
    pairs = list(zip(seeds[method], seeds[baseline], strict=False))
    base_x = budget_means(arms[baseline])
    lo_x, hi_x = min(base_x.values()), max(base_x.values())
    rows = []
    for budget, x in budget_means(arms[method]).items():
        reads = []
        for s_m, s_b in pairs:
            mine = [p for p in arms[method] if p.seed == s_m and p.budget == budget]
            theirs = [p for p in arms[baseline] if p.seed == s_b]
            if mine and len({p.budget for p in theirs}) >= 2:
                need = read_compute([p.x for p in theirs], [p.loss for p in theirs], mine[0].loss)
                reads.append(need / mine[0].x if 0 < need < math.inf else need)
        at = [p.loss for p in arms[method] if p.budget == budget]
        rows.append(_row(budget, x, float(np.mean(at)), tuple(reads), hi_x / x, lo_x / x))
    if floor is not None:
        rows = [_floor_check(r, arms, method, baseline, floor) for r in rows]
    counts = {a: len(s) for a, s in seeds.items()}
    return Comparison(method, baseline, rows, counts, len(pairs), list(points), floor)


def _row(budget, x, target, reads, bound_high, bound_low) -> Multiplier:
    nan = math.nan
    if not reads:
        return Multiplier(budget, x, target, reads, nan, nan, nan, bound_high, bound_low, CANNOT,
                          "no seed pair has points to read")  # fmt: skip
    outside = [r for r in reads if r in (0.0, math.inf)]
    if outside:
        high = sum(r == math.inf for r in outside)
        side = (f"{high} of {len(reads)} seed(s) need more than the baseline's largest budget"
                if high else "")  # fmt: skip
        low = len(outside) - high
        side += ("; " if high and low else "") + (
            f"{low} of {len(reads)} already reached by its smallest budget" if low else ""
        )
        return Multiplier(budget, x, target, reads, nan, nan, nan, bound_high, bound_low,
                          OUTSIDE, side)  # fmt: skip
    logs = np.log(np.asarray(reads))
    estimate = float(np.exp(logs.mean()))
    if len(reads) < MIN_SEEDS:
        return Multiplier(budget, x, target, reads, estimate, nan, nan, bound_high, bound_low,
                          CANNOT, f"fewer than {MIN_SEEDS} seed pairs: no interval")  # fmt: skip
    sd = float(logs.std(ddof=1))
    if sd == 0.0:
        return Multiplier(budget, x, target, reads, estimate, nan, nan, bound_high, bound_low,
                          CANNOT, "the seeds' multipliers do not vary: no interval")  # fmt: skip
    half = t_quantile(len(reads) - 1, LEVEL) * sd / math.sqrt(len(reads))
    low, high = float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))
    verdict = HOLDS if low > 1 else REVERSED if high < 1 else CANNOT
    return Multiplier(budget, x, target, reads, estimate, low, high, bound_high, bound_low,
                      verdict)  # fmt: skip


def beats_floor(losses: Sequence[float], floor: float) -> bool:
    """Whether an arm's losses at one budget are below the floor: the upper end of the 95% t
    interval of their mean (one seed: the loss itself) is below it."""
    from hlm_ray.tune.stats import describe

    s = describe(list(losses))
    top = s.high if s.n > 1 and math.isfinite(s.high) else s.mean
    return math.isfinite(top) and top < floor


def _floor_check(row: Multiplier, arms, method: str, baseline: str, floor: float) -> Multiplier:
    """The row's verdict withheld where the method at this budget, or the baseline at any of
    its budgets, does not beat the floor (the reads use its whole curve)."""
    from dataclasses import replace

    late = [arm for arm, budgets in ((method, [row.budget]),
                                     (baseline, sorted({p.budget for p in arms[baseline]})))
            for b in budgets
            if not beats_floor([p.loss for p in arms[arm] if p.budget == b], floor)]  # fmt: skip
    if not late or row.verdict == OUTSIDE:
        return row
    who = " and ".join(dict.fromkeys(late))
    why = f"{who} does not beat the floor {floor:.4f} (the unigram model of the training tokens)"
    return replace(row, verdict=AT_FLOOR, note=why)


def _num(value: float) -> str:
    return f"{value:.3g}"


def format_multiplier(row: Multiplier) -> str:
    """`6.2× [4.1, 9.8]`; outside the baseline's measured budgets: `> 16× (outside the measured
    range)` or `< 0.5× (...)`, a bound, never an extrapolated number."""
    if row.verdict == OUTSIDE or (not math.isfinite(row.estimate) and row.reads):
        above = any(r == math.inf for r in row.reads)
        below = any(r == 0.0 for r in row.reads)
        if above and not below:
            return f"> {_num(row.bound_high)}× ({OUTSIDE})"
        if below and not above:
            return f"< {_num(row.bound_low)}× ({OUTSIDE})"
        return f"{OUTSIDE} on both sides"
    if not math.isfinite(row.estimate):
        return "–"
    point = f"{_num(row.estimate)}×"
    if not math.isfinite(row.low):
        return point
    return f"{point} [{_num(row.low)}, {_num(row.high)}]"


def closing_sentence(c: Comparison, unit: str, scale: str) -> str:
    """What the comparison found, in words, whichever way it fell; budgets without a verdict
    are named with the reason (outside the measured range, an arm at its floor, no interval)."""
    held = [r for r in c.rows if r.verdict == HOLDS]
    reversed_ = [r for r in c.rows if r.verdict == REVERSED]
    seeds = f"{c.pairs} seed pair{'s' if c.pairs != 1 else ''}"

    def at(rows):
        return "; ".join(f"{format_multiplier(r)} at {r.budget}" for r in rows)

    others = [r for r in c.rows if r.verdict not in (HOLDS, REVERSED)]
    said = "; ".join(
        f"at {r.budget} {r.verdict}" + (f" ({r.note})" if r.note else "") for r in others
    )
    if not held and not reversed_:
        return f"Against {unit}, no budget gives a verdict at {scale} ({seeds}): {said}."
    parts = []
    if held:
        parts.append(
            f"{c.method} reaches its loss for **less** {unit}: {c.baseline} needs, in multiples "
            f"of {c.method}'s {unit}, {at(held)} (95% t intervals over {seeds})"
        )
    if reversed_:
        parts.append(f"{c.baseline} reaches {c.method}'s loss for **less** {unit}: {at(reversed_)}")
    if others:
        parts.append(said)
    return "Against " + unit + ": " + "; ".join(parts) + "."
