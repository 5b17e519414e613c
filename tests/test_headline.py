"""The headline comparison (sweeps/headline.py, hlm_ray.tune.families and .headline): its
statistics against scipy on made-up scores, the baselines, the report, the equal-budget
arithmetic, then the tiny sweep end to end."""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps
from sweep_common import check_trials_carry_their_values, use_mlflow_server

from hlm_ray.classify.baselines import chance_baseline, majority_baseline, majority_scores
from hlm_ray.classify.inputs import limit_examples
from hlm_ray.classify.tasks import load_task
from hlm_ray.downstream import share_steps
from hlm_ray.errors import HLMError
from hlm_ray.tune import report, stats
from hlm_ray.tune.families import check_families
from hlm_ray.tune.spec import get_sweep

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("sweep_headline", ROOT / "sweeps/headline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HEADLINE = _script()
A = [0.81, 0.84, 0.80, 0.83]
B = [0.70, 0.78, 0.74]


# ------------------------------------------------------------------------------ statistics


def test_describe_is_the_t_interval_of_the_mean():
    s = stats.describe(A)
    low, high = sps.t.interval(0.95, len(A) - 1, loc=np.mean(A), scale=sps.sem(A))
    assert (s.n, s.mean, s.sd) == (4, pytest.approx(np.mean(A)), pytest.approx(np.std(A, ddof=1)))
    assert (s.low, s.high) == (pytest.approx(low), pytest.approx(high))
    one = stats.describe([0.5, math.nan])  # NaN scores (a failed metric) are left out
    assert one.n == 1 and one.mean == 0.5 and math.isnan(one.sd) and math.isnan(one.low)


def test_welch_and_paired_intervals_match_scipy():
    d = stats.difference(A, B)
    ci = sps.ttest_ind(A, B, equal_var=False).confidence_interval(0.95)
    assert d.method == "welch" and d.estimate == pytest.approx(np.mean(A) - np.mean(B))
    assert (d.low, d.high) == (pytest.approx(ci.low), pytest.approx(ci.high))
    b4 = [0.79, 0.80, 0.78, 0.82]
    p = stats.difference(A, b4, paired_by_seed=True)
    ci = sps.ttest_rel(A, b4).confidence_interval(0.95)
    assert p.method == "paired" and (p.low, p.high) == (
        pytest.approx(ci.low),
        pytest.approx(ci.high),
    )
    with pytest.raises(ValueError, match="equal lengths"):
        stats.paired(A, B)
    single = stats.difference([0.9], [0.1])  # one seed: an estimate, no interval
    assert single.estimate == pytest.approx(0.8) and math.isnan(single.low)


def test_verdicts_follow_the_papers_direction():
    up, down = [0.9, 0.91, 0.92], [0.5, 0.51, 0.52]
    assert stats.verdict(stats.difference(up, down), higher_is_better=True) == stats.HOLDS
    assert stats.verdict(stats.difference(down, up), higher_is_better=True) == stats.REVERSED
    # Perplexity: lower is better, so headless lower holds.
    assert stats.verdict(stats.difference(down, up), higher_is_better=False) == stats.HOLDS
    assert stats.verdict(stats.difference(A, A[::-1]), higher_is_better=True) == stats.NOISE
    assert stats.verdict(stats.difference([0.9], [0.1]), higher_is_better=True) == stats.NOISE


def test_zero_spread_or_too_few_seeds_cannot_be_told_apart_and_says_why():
    # Two classifiers per arm collapsed to their majority class: identical scores within each
    # arm are no evidence of a difference, whichever way the means lie.
    for a, b in [([0.4862, 0.4862], [0.5138, 0.5138]), ([0.6, 0.6, 0.6], [0.5, 0.5, 0.5])]:
        for paired in (False, True):
            d = stats.difference(a, b, paired_by_seed=paired)
            assert stats.verdict(d, higher_is_better=True) == stats.NOISE, (a, b, paired)
            assert stats.verdict(d, higher_is_better=False) == stats.NOISE, (a, b, paired)
            assert "zero spread" in d.reason and math.isnan(d.low), (a, b, paired)
    few = stats.difference([0.9], [0.1, 0.2, 0.15])  # 1 + 3 seeds
    assert stats.verdict(few, higher_is_better=True) == stats.NOISE
    assert "needs 2 or more per arm" in few.reason
    assert stats.difference(A, B).reason == ""  # an interval: no reason needed
    trials = [report.Trial("enc", arm, s, {"acc": x}) for arm, x in [("headless", 0.4862),
              ("vanilla", 0.5138)] for s in (0, 1)]  # fmt: skip
    (row,) = report.compare(trials, [report.Score("acc", "SST-2 acc", "enc", headline=True)])
    assert row.verdict == stats.NOISE
    text = report.markdown([row], title="t", scale="x")
    assert "**cannot be told apart from noise** at x (zero spread" in text
    assert "| cannot be told apart from noise (zero spread" in text  # the table says why too


def test_near_baseline_uses_the_interval_or_the_single_score():
    assert stats.near_baseline(stats.describe([0.5862, 0.5862]), 0.5862)  # collapsed classifier
    assert stats.near_baseline(stats.describe([0.55, 0.62, 0.58]), 0.5862)
    assert not stats.near_baseline(stats.describe([0.80, 0.81, 0.82]), 0.5862)
    assert stats.near_baseline(stats.describe([0.5862]), 0.5862)
    assert not stats.near_baseline(stats.describe([0.7]), 0.5862)
    assert stats.near_baseline(stats.describe([0.48]), 0.5312)  # below the majority class
    assert stats.near_baseline(stats.describe([400.0]), 300.0, higher_is_better=False)
    assert not stats.near_baseline(stats.describe([0.7, 0.8]), None)


def _fields(x) -> tuple:
    """A Summary's or Difference's fields, NaN as the string "nan" (NaN != NaN)."""
    return tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in vars(x).values())


