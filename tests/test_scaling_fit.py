"""`hlm_ray.tune.scaling_fit` as plain functions against hand-computed values: the curves and
their inverse, the fits on small exact data, the reads at a measured point's own loss, each row
of the comparison field by field, and the report's sentences word for word. No Ray; its 17 tests
take about 0.6 s together. (tests/test_scaling.py checks the same functions on simulated sweeps.)"""

import math

import numpy as np
import pytest
from scipy.stats import t as student_t

from hlm_ray.tune.scaling_fit import (
    AT_FLOOR,
    CANNOT,
    OUTSIDE,
    Comparison,
    Curve,
    Multiplier,
    Point,
    _row,
    beats_floor,
    closing_sentence,
    compare_arms,
    fit_arms,
    fit_curve,
    format_multiplier,
    non_increasing,
    read_compute,
)
from hlm_ray.tune.stats import HOLDS, REVERSED

LN2 = math.log(2.0)
T1 = float(student_t.ppf(0.975, 1))  # the t quantile of a 95% interval at 2 seeds


def same(row: Multiplier, **want) -> None:
    """Every field of `row` equals `want`'s (nan equal to nan, floats to 1e-9)."""
    for name, value in want.items():
        got = getattr(row, name)
        if isinstance(value, float) and math.isnan(value):
            assert isinstance(got, float) and math.isnan(got), (name, got)
        elif isinstance(value, (float, tuple)):
            assert got == pytest.approx(value, rel=1e-9), (name, got, value)
        else:
            assert got == value, (name, got, value)
    assert set(want) == set(Multiplier.__dataclass_fields__), "compare every field"


# ---------------------------------------------------------------------------------- curves (0.01 s)


def test_a_power_curve_its_inverse_and_its_description():
    curve = Curve("power", {"E": 2.0, "A": 1.5, "alpha": 0.5}, 4.0, 0.0, 4)
    assert curve(16.0) == pytest.approx(2.75)  # 2 + 1.5·(16/4)^-0.5
    assert curve([4, 16]) == pytest.approx([3.5, 2.75])
    assert curve.inverse(2.75) == pytest.approx(16.0)
    assert curve.inverse(2.0) == math.inf and curve.inverse(1.9) == math.inf  # at E: never
    # float32 compute or exact integer FLOPs past int64 are read in float64
    out = curve(np.float32([4.0, 16.0]))
    assert out.dtype == np.float64 and curve([4 * 10**20]) == pytest.approx([2.0 + 1.5e-10])
    described = Curve("power", {"E": 2.34567, "A": 1.23456, "alpha": 0.345678}, 2.5e11, 0, 4)
    assert described.describe() == "L = 2.346 + 1.235·(C/2.5e+11)^-0.346"


def test_a_log_linear_curve_its_inverse_and_a_flat_one():
    curve = Curve("loglinear", {"a": 3.0, "b": 0.5}, 10.0, 0.0, 3)
    assert curve(10.0 * math.e**2) == pytest.approx(2.0)  # 3 - 0.5·2
    assert curve.inverse(2.0) == pytest.approx(10.0 * math.e**2)
    assert curve.inverse(3.5) == pytest.approx(10.0 / math.e)
    assert curve.describe() == "L = 3 - 0.5·ln(C/10) (log-linear)"
    flat = Curve("loglinear", {"a": 3.0, "b": 0.0}, 10.0, 0.0, 3)  # it never goes down
    assert flat.inverse(2.9) == math.inf  # never reached
    assert flat.inverse(3.0) == 0.0 and flat.inverse(3.5) == 0.0  # reached from the start


# ---------------------------------------------------------------------------------- the fit (0.4 s)


def test_the_log_linear_fit_by_hand():
    """t = ln(x/x0) = (-ln 2, 0, ln 2) around x0 = 1: the least-squares line through (3, 3, 2)
    has slope -1/(2 ln 2) and height 8/3, residuals (1/6, -1/3, 1/6): rss 1/6."""
    for xs in ([0.5, 1.0, 2.0], [5 * 10**19, 10**20, 2 * 10**20], np.float32([0.5, 1.0, 2.0])):
        curve = fit_curve(xs, [3.0, 3.0, 2.0])
        assert curve.kind == "loglinear" and curve.n == 3
        assert curve.x0 == pytest.approx(float(xs[1]), rel=1e-12)
        assert curve.params["a"] == pytest.approx(8 / 3, rel=1e-12)
        assert curve.params["b"] == pytest.approx(1 / (2 * LN2), rel=1e-12)
        assert curve.rss == pytest.approx(1 / 6, rel=1e-12)


