"""Loss against compute for two arms, and the compute multiplier between them, with a bootstrap
over seeds.

    points = [Point("headless", seed=0, budget="2e11", x=2.4e11, loss=3.91), ...]
    curve = fit_curve(xs, losses)              # L = E + A·(x/x0)^-alpha, or log-linear
    result = compare_arms(points, method="headless", baseline="vanilla")
    for row in result.rows: print(row.budget, format_multiplier(row), row.verdict)

The multiplier at a budget of the method arm: the compute the baseline needs to reach the loss
the method reaches there, over the method's compute (> 1: the method saves compute), read off
the two fitted curves. It is read **inside the baseline's measured range only**: when the
baseline's fitted curve does not reach that loss within its budgets, the multiplier is a bound
(`> X`, the baseline's largest compute over the method's), never an extrapolated number; when
the baseline is already better at its smallest budget, `< X`.

The interval is a percentile bootstrap over seeds: each resample draws each arm's seeds with
replacement (a seed's whole curve at once: one seed's runs share their data order and initial
weights, so its points move together), refits both curves and reads the multiplier again,
censored as above. Verdicts: *holds* when the 95% interval is above 1 (the method reaches the
loss with less compute), *reversed* when it is below 1, else *cannot be told apart*; always
*cannot be told apart* with fewer than `MIN_SEEDS` seeds in an arm, or when the resamples do
not vary (identical seeds: no spread to make an interval from).

The fit: `L = E + A·(x/x0)^-alpha` (x0 the geometric mean of the compute, 0 <= E < the lowest
loss, alpha > 0) by least squares on every seed's point, started from log-linear fits over a
grid of E. With fewer than `MIN_POWER_BUDGETS` distinct budgets three parameters cannot be
fitted with any check left, so the curve is log-linear, `L = a - b·ln(x/x0)` (b >= 0), and
says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hlm_ray.tune.stats import HOLDS, REVERSED

CANNOT = "cannot be told apart"
MIN_SEEDS = 3
"""Seeds per arm below which no interval is given (3 seeds give 10 distinct resamples)."""
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
    """The method's mean compute at this budget (where its curve is read)."""
    target: float
    """The method's fitted loss there: what the baseline must reach."""
    baseline_x: float
    """The baseline's compute to reach it on its curve (inf / 0 outside its curve's reach)."""
    estimate: float
    """baseline_x / method_x, or +inf / 0 when it needs extrapolation (a bound)."""
    low: float
    high: float
    """The 95% bootstrap interval; +inf / 0 at an end that needs extrapolation (a bound)."""
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
    curves: dict[str, Curve]
    rows: list[Multiplier]
    seeds: dict[str, int]
    resamples: int
    distinct: int
    """Distinct resamples (pairs of seed multisets) the bootstrap drew."""
    points: list[Point] = field(default_factory=list)


def budget_means(points: list[Point]) -> dict[str, float]:
    """Mean compute per budget (geometric mean of the seeds'), in the order of increasing
    compute."""
    xs: dict[str, list[float]] = {}
    for p in points:
        xs.setdefault(p.budget, []).append(p.x)
    means = {b: float(np.exp(np.mean(np.log(v)))) for b, v in xs.items()}
    return dict(sorted(means.items(), key=lambda kv: kv[1]))


def _read(method: Curve, baseline: Curve, at: float, lo_x: float, hi_x: float) -> tuple:
    """(target loss, baseline compute, multiplier censored to the baseline's range)."""
    target = float(method(at))
    if target < float(baseline(hi_x)):
        return target, baseline.inverse(target), math.inf
    if target > float(baseline(lo_x)):
        return target, baseline.inverse(target), 0.0
    need = baseline.inverse(target)
    return target, need, need / at