def test_every_field_of_a_summary_and_a_difference_at_their_edges():
    """No score, one score, one seed per arm, one gap, zero spread: each field of the result
    (NaN, not None, where there is no number), its method and reason word for word; the
    confidence level reaches the quantile on every path, 95% by default."""
    nan = "nan"
    assert _fields(stats.describe([])) == (0, nan, nan, nan, nan)
    assert _fields(stats.describe([None, math.nan, math.inf])) == (0, nan, nan, nan, nan)
    assert _fields(stats.describe([0.5, None, -math.inf])) == (1, 0.5, nan, nan, nan)
    s90 = stats.describe(A, level=0.9)
    low, high = sps.t.interval(0.9, len(A) - 1, loc=np.mean(A), scale=sps.sem(A))
    assert (s90.low, s90.high) == (pytest.approx(low), pytest.approx(high))
    assert stats.t_quantile(7) == pytest.approx(sps.t.ppf(0.975, 7))
    assert stats.t_quantile(7, 0.9) == pytest.approx(sps.t.ppf(0.95, 7))

    no_score = (nan, nan, nan, nan, "welch", "an arm has no score")
    assert _fields(stats.welch([], B)) == _fields(stats.welch(A, [math.nan])) == no_score
    one_each = _fields(stats.welch([0.9], [0.1]))
    assert one_each == (
        pytest.approx(0.8),
        nan,
        nan,
        nan,
        "welch",
        "one seed per arm gives no interval",
    )
    few = "1 seed(s) in an arm: an interval needs 2 or more per arm"
    assert _fields(stats.welch([0.9], B)) == (
        pytest.approx(0.9 - np.mean(B)),
        nan,
        nan,
        nan,
        "welch",
        few,
    )
    flat = _fields(stats.welch([0.6, 0.6], [0.5, 0.5]))
    assert flat == (pytest.approx(0.1), nan, nan, nan, "welch", stats.ZERO_SPREAD)
    w = stats.welch(A, B)
    va, vb = np.var(A, ddof=1) / len(A), np.var(B, ddof=1) / len(B)
    df = (va + vb) ** 2 / (va**2 / (len(A) - 1) + vb**2 / (len(B) - 1))
    assert isinstance(w.df, float) and w.df == pytest.approx(df) and w.reason == ""
    w90 = stats.difference(A, B, level=0.9)
    ci90 = sps.ttest_ind(A, B, equal_var=False).confidence_interval(0.9)
    assert (w90.low, w90.high) == (pytest.approx(ci90.low), pytest.approx(ci90.high))
    assert _fields(stats.welch(A, B)) == _fields(stats.difference(A, B))  # 95% by default

    b4 = [0.79, 0.80, 0.78, 0.82]
    none = (nan, nan, nan, nan, "paired", "no seed scored in both arms")
    assert _fields(stats.paired([math.nan, 0.5], [0.4, None])) == none
    one_gap = stats.paired([0.9, math.nan, 0.3], [0.5, 0.2, None])
    assert _fields(one_gap) == (
        pytest.approx(0.4),
        nan,
        nan,
        nan,
        "paired",
        "one seed per arm gives no interval",
    )
    same_gap = _fields(stats.paired([0.6, 0.7], [0.5, 0.6]))
    assert same_gap == (pytest.approx(0.1), nan, nan, nan, "paired", stats.ZERO_SPREAD_PAIRED)
    p = stats.paired(A, b4)
    assert (p.df, p.reason, p.method) == (3.0, "", "paired")
    assert p.estimate == pytest.approx(np.mean(A) - np.mean(b4))
    assert isinstance(p.df, float)
    p90 = stats.difference(A, b4, paired_by_seed=True, level=0.9)
    ci90 = sps.ttest_rel(A, b4).confidence_interval(0.9)
    assert (p90.low, p90.high) == (pytest.approx(ci90.low), pytest.approx(ci90.high))
    assert _fields(p) == _fields(stats.difference(A, b4, paired_by_seed=True))