def test_the_log_linear_fit_at_two_compute_values_and_when_the_loss_rises():
    two = fit_curve([1.0, 4.0], [3.0, 2.0])  # two points: the line through them
    assert (two.params["a"], two.params["b"]) == pytest.approx((2.5, 1 / (2 * LN2)))
    assert two.x0 == pytest.approx(2.0) and two.rss == pytest.approx(0.0, abs=1e-20)
    seeds = fit_curve([1.0, 1.0, 4.0, 4.0], [3.1, 2.9, 2.1, 1.9])  # two budgets, two seeds
    assert (seeds.params["a"], seeds.params["b"]) == pytest.approx((2.5, 1 / (2 * LN2)))
    assert seeds.rss == pytest.approx(0.04) and seeds.n == 4
    rising = fit_curve([0.5, 1.0, 2.0], [2.0, 2.5, 3.0])  # slope held at 0: the mean
    assert rising.params == {"a": 2.5, "b": 0.0} and rising.rss == pytest.approx(0.5)
    # float32 losses are averaged in float64
    y32 = np.float32([2.1, 2.6, 3.3])
    mean = float(np.mean(y32.astype(np.float64)))
    assert fit_curve([0.5, 1.0, 2.0], y32).params["a"] == pytest.approx(mean, rel=1e-12)
    assert float(y32.mean()) != pytest.approx(mean, rel=1e-12)  # float32's own mean differs


def test_four_budgets_give_the_power_law_fewer_the_log_linear_line():
    xs = [1.0, 2.0, 4.0, 8.0]
    ys = [2.0 + 1.5 * x**-0.5 for x in xs]
    power = fit_curve(xs, ys)
    assert power.kind == "power" and power.n == 4
    assert power.params["E"] == pytest.approx(2.0, abs=1e-4)
    assert power.params["alpha"] == pytest.approx(0.5, abs=1e-4)
    assert fit_curve(xs, ys, budgets=3).kind == "loglinear"  # seeds that spent other compute


def test_the_power_laws_residual_sum_and_its_bounds():
    """rss is the sum of squared residuals of the curve returned; E stays below the lowest loss
    (a tail that rises again would pull it above), alpha in [1e-4, 10]."""
    xs = [1.0, 2.0, 4.0, 8.0, 16.0]
    ys = [3.0, 2.0, 1.5, 1.6, 1.7]
    curve = fit_curve(xs, ys)
    assert curve.kind == "power" and curve.n == 5
    assert curve.rss == pytest.approx(float(((curve(xs) - np.asarray(ys)) ** 2).sum()), rel=1e-9)
    assert curve.params["E"] < 1.5 and curve.params["E"] == pytest.approx(1.5, rel=1e-5)
    steep = fit_curve([1.0, 2.0, 4.0, 8.0], [10.0 ** (-4 * k) for k in range(4)])  # x^-13.3
    assert steep.params["alpha"] == pytest.approx(10.0)
    rising = fit_curve([1.0, 2.0, 4.0, 8.0], [0.7, 0.8, 0.85, 0.9])  # no decrease to fit
    assert rising.params["alpha"] == pytest.approx(1e-4) and rising.params["E"] < 0.7
    below_one = fit_curve([1.0, 2.0, 4.0, 8.0], [0.9, 0.8, 0.75, 0.72])  # bits per byte < 1
    assert 0.0 <= below_one.params["E"] < 0.72
    assert below_one(np.asarray([1.0, 8.0])) == pytest.approx([0.9, 0.72], abs=0.01)


# ------------------------------------------------------------------------------- the reads (0.01 s)