def compare_arms(
    points: Sequence[Point],
    *,
    method: str = "headless",
    baseline: str = "vanilla",
    resamples: int = 2000,
    seed: int = 0,
) -> Comparison:
    """Fit both arms and read the multiplier at each of the method's budgets, with its
    bootstrap interval over seeds and a verdict (module docstring)."""
    arms = {
        a: [p for p in points if p.arm == a and math.isfinite(p.loss)] for a in (method, baseline)
    }
    for arm, mine in arms.items():
        if len({p.budget for p in mine}) < 2:
            raise ValueError(f"arm {arm!r} has finished trials at fewer than two budgets")
    seeds = {a: sorted({p.seed for p in mine}) for a, mine in arms.items()}
    by_seed = {a: {s: [p for p in arms[a] if p.seed == s] for s in seeds[a]} for a in arms}
    cache: dict[tuple, Curve | None] = {}

    def curve(arm: str, drawn: tuple[int, ...]) -> Curve | None:
        key = (arm, drawn)
        if key not in cache:
            pts = [p for s in drawn for p in by_seed[arm][s]]
            try:
                xs, ys = [p.x for p in pts], [p.loss for p in pts]
                cache[key] = fit_curve(xs, ys, len({p.budget for p in pts}))
            except (ValueError, np.linalg.LinAlgError):
                cache[key] = None
        return cache[key]

    full = {a: curve(a, tuple(seeds[a])) for a in arms}
    at = budget_means(arms[method])
    base_x = budget_means(arms[baseline]).values()
    lo_x, hi_x = min(base_x), max(base_x)
    few = min(len(s) for s in seeds.values()) < MIN_SEEDS
    resamples = 0 if few else resamples  # no interval is given: no resamples drawn
    rng = np.random.default_rng(seed)
    draws = []  # per resample and budget: (multiplier censored to the range, target loss)
    distinct = set()
    for _ in range(resamples):
        drawn = {a: tuple(sorted(rng.choice(seeds[a], size=len(seeds[a])))) for a in arms}
        distinct.add((drawn[method], drawn[baseline]))
        m, b = curve(method, drawn[method]), curve(baseline, drawn[baseline])
        if m is not None and b is not None:
            draws.append([_read(m, b, x, lo_x, hi_x)[2::-2] for x in at.values()])
    values = np.asarray(draws, dtype=np.float64).reshape(len(draws), len(at), 2)
    rows = []
    for i, (budget, x) in enumerate(at.items()):
        target, need, estimate = _read(full[method], full[baseline], x, lo_x, hi_x)
        col = values[:, i, 0] if len(values) else np.asarray([estimate])
        # Interval ends taken from the resamples themselves (no interpolation across a bound).
        low = float(np.quantile(col, (1 - LEVEL) / 2, method="lower"))
        high = float(np.quantile(col, (1 + LEVEL) / 2, method="higher"))
        verdict, note = _verdict(low, high, hi_x / x, lo_x / x)
        if few:
            verdict, note = CANNOT, f"fewer than {MIN_SEEDS} seeds per arm: no interval"
        elif len(values) and np.ptp(values[:, i, 1]) == 0:  # the targets never move
            verdict, note = CANNOT, "the resamples do not vary: no spread to make an interval"
        rows.append(
            Multiplier(
                budget, x, target, need, estimate, low, high, hi_x / x, lo_x / x, verdict, note
            )
        )
    return Comparison(
        method, baseline, full, rows, {a: len(s) for a, s in seeds.items()}, resamples,
        len(distinct), list(points),
    )  # fmt: skip


def _verdict(low: float, high: float, bound_high: float, bound_low: float) -> tuple[str, str]:
    """Holds when the whole interval is above 1, reversed when below; an end at a bound counts
    only as far as the bound goes (`> 0.9` says nothing about 1)."""
    above = low > 1 if 0 < low < math.inf else low == math.inf and bound_high >= 1
    below = high < 1 if 0 < high < math.inf else high == 0 and bound_low <= 1
    return (HOLDS, "") if above else (REVERSED, "") if below else (CANNOT, "")


def _num(value: float) -> str:
    return f"{value:.3g}"


def format_multiplier(row: Multiplier) -> str:
    """`6.2× [4.1, 9.8]`, with a bound where extrapolation would be needed: `> 16×`,
    `[2.5, > 16]`, `< 1×`."""

    def end(value: float) -> str:
        if value == math.inf:
            return f"> {_num(row.bound_high)}"
        if value == 0.0:
            return f"< {_num(row.bound_low)}"
        return _num(value)

    if row.estimate == math.inf:
        point = f"> {_num(row.bound_high)}×"
    elif row.estimate == 0.0:
        point = f"< {_num(row.bound_low)}×"
    else:
        point = f"{_num(row.estimate)}×"
    if row.note.startswith("fewer than"):
        return point
    low, high = end(row.low), end(row.high)
    return f"{point} (every resample {low})" if low == high else f"{point} [{low}, {high}]"


def closing_sentence(c: Comparison, unit: str, scale: str) -> str:
    """What the comparison found, in words, whichever way it fell."""
    held = [r for r in c.rows if r.verdict == HOLDS]
    reversed_ = [r for r in c.rows if r.verdict == REVERSED]
    seeds = f"{c.seeds[c.method]} + {c.seeds[c.baseline]} seeds"

    def at(rows):
        return "; ".join(f"{format_multiplier(r)} at {r.budget}" for r in rows)

    if not held and not reversed_:
        why = next((r.note for r in c.rows if r.note), "every interval includes 1")
        return (
            f"Against {unit}, the compute {c.baseline} needs to reach {c.method}'s loss "
            f"**cannot be told apart** from {c.method}'s own at {scale} ({why}; {seeds}; "
            f"read at each budget: {at(c.rows)})."
        )
    parts = []
    if held:
        parts.append(
            f"{c.method} reaches its loss for **less** {unit}: {c.baseline} needs, in multiples "
            f"of {c.method}'s {unit}, {at(held)} (95% bootstrap intervals over seeds, {seeds})"
        )
    if reversed_:
        parts.append(f"{c.baseline} reaches {c.method}'s loss for **less** {unit}: {at(reversed_)}")
    rest = len(c.rows) - len(held) - len(reversed_)
    if rest:
        parts.append(f"at the other {rest} budget(s) the two cannot be told apart")
    return "Against " + unit + ": " + "; ".join(parts) + "."