def test_verdicts_and_baselines_at_their_boundaries():
    """An interval that touches 0 is noise, not a verdict, either way; so is one with a reason,
    one with a missing end, and a zero-width one. A baseline at an end of the interval, or
    within the tolerance of it, counts as reached; a gain of exactly the tolerance too."""

    def d(low, high, reason=""):
        return stats.Difference((low + high) / 2, low, high, 3.0, "welch", reason)

    def verdicts(diff):
        return (stats.verdict(diff, higher_is_better=True),
                stats.verdict(diff, higher_is_better=False))  # fmt: skip

    holds_up, holds_down = (stats.HOLDS, stats.REVERSED), (stats.REVERSED, stats.HOLDS)
    assert verdicts(d(0.5, 0.8)) == holds_up and verdicts(d(-0.8, -0.5)) == holds_down
    assert verdicts(d(0.0, 0.8)) == verdicts(d(-0.8, 0.0)) == (stats.NOISE, stats.NOISE)
    assert verdicts(d(-0.3, 0.5)) == verdicts(d(-0.5, 0.3)) == (stats.NOISE, stats.NOISE)
    assert verdicts(d(1.5, 1.5)) == (stats.NOISE, stats.NOISE)  # zero width
    assert verdicts(d(0.5, 0.8, reason="x")) == (stats.NOISE, stats.NOISE)
    for low, high in ((math.nan, -0.5), (0.5, math.nan), (math.nan, math.nan), (None, 0.5)):
        diff = stats.Difference(0.0, low, high, 3.0, "welch")
        assert verdicts(diff) == (stats.NOISE, stats.NOISE), (low, high)

    near = stats.near_baseline
    interval = stats.Summary(3, 2.0, 0.5, 1.0, 3.0)
    assert near(interval, 1.0, tolerance=0.0) and near(interval, 0.8, tolerance=0.25)  # low end
    assert not near(interval, 0.7, tolerance=0.25)
    assert near(interval, 3.0, higher_is_better=False, tolerance=0.0)  # at the high end
    assert near(interval, 3.2, higher_is_better=False, tolerance=0.25)
    assert not near(interval, 3.3, higher_is_better=False, tolerance=0.25)
    single = stats.Summary(1, 2.0, math.nan, math.nan, math.nan)  # one seed: no interval
    assert near(single, 1.5, tolerance=0.5) and not near(single, 1.5, tolerance=0.4)
    assert not near(stats.Summary(0, math.nan, math.nan, math.nan, math.nan), 0.5)
    assert not near(stats.Summary(3, 2.0, 0.1, math.nan, 2.1), 1.0)


# ------------------------------------------------------------------------------ baselines