def test_non_increasing_pools_adjacent_violators_by_their_weights():
    assert non_increasing([1.0, 2.0]) == [1.5, 1.5]
    assert non_increasing([1.0, 2.0, 3.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert non_increasing([2.0, 1.0, 4.0]) == pytest.approx([7 / 3] * 3)  # a pooled pair, then 2
    assert non_increasing([3.0, 2.0, 2.0, 1.0]) == [3.0, 2.0, 2.0, 1.0]


def test_a_target_exactly_at_a_measured_point_reads_that_points_compute():
    xs, ys = [1.0, 2.0, 4.0, 8.0], [4.0, 3.0, 3.2, 2.0]
    assert read_compute(xs, ys, 4.0) == pytest.approx(1.0)  # the first point: inside
    assert read_compute(xs, ys, 4.0 + 1e-9) == 0.0  # above it: already reached
    assert read_compute(xs, ys, 2.0) == pytest.approx(8.0)  # the last point: inside
    assert read_compute(xs, ys, 2.0 - 1e-9) == math.inf
    assert read_compute([10**20, 2 * 10**20], [3.0, 2.0], 2.5) == pytest.approx(2**0.5 * 1e20)
    # a seed whose loss rose: pooled flat at 2.5, reached at its first point
    assert read_compute([1.0, 2.0], [2.0, 3.0], 2.5) == 1.0


# ------------------------------------------------------------------------------------ rows (0.01 s)


def test_each_kind_of_row_field_by_field():
    common = {"budget": "1e9", "method_x": 2.0, "target": 3.1, "bound_high": 4.0, "bound_low": 0.5}
    nan = math.nan

    def row(reads):
        return _row("1e9", 2.0, 3.1, reads, 4.0, 0.5)

    none = row(())
    same(none, **common, reads=(), estimate=nan, low=nan, high=nan, verdict=CANNOT,
         note="no seed pair has points to read")  # fmt: skip
    assert format_multiplier(none) == "–"
    above = row((math.inf, math.inf))
    same(above, **common, reads=(math.inf, math.inf), estimate=nan, low=nan, high=nan,
         verdict=OUTSIDE,
         note="2 of 2 seed(s) need more than the baseline's largest budget")  # fmt: skip
    assert format_multiplier(above) == "> 4× (outside the measured range)"
    below = row((0.0, 0.0, 2.0))
    same(below, **common, reads=(0.0, 0.0, 2.0), estimate=nan, low=nan, high=nan,
         verdict=OUTSIDE, note="2 of 3 already reached by its smallest budget")  # fmt: skip
    assert format_multiplier(below) == "< 0.5× (outside the measured range)"
    both = row((math.inf, 0.0, 2.0))
    same(both, **common, reads=(math.inf, 0.0, 2.0), estimate=nan, low=nan, high=nan,
         verdict=OUTSIDE, note="1 of 3 seed(s) need more than the baseline's largest budget; "
         "1 of 3 already reached by its smallest budget")  # fmt: skip
    assert format_multiplier(both) == "outside the measured range on both sides"
    one = row((2.0,))
    same(one, **common, reads=(2.0,), estimate=2.0, low=nan, high=nan, verdict=CANNOT,
         note="fewer than 2 seed pairs: no interval")  # fmt: skip
    assert format_multiplier(one) == "2×"
    alike = row((2.0, 2.0))
    same(alike, **common, reads=(2.0, 2.0), estimate=2.0, low=nan, high=nan, verdict=CANNOT,
         note="the seeds' multipliers do not vary: no interval")  # fmt: skip
    # two seeds: logs ln 2 and ln 8, mean ln 4, sd ln 4/√2: half-width T1·ln 2
    two = row((2.0, 8.0))
    same(two, **common, reads=(2.0, 8.0), estimate=4.0, low=4.0 * 2**-T1, high=4.0 * 2**T1,
         verdict=CANNOT, note="")  # fmt: skip
    assert format_multiplier(two) == f"4× [{4.0 * 2**-T1:.3g}, {4.0 * 2**T1:.3g}]"
    assert row((1.5, 1.6, 1.55, 1.52)).verdict == HOLDS  # an interval of about [1.48, 1.63]
    # a withheld row whose reads are outside still prints its bound, never a number
    withheld = Multiplier("1e9", 2.0, 3.1, (math.inf,), nan, nan, nan, 4.0, 0.5, AT_FLOOR)
    assert format_multiplier(withheld) == "> 4× (outside the measured range)"


def test_an_interval_ending_exactly_at_one_gives_no_verdict():
    """Reads whose 95% interval starts (ends) at exactly 1.0: it does not lie above (below) 1."""
    up = _row("b", 1.0, 2.0, (1.0301276784661029, 1.050937637969769, 1.072167986541312), 4, 0.5)
    assert up.low == 1.0 and up.high > 1.0 and up.verdict == CANNOT
    down = (0.9326896648219115, 0.9515312458804198, 0.9707534521245328)
    down_row = _row("b", 1.0, 2.0, down, 4.0, 0.5)
    assert down_row.high == 1.0 and down_row.low < 1.0 and down_row.verdict == CANNOT


# ---------------------------------------------------------------------------- compare_arms (0.05 s)


def hand_points() -> list[Point]:
    """Compute in seconds, below 1: vanilla at 0.25, 0.5, 1 s; headless at the same budgets.
    Vanilla's losses fall by 1 per doubling, so a headless loss a fraction f of the way from
    one vanilla point to the next reads 2^f times that point's compute."""
    out = []
    vanilla = {0: (3.0, 2.0, 1.0), 1: (3.2, 2.2, 1.2)}
    headless = {0: (2.5, 1.5, 0.9), 1: (2.45, 1.45, 0.95)}
    for seed in (0, 1):
        for i, (budget, x) in enumerate((("a", 0.25), ("b", 0.5), ("c", 1.0))):
            out.append(Point("vanilla", seed, budget, x, vanilla[seed][i]))
            out.append(Point("headless", seed, budget, x, headless[seed][i]))
    return out


def test_the_multiplier_rows_read_by_hand():
    """At a: seed 0's 2.5 is half way from 3.0 to 2.0 (read 2^0.5), seed 1's 2.45 three
    quarters of the way from 3.2 to 2.2 (2^0.75): estimate 2^0.625; the same at b; at c both
    seeds are below vanilla's last points: outside, above."""
    pts = hand_points()
    c = compare_arms(pts)
    assert [r.budget for r in c.rows] == ["a", "b", "c"]
    assert c.seeds == {"headless": 2, "vanilla": 2} and c.pairs == 2
    assert c.points == pts and c.floor is None
    half = T1 * 0.25 * LN2 / 2  # t · sd / √2, sd = 0.25·ln 2/√2
    for row, x, target in zip(c.rows[:2], (0.25, 0.5), (2.475, 1.475), strict=True):
        same(row, budget=row.budget, method_x=x, target=target, reads=(2**0.5, 2**0.75),
             estimate=2**0.625, low=math.exp(0.625 * LN2 - half),
             high=math.exp(0.625 * LN2 + half), bound_high=1.0 / x, bound_low=0.25 / x,
             verdict=CANNOT, note="")  # fmt: skip
    same(c.rows[2], budget="c", method_x=1.0, target=0.925, reads=(math.inf, math.inf),
         estimate=math.nan, low=math.nan, high=math.nan, bound_high=1.0, bound_low=0.25,
         verdict=OUTSIDE,
         note="2 of 2 seed(s) need more than the baseline's largest budget")  # fmt: skip


def test_the_floor_names_every_arm_that_does_not_beat_it():
    """Floor 2.6: vanilla's points at a (3.0, 3.2) are above it, and so is the top of
    headless's interval there (2.475 + T1·0.035/√2 ≈ 2.79): both named at a; at b only
    vanilla (its curve is read whole); c stays outside the measured range."""
    pts = hand_points()
    c = compare_arms(pts, floor=2.6)
    assert c.floor == 2.6 and c.points == pts
    why = " does not beat the floor 2.6000 (the unigram model of the training tokens)"
    assert [(r.verdict, r.note) for r in c.rows[:2]] == [
        (AT_FLOOR, "headless and vanilla" + why), (AT_FLOOR, "vanilla" + why)
    ]  # fmt: skip
    assert c.rows[2].verdict == OUTSIDE


def test_two_budgets_missing_points_and_unequal_seeds():
    """Two budgets per arm are enough; a headless seed without a point at a budget, or a
    vanilla seed with a single budget, gives no read; a third headless seed has no partner."""
    pts = [p for p in hand_points() if p.budget != "c"]
    assert [len(r.reads) for r in compare_arms(pts).rows] == [2, 2]
    gappy = [
        p for p in hand_points() if not (p.arm == "headless" and p.seed == 1 and p.budget == "b")
    ]
    rows = compare_arms(gappy).rows
    assert rows[0].reads == pytest.approx((2**0.5, 2**0.75)) and rows[1].reads == (2**0.5,)
    assert rows[1].note == "fewer than 2 seed pairs: no interval"
    single = [p for p in pts if not (p.arm == "vanilla" and p.seed == 1 and p.budget == "b")]
    assert [len(r.reads) for r in compare_arms(single).rows] == [1, 1]
    extra = [*pts, Point("headless", 2, "a", 0.25, 2.4), Point("headless", 2, "b", 0.5, 1.4)]
    c = compare_arms(extra)
    assert c.seeds == {"headless": 3, "vanilla": 2} and c.pairs == 2
    assert c.rows[0].target == pytest.approx((2.5 + 2.45 + 2.4) / 3)
    lonely = [*pts, Point("headless", 2, "z", 4.0, 0.5)]  # seed 2 alone at z: no pair reads it
    assert compare_arms(lonely).rows[-1].note == "no seed pair has points to read"


def test_a_point_without_a_positive_compute_is_refused_by_name():
    """A nan compute (an unmeasured time) would read as nan, shown as outside the range."""
    for x in (math.nan, 0.0, math.inf):
        pts = [p if (p.arm, p.seed, p.budget) != ("vanilla", 1, "b") else Point(
            "vanilla", 1, "b", x, p.loss) for p in hand_points()]  # fmt: skip
        with pytest.raises(ValueError, match=rf"^arm 'vanilla' seed 1 at budget b has compute "
                           rf"{x}, not a positive number$"):  # fmt: skip
            compare_arms(pts)


def test_beats_floor_at_its_edges():
    assert beats_floor([2.0], 2.1)  # one seed: its loss itself
    assert not beats_floor([2.1], 2.1)  # at the floor is not below it
    assert not beats_floor([2.0, 2.08], 2.1)  # mean 2.04, but its interval reaches far above


# -------------------------------------------------------------------------------- fit_arms (0.05 s)


def test_each_arm_is_fitted_on_its_own_finite_points_and_one_that_cannot_be_is_left_out():
    """headless: 3 budgets, 2 seeds spending slightly different compute, on the line
    L = 3 - 0.5·ln(x/1e9): log-linear (3 budgets, not 6 compute values); vanilla: 4 budgets
    on a power law; a non-finite loss is left out; an arm at one budget gets no curve."""
    pts = []
    for seed, spend in ((0, 1.0), (1, 1.02)):
        for budget, x in (("1G", 1e9), ("2G", 2e9), ("4G", 4e9)):
            pts.append(
                Point("headless", seed, budget, x * spend, 3 - 0.5 * math.log(x * spend / 1e9))
            )
    pts.append(Point("headless", 2, "4G", 4e9, math.nan))
    for budget, x in (("1G", 1e9), ("2G", 2e9), ("4G", 4e9), ("8G", 8e9)):
        pts.append(Point("vanilla", 0, budget, x, 2.0 + 1.5 * (x / 1e9) ** -0.5))
    pts.append(Point("cwt", 0, "1G", 1e9, 3.0))
    curves = fit_arms(pts)
    assert list(curves) == ["headless", "vanilla"]
    head = curves["headless"]
    assert head.kind == "loglinear" and head.n == 6 and head.params["b"] == pytest.approx(0.5)
    assert float(head(1e9)) == pytest.approx(3.0)
    van = curves["vanilla"]
    assert van.kind == "power" and van.n == 4
    assert van.params["E"] == pytest.approx(2.0, abs=1e-4)


# ------------------------------------------------------------------------------- sentences (0.01 s)


def m(budget, verdict, estimate=math.nan, low=math.nan, high=math.nan, note="", reads=(2.0,)):
    return Multiplier(budget, 1.0, 3.0, reads, estimate, low, high, 16.0, 0.5, verdict, note)


def test_the_closing_sentence_word_for_word():
    none = Comparison("headless", "vanilla", [
        m("1e9", CANNOT, 2.0, note="fewer than 2 seed pairs: no interval"),
        m("2e9", OUTSIDE, reads=(math.inf,),
          note="1 of 1 seed(s) need more than the baseline's largest budget"),
        m("4e9", CANNOT, 1.1, 0.9, 1.3),
    ], {"headless": 1, "vanilla": 1}, 1)  # fmt: skip
    assert closing_sentence(none, "FLOPs", "this scale") == (
        "Against FLOPs, no budget gives a verdict at this scale (1 seed pair): at 1e9 cannot be "
        "told apart (fewer than 2 seed pairs: no interval); at 2e9 outside the measured range "
        "(1 of 1 seed(s) need more than the baseline's largest budget); at 4e9 cannot be told "
        "apart."
    )
    mixed = Comparison("headless", "vanilla", [
        m("1e9", HOLDS, 4.0, 2.0, 8.0), m("2e9", HOLDS, 3.0, 1.5, 6.0),
        m("4e9", REVERSED, 0.5, 0.25, 0.9), m("8e9", AT_FLOOR, 1.2, 0.8, 1.6, note="why"),
    ], {"headless": 3, "vanilla": 3}, 3)  # fmt: skip
    assert closing_sentence(mixed, "training seconds", "here") == (
        "Against training seconds: headless reaches its loss for **less** training seconds: "
        "vanilla needs, in multiples of headless's training seconds, 4× [2, 8] at 1e9; "
        "3× [1.5, 6] at 2e9 (95% t intervals over 3 seed pairs); vanilla reaches headless's "
        "loss for **less** training seconds: 0.5× [0.25, 0.9] at 4e9; at 8e9 no verdict (why)."
    )
    mixed.rows = mixed.rows[:3]  # nothing else to say: no trailing clause
    mixed.pairs = 1
    assert closing_sentence(mixed, "FLOPs", "here").endswith(
        "(95% t intervals over 1 seed pair); vanilla reaches headless's loss for **less** FLOPs: "
        "0.5× [0.25, 0.9] at 4e9."
    )