def test_majority_class_scores_are_what_a_collapsed_classifier_gets():
    labels = [1, 1, 0, 1, 0]
    assert majority_scores("glue:sst2", labels) == {"accuracy": pytest.approx(0.6)}
    assert majority_scores("glue:cola", labels) == {"mcc": 0.0, "accuracy": pytest.approx(0.6)}
    assert majority_scores("glue:mrpc", labels)["f1"] == pytest.approx(2 * 3 / (2 * 3 + 2))
    rows = limit_examples(load_task("glue:sst2").eval["eval"], 64)
    share = max(np.bincount([e.label for e in rows])) / len(rows)
    assert majority_baseline("glue:sst2", eval_limit=64) == pytest.approx(share)
    assert majority_baseline("glue:cola") == 0.0
    assert chance_baseline("xnli:en") == pytest.approx(1 / 3)


# ------------------------------------------------------------------------------ the report


def _trials():
    """Made-up scores: encoders clearly apart (headless better), decoders within noise, the
    headless SST-2 stuck at its majority class."""
    out = []
    for seed, (h, v) in enumerate([(0.80, 0.70), (0.82, 0.71), (0.81, 0.69)]):
        out.append(report.Trial("enc", "headless", seed, {"avg": h, "sst2": 0.5862}))
        out.append(report.Trial("enc", "vanilla", seed, {"avg": v, "sst2": 0.75 + seed / 100}))
    for seed, (h, v) in enumerate([(0.10, 0.12), (0.13, 0.09), (0.11, 0.11)]):
        out.append(report.Trial("dec", "headless", seed, {"acc": h, "ppl": 300.0 + seed}))
        out.append(report.Trial("dec", "vanilla", seed, {"acc": v, "ppl": 200.0 + seed}))
    return out


SCORES = [
    report.Score("avg", "GLUE avg", "enc", baseline=0.55, headline=True),
    report.Score("sst2", "SST-2 acc", "enc", baseline=0.5862, baseline_note="majority class"),
    report.Score("acc", "LAMBADA acc", "dec", baseline=0.0, headline=True),
    report.Score("ppl", "LAMBADA ppl", "dec", higher_is_better=False, fmt="{:.4g}"),
]


@pytest.fixture
def saved_figures(monkeypatch) -> list:
    """Every matplotlib figure saved while the test runs, to read back what it shows."""
    from matplotlib.figure import Figure

    saved, savefig = [], Figure.savefig

    def record(fig, *args, **kwargs):
        saved.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return saved


def _error_bars(container) -> list[tuple[float, float]]:
    """(bottom, top) of each vertical error bar of an ErrorbarContainer."""
    _, _, (bars, *_) = container.lines
    return [(float(seg[0][1]), float(seg[1][1])) for seg in bars.get_segments()]


def test_the_report_table_verdicts_and_figure(tmp_path, saved_figures):
    rows = report.compare(_trials(), SCORES)
    verdicts = {r.score.key: r.verdict for r in rows}
    assert verdicts == {
        "avg": stats.HOLDS,
        "sst2": stats.WITHHELD,  # vanilla is better, but headless sits at its majority class
        "acc": stats.NOISE,
        "ppl": stats.REVERSED,  # headless perplexity higher: the other way
    }
    sst2 = rows[1]
    assert sst2.near_chance == {"vanilla": False, "headless": True}
    assert report.arm_cell(sst2, "headless") == "0.5862 ± 0.0000 (≈ chance)"
    assert report.verdict_cell(sst2) == "no verdict (headless does not beat its baseline)"
    text = report.markdown(rows, title="t", scale="the test scale", figure="h.png")
    assert "| enc | GLUE avg ↑ | 0.7000 ± 0.0100 | 0.8100 ± 0.0100 | +0.1100 [" in text
    assert "0.5862 (majority class)" in text and "| none |" in text
    assert "**enc**: headless − vanilla on GLUE avg = +0.1100" in text and "**holds**" in text
    assert "**dec**" in text and "cannot be told apart from noise" in text
    png = report.plot_arms(rows, tmp_path / "h.png", title="t")
    assert png.stat().st_size > 1000
    [fig] = saved_figures
    assert fig.get_suptitle() == "t"
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == [
        "enc: GLUE avg ↑", "enc: SST-2 acc ↑", "dec: LAMBADA acc ↑", "dec: LAMBADA ppl ↓"
    ]  # fmt: skip
    for ax, row in zip(axes, rows, strict=True):
        # One bar per arm at the seeds' mean, its error bar ±1 sample sd of the seeds.
        assert [t.get_text() for t in ax.get_xticklabels()] == list(report.ARMS)
        bars = [c for c in ax.containers if type(c).__name__ == "BarContainer"]
        for x, (arm, bar) in enumerate(zip(report.ARMS, bars, strict=True)):
            seeds = row.values[arm]
            [patch] = bar.patches
            assert patch.get_x() + patch.get_width() / 2 == pytest.approx(x)
            assert patch.get_height() == pytest.approx(np.mean(seeds))
            [(low, high)] = _error_bars(bar.errorbar)
            assert (low, high) == pytest.approx(
                (np.mean(seeds) - np.std(seeds, ddof=1), np.mean(seeds) + np.std(seeds, ddof=1))
            )
    one_seed = [t for t in _trials() if t.seed == 0]
    (row,) = report.compare(one_seed, SCORES[:1])
    assert row.verdict == stats.NOISE and "one seed per arm" in report.verdict_sentence(row, "x")


def test_no_verdict_is_printed_for_an_arm_that_does_not_beat_its_floor(tmp_path, saved_figures):
    """Bits per byte with its floor measured per trial (the unigram model of the training
    tokens): vanilla clearly better, but headless above the floor, so the row is not read; with
    both arms below their floor the same gap holds; the floor is drawn in the arms' figure."""

    def trials(headless):
        out = []
        for seed in range(3):
            for arm, bpb in (("vanilla", 3.00 + seed / 100), ("headless", headless + seed / 100)):
                out.append(report.Trial("dec", arm, seed, {"bpb": bpb, "floor": 3.24}))
        return out

    score = report.Score(
        "bpb", "bits per byte", "dec", higher_is_better=False, floor_key="floor", headline=True
    )
    (row,) = report.compare(trials(3.30), [score])
    assert row.baseline == pytest.approx(3.24) and row.near_chance["headless"]
    assert row.verdict == stats.WITHHELD and row.diff.high < 0 or row.diff.low > 0
    text = report.markdown([row], title="t", scale="here")
    assert (
        "| 3.2400 (unigram of the training tokens) | no verdict (headless does not beat its "
        in text
    )
    table = text[: text.index("Cells:")]  # the legend below names every verdict
    assert "holds" not in table and "reversed" not in table
    assert "3.3100 ± 0.0100 (at floor)" in text and "**no verdict** at here" in text
    (clear,) = report.compare(trials(3.10), [score])
    assert clear.verdict == stats.REVERSED and not any(clear.near_chance.values())
    report.plot_arms([row], tmp_path / "a.png", title="t")
    [ax] = saved_figures[-1].axes
    assert any(line.get_ydata()[0] == pytest.approx(3.24) for line in ax.lines)
    assert ax.get_legend().get_texts()[0].get_text() == "floor (unigram)"
    report.plot_forest([row], tmp_path / "f.png", title="t")
    assert [t.get_text() for t in saved_figures[-1].axes[0].texts] == [
        "no verdict: headless does not beat its floor"
    ]


def test_the_headline_figure_is_a_forest_plot_of_the_differences(tmp_path, saved_figures):
    """One line per family and score: headless − vanilla at the point, its 95% interval as the
    bar, the zero line, the verdict beside it; no interval (one seed) is a hollow point."""
    rows = report.compare(_trials(), SCORES)
    report.plot_forest(rows, tmp_path / "f.png", title="t")
    [fig] = saved_figures
    assert len(fig.axes) == len(rows)
    for ax, row in zip(fig.axes, rows, strict=True):
        [label] = [t.get_text() for t in ax.get_yticklabels()]
        assert label.startswith(f"{row.score.family}: {row.score.label}")
        assert any(list(line.get_xdata()) == [0.0, 0.0] for line in ax.lines)  # the zero line
        [bar] = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
        point, _caps, (segments,) = bar.lines
        assert point.get_xdata()[0] == pytest.approx(row.diff.estimate)
        [[(low, _), (high, _)]] = segments.get_segments()
        assert (low, high) == pytest.approx((row.diff.low, row.diff.high))
        said = [t.get_text() for t in ax.texts]
        assert row.verdict in said or said == [f"no verdict: {row.why}"]
    one_seed = [t for t in _trials() if t.seed == 0]
    report.plot_forest(report.compare(one_seed, SCORES[:1]), tmp_path / "g.png", title="t")
    ax = saved_figures[-1].axes[0]
    assert not ax.containers and [t.get_text() for t in ax.texts] == ["no interval"]


def test_the_forest_plots_axis_labels_do_not_run_together(tmp_path, saved_figures):
    """A LAMBADA accuracy near zero (differences of 1e-4) beside a long family label: its
    axis's tick labels (-0.00015, ...) ran into each other; they stand apart now."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    trials = []
    for seed, (h, v) in enumerate([(0.00013, 0.00021), (0.00006, 0.00017), (0.00019, 0.00009)]):
        trials.append(report.Trial("gpt2-cpu-seconds", "headless", seed, {"acc": h}))
        trials.append(report.Trial("gpt2-cpu-seconds", "vanilla", seed, {"acc": v}))
    score = report.Score("acc", "LAMBADA accuracy (last word)", "gpt2-cpu-seconds", baseline=0.0)
    report.plot_forest(report.compare(trials, [score]), tmp_path / "f.png", title="t")
    [fig] = saved_figures
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    [ax] = fig.axes
    low, high = ax.get_xlim()
    labels = [
        t for t in ax.get_xticklabels() if t.get_text() and low <= t.get_position()[0] <= high
    ]
    boxes = [t.get_window_extent(canvas.get_renderer()) for t in labels]
    assert len(boxes) >= 3
    apart = all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:], strict=False))
    assert apart, [t.get_text() for t in labels]


# ------------------------------------------------------------------------------ the sweep


def test_equal_budget_arms_and_the_generator_share():
    assert share_steps(1_228_800, 0.02, 2048) == 12  # floor(24,576 / 2,048)
    assert share_steps(1000, 0.02, 2048) == 1  # at least one step
    with pytest.raises(HLMError, match="clm_share"):
        share_steps(1000, 2.0, 10)
    spec = get_sweep(HEADLINE.PRESETS, "cpu")
    enc = {o: spec.cell_config("bert-cpu", o, 0) for o in ("headless", "vanilla")}
    dec = {o: spec.cell_config("gpt2-cpu", o, 0) for o in ("headless", "vanilla")}
    assert enc["headless"].model == enc["vanilla"].model and enc["headless"].model.arch == "bert"
    assert enc["headless"].budget.tokens == enc["vanilla"].budget.tokens == 400 * 32 * 64
    assert dec["headless"].model.arch == "gpt2" and dec["headless"].optim.max_steps == 1600
    # The vanilla decoder pretrains on the headless arm's fine-tuning tokens too: the cpu
    # generator's 40 steps of 4 × 64 tokens are 20 steps of 8 × 64.
    assert dec["vanilla"].optim.max_steps == 1600 + 20
    assert dec["vanilla"].budget.tokens == dec["headless"].budget.tokens + 20 * 8 * 64
    with pytest.raises(HLMError, match="unknown family"):
        check_families(get_sweep(HEADLINE.PRESETS, "tiny", ["sweep.values=[nope]"]))


def test_every_headline_preset_resolves_in_the_tune_space():
    from ray.tune.search.variant_generator import generate_variants

    from hlm_ray.config import Config

    for preset in HEADLINE.PRESETS:
        spec = get_sweep(HEADLINE.PRESETS, preset)
        resolved = [Config.from_dict(v["config"]) for _, v in generate_variants(spec.param_space())]
        assert len(resolved) == len(spec.cells())
        for cell in spec.cells():
            assert resolved.count(spec.cell_config(**cell)) == 1, (preset, cell)


def test_the_paper_preset_dry_run_prints_its_cost(capsys):
    # The multilingual family's hub tokenizer is not here (its hub look-up takes minutes).
    argv = ["--preset", "paper", "--dry-run", "--set", "sweep.values=[bert-base,pythia-70m]"]
    assert HEADLINE.main(argv) == 0
    out = capsys.readouterr().out
    assert "pythia-70m" in out and "GPU-hours" in out


@pytest.mark.ray
@pytest.mark.slow
def test_headline_tiny_end_to_end(ray_cluster, mlflow_server, mlflow_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    use_mlflow_server(mlflow_server, monkeypatch.setenv)  # not a server of its own
    assert HEADLINE.main(["--preset", "tiny", "--num-seeds", "1", "--name", "hl"]) == 0
    folder = tmp_path / "runs" / "sweeps" / "hl"
    text = (folder / "report.md").read_text()
    for needle in ("GLUE avg (RTE excluded)", "SST-2 acc", "RTE acc", "LAMBADA acc", "bits per"):
        assert needle in text
    # One seed per arm has no interval: no row may read a verdict (each is withheld at the
    # baseline or floor, or cannot be told apart from noise).
    rows = [line for line in text.splitlines() if line.startswith("| tiny-")]
    assert len(rows) >= 6  # and the headless decoder's readouts where it has them
    for row in rows:
        verdict = row.rstrip(" |").rsplit("|", 1)[-1]
        assert "no verdict" in verdict or "cannot be told apart from noise" in verdict, row
    assert (folder / "headline.png").stat().st_size > 1000
    trials = report.read_trials(folder, "family")
    assert len(trials) == 4
    spec = get_sweep(HEADLINE.PRESETS, "tiny", ["sweep.num_seeds=1"])
    check_trials_carry_their_values(folder, spec, mlflow_store, "hl")  # family, arm, budget
    dec = {t.objective: t.scores for t in trials if t.family == "tiny-gpt2"}
    assert dec["headless"]["finetune/steps"] == 1 and "finetune/tokens" in dec["headless"]
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_store)
    exp = client.get_experiment_by_name("hlm_ray-sweeps")
    (parent,) = client.search_runs(
        [exp.experiment_id], "tags.sweep = 'hl' and tags.sweep_role = 'parent'"
    )
    assert parent.info.status == "FINISHED"
    note = parent.data.tags["mlflow.note.content"]
    assert note.startswith(text + "\n\n---\n\n") and "|" in note[len(text) :]  # report, then table
    assert {"report.md", "headline.png"} <= {
        a.path for a in client.list_artifacts(parent.info.run_id)
    }


def test_sweep_figures_carry_a_title_and_error_bars_across_seeds(tmp_path, saved_figures):
    from hlm_ray.tune.axis import Axis, Figure
    from hlm_ray.tune.summary import _sd, write_summary

    axis = Axis("toy", "optim.lr", "learning rate", ("lr", "lr"), short="lr",
                figures=(Figure("toy.png", "downstream/score", "score"),))  # fmt: skip
    rows = [
        {"status": "FINISHED", "objective": o, "value": v, "seed": s, "run": "r", "trial_id": "t",
         "downstream/score": 0.5 + v / 100 + s / 50 + (o == "vanilla") * s / 25}
        for o in ("headless", "vanilla") for v in (1, 2) for s in (0, 1)
    ]  # fmt: skip
    paths = write_summary(rows, tmp_path / "toy-tiny", axis=axis)
    assert paths[-1].name == "toy.png" and paths[-1].stat().st_size > 1000
    assert _sd([0.5, 0.52]) == pytest.approx(np.std([0.5, 0.52], ddof=1)) and _sd([1.0]) == 0.0
    [fig] = saved_figures
    [ax] = fig.axes
    assert ax.get_title() == "score vs learning rate\ntoy-tiny, 2 seeds per point"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("learning rate", "score")
    bars = {c.get_label(): c for c in ax.containers}
    assert sorted(bars) == ["headless", "vanilla"]
    for objective, container in bars.items():
        seeds = {
            v: [r["downstream/score"] for r in rows if r["objective"] == objective and r["value"] == v]
            for v in (1, 2)
        }  # fmt: skip
        line = container.lines[0]  # the means, joined
        assert list(line.get_xdata()) == [1, 2]
        assert list(line.get_ydata()) == pytest.approx([np.mean(seeds[v]) for v in (1, 2)])
        np.testing.assert_allclose(_error_bars(container), [
            (np.mean(y) - np.std(y, ddof=1), np.mean(y) + np.std(y, ddof=1)) for y in seeds.values()
        ])  # fmt: skip
