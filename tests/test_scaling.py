"""The compute sweep (`sweeps/scaling.py`): the fit and the multiplier against known curves, the
per-arm learning rates as plain functions, the dry run, then the tiny preset end to end."""

import json
import math

import numpy as np
import pytest
import yaml
from sweep_common import ROOT, load_script, summary_rows, sweep_runs, use_mlflow_server

from hlm_ray.errors import HLMError
from hlm_ray.tune import scaling, scaling_fit
from hlm_ray.tune.scaling_fit import (
    CANNOT,
    OUTSIDE,
    Point,
    beats_floor,
    compare_arms,
    fit_curve,
    format_multiplier,
)
from hlm_ray.tune.scaling_report import read_points
from hlm_ray.tune.spec import get_sweep
from hlm_ray.tune.stats import HOLDS, REVERSED

SCALING = load_script(ROOT / "sweeps" / "scaling.py")
BUDGETS = [2e11 * 2**i for i in range(5)]


def power_law(c, multiplier=1.0, E=2.0, A=1.5, alpha=0.4):
    """Bits per byte after `c` FLOPs for an arm that gets `multiplier` times the value of each
    FLOP: its curve is the baseline's shifted left by that factor."""
    return E + A * (multiplier * c / 1e12) ** -alpha


def points(multiplier, *, seeds=3, noise=0.01, rng_seed=0, budgets=BUDGETS):
    rng = np.random.default_rng(rng_seed)
    out = []
    for seed in range(seeds):
        for c in budgets:
            for arm, m in (("vanilla", 1.0), ("headless", multiplier)):
                out.append(Point(arm, seed, f"{c:.2g}", c, power_law(c, m) + rng.normal(0, noise)))
    return out


# ------------------------------------------------------------------------------ the fit


def test_the_fit_recovers_a_saturating_power_law():
    xs = np.geomspace(1e11, 1e13, 6)
    curve = fit_curve(xs, power_law(xs))
    assert curve.kind == "power"
    e, a, alpha = (curve.params[k] for k in ("E", "A", "alpha"))
    assert e == pytest.approx(2.0, abs=1e-3) and alpha == pytest.approx(0.4, abs=1e-3)
    assert a * (1e12 / curve.x0) ** alpha == pytest.approx(1.5, rel=1e-3)  # the same curve
    assert curve.inverse(float(curve(3e12))) == pytest.approx(3e12, rel=1e-6)
    assert curve.inverse(1.0) == math.inf  # below E: never reached


def test_too_few_budgets_fall_back_to_a_log_linear_fit_and_say_so():
    xs = np.asarray([1e11, 2e11, 4e11] * 2)
    curve = fit_curve(xs, power_law(xs))
    assert curve.kind == "loglinear" and "(log-linear)" in curve.describe()
    assert curve.params["b"] > 0 and curve.inverse(float(curve(2e11))) == pytest.approx(2e11)
    with pytest.raises(ValueError, match="two or more"):
        fit_curve([1e11, 1e11], [3.0, 3.1])


# ------------------------------------------------------------------------------ the multiplier


def test_a_known_multiplier_is_recovered_within_its_interval():
    """Headless gets 4× the value of each FLOP: where the vanilla arm's budgets reach its loss
    (its two smallest budgets: 4× of them stays within vanilla's 16× span), the multiplier reads
    4 inside its 95% interval and holds; beyond, the row says it is outside the measured range,
    never an extrapolated number."""
    c = compare_arms(points(4.0))
    readable = [r for r in c.rows if math.isfinite(r.estimate)]
    assert [r.budget for r in readable] == ["2e+11", "4e+11"]
    for row in readable:
        assert row.low <= 4.0 <= row.high and row.estimate == pytest.approx(4.0, rel=0.1)
        assert row.verdict == HOLDS and len(row.reads) == 3
        assert format_multiplier(row).startswith(f"{row.estimate:.3g}× [")
    for row in c.rows[2:]:
        assert row.verdict == OUTSIDE and not math.isfinite(row.low)
        assert format_multiplier(row) == f"> {row.bound_high:.3g}× (outside the measured range)"
    assert c.seeds == {"headless": 3, "vanilla": 3} and c.pairs == 3
    text = scaling_fit.closing_sentence(c, "FLOPs", "this scale")
    assert "headless reaches its loss for **less** FLOPs" in text
    assert "at 1.6e+12 outside the measured range (3 of 3 seed(s) need more" in text


def test_a_pair_with_no_multiplier_reads_cannot_be_told_apart():
    c = compare_arms(points(1.0))
    inside = [r for r in c.rows if r.verdict != OUTSIDE]
    assert inside and all(r.verdict == CANNOT and r.low <= 1.0 <= r.high for r in inside)
    text = scaling_fit.closing_sentence(c, "FLOPs", "this scale")
    assert "no budget gives a verdict" in text and "cannot be told apart" in text


def test_a_multiplier_below_one_reads_reversed():
    c = compare_arms(points(0.25))
    readable = [r for r in c.rows if math.isfinite(r.estimate)]
    assert readable and all(r.verdict == REVERSED for r in readable)
    assert all(r.estimate == pytest.approx(0.25, rel=0.1) for r in readable)
    assert c.rows[0].verdict == OUTSIDE and "already reached by its smallest" in c.rows[0].note
    text = scaling_fit.closing_sentence(c, "FLOPs", "here")
    assert "vanilla reaches headless's loss for **less** FLOPs" in text


def test_one_seed_or_seeds_that_do_not_vary_give_no_interval():
    one = compare_arms(points(4.0, seeds=1))
    assert all(r.verdict in (CANNOT, OUTSIDE) for r in one.rows)
    assert one.rows[0].note == "fewer than 2 seed pairs: no interval"
    assert "[" not in format_multiplier(one.rows[0])  # no interval printed
    same = compare_arms(points(4.0, noise=0.0))  # three identical seeds: no spread at all
    assert same.rows[0].verdict == CANNOT and "do not vary" in same.rows[0].note


def test_the_reads_join_measured_points_and_never_extrapolate():
    xs, ys = [1.0, 2.0, 4.0, 8.0], [4.0, 3.0, 3.2, 2.0]  # noise: 2 -> 4 goes up
    assert scaling_fit.non_increasing(ys) == [4.0, 3.1, 3.1, 2.0]
    assert scaling_fit.read_compute(xs, ys, 3.5) == pytest.approx(2 ** (0.5 / 0.9))  # in ln x
    assert scaling_fit.read_compute(xs, ys, 3.1) == pytest.approx(2.0)  # the first to reach it
    assert scaling_fit.read_compute(xs, ys, 1.9) == math.inf  # below its last point
    assert scaling_fit.read_compute(xs, ys, 4.5) == 0.0  # above its first


def test_a_verdict_is_withheld_where_an_arm_does_not_beat_its_floor():
    """The same clear 4× as above, with the floor between the arms' losses: the rows where the
    vanilla arm's points are not below the floor give no verdict, and say why."""
    pts = points(4.0)
    floor = power_law(BUDGETS[1])  # vanilla's first budget is above it, the rest below
    c = compare_arms(pts, floor=floor)
    for row in c.rows:
        assert row.verdict in (scaling_fit.AT_FLOOR, OUTSIDE), row
    withheld = [r for r in c.rows if r.verdict == scaling_fit.AT_FLOOR]
    assert withheld and all("vanilla does not beat the floor" in r.note for r in withheld)
    assert compare_arms(pts, floor=10.0).rows[0].verdict == HOLDS  # both far below it
    assert scaling_fit.beats_floor([2.0, 2.01, 1.99], 2.1)
    assert not scaling_fit.beats_floor([2.0, 2.08, 2.05], 2.1)  # its interval reaches 2.1


def test_a_trials_compute_counts_the_headless_generator_fine_tune():
    """Pretraining at the FLOPs per step the run measured, plus the generator fine-tune's
    tokens at the vanilla arm's FLOPs per token (a new head of the same vocabulary); seconds:
    the budget's training seconds (across resumes), plus the fine-tune's."""
    from hlm_ray.budget import flops_per_step, tokens_per_step
    from hlm_ray.config import apply_overrides
    from hlm_ray.tune.scaling_report import compare, trial_compute

    cfg = get_sweep(SCALING.PRESETS, "tiny").cell_config("10G", "headless", 0)
    summary = {"steps": 10, "vocab_size": 1024, "seconds": {"train": 4.0},
               "budget": {"budget/flops_per_step_measured": 2e9, "budget/train_seconds": 5.0}}  # fmt: skip
    vanilla = apply_overrides(cfg, {"objective.name": "vanilla", "optim.embedding_update": "dense"})
    per_token = flops_per_step(vanilla, 1024) / tokens_per_step(cfg)
    flops, seconds = trial_compute(summary, {"finetune/tokens": 2048, "finetune/seconds": 1.5}, cfg)
    assert flops == pytest.approx(10 * 2e9 + 2048 * per_token) and seconds == 6.5
    assert trial_compute(summary, {}, cfg) == (2e10, 5.0)  # a vanilla trial: pretraining alone
    one_budget = [{"arm": a, "seed": 0, "budget": "1G", "flops": 1e9, "seconds": 1.0, "bpb": 3.0}
                  for a in ("headless", "vanilla")]  # fmt: skip
    with pytest.raises(HLMError, match="no report: .* fewer than two budgets"):
        compare(one_budget, "flops")


# ------------------------------------------------------------------------------ learning rates


def test_each_arm_gets_its_own_learning_rate_at_each_budget_in_every_trial_of_the_grid():
    """The rates reach every trial's config, as `cell_config` builds it and as Tune resolves
    the space: a spec that ignored `arm@budget` overrides would give both arms one rate."""
    from ray.tune.search.variant_generator import generate_variants

    from hlm_ray.config import Config

    rates = {"headless": {"10G": 0.01, "20G": 0.008, "40G": 0.006},
             "vanilla": {"10G": 0.003, "20G": 0.002, "40G": 0.001}}  # fmt: skip
    spec = scaling.with_lrs(get_sweep(SCALING.PRESETS, "tiny"), rates)
    resolved = [Config.from_dict(v["config"]) for _, v in generate_variants(spec.param_space())]
    assert len(resolved) == len(spec.cells()) == 6
    for cell in spec.cells():
        cfg = spec.cell_config(**cell)
        assert cfg.optim.lr == rates[cell["objective"]][cell["value"]]
        assert cfg.optim.embedding_update == "dense"  # both arms: the same embedding update
        assert cfg.budget.warmup_share == 0.1 and resolved.count(cfg) == 1
    with pytest.raises(HLMError, match="every arm must set the same keys"):
        get_sweep(SCALING.PRESETS, "tiny", ["sweep.arm_overrides=[headless@10G:optim.lr=1e-3]"])
    with pytest.raises(HLMError, match="objective:key=value"):
        get_sweep(SCALING.PRESETS, "tiny", ["sweep.arm_overrides=[optim.lr=1e-3]"])


def _rows(scores):
    """Search summary rows from {(arm, budget, lr): [score per seed]}."""
    return [
        {"objective": arm, "status": "FINISHED", "value": scaling.search_value(b, lr),
         "downstream/score": score}
        for (arm, b, lr), values in scores.items() for score in values
    ]  # fmt: skip


def test_the_search_is_at_the_smallest_and_largest_budget_with_its_seeds():
    spec = get_sweep(SCALING.PRESETS, "cpu")
    assert scaling.search_lrs(spec) == [0.000316, 0.001, 0.00316]
    search = scaling.search_spec(spec)
    assert search.num_seeds == 2 and search.values == (
        "500G@0.000316", "500G@0.001", "500G@0.00316", "4T@0.000316", "4T@0.001", "4T@0.00316",
    )  # fmt: skip
    cfg = search.cell_config("4T@0.001", "vanilla", 1)
    assert cfg.optim.lr == 0.001 and cfg.budget.flops == 4e12 and cfg.run.seed == 1
    with pytest.raises(HLMError, match="budget@lr"):
        scaling.parse_search_value("4T")


def test_the_choice_the_edges_and_the_extension_past_an_edge():
    """Mean over seeds decides; a best rate at the edge of what an arm tried at a budget is
    searched one grid step past it (that arm, that budget), until `search_extend` steps were
    taken there; a rate inside the tried ones is not."""
    spec = get_sweep(SCALING.PRESETS, "cpu")
    scores = {
        ("headless", "500G", 0.000316): [3.4, 3.5], ("headless", "500G", 0.001): [3.2, 3.3],
        ("headless", "500G", 0.00316): [3.3, 3.4],
        ("vanilla", "500G", 0.000316): [3.6, 3.7], ("vanilla", "500G", 0.001): [3.5, 3.5],
        ("vanilla", "500G", 0.00316): [3.3, 3.45],  # best: the high edge
        ("headless", "4T", 0.001): [3.0], ("vanilla", "4T", 0.001): [3.1],
        ("headless", "4T", 0.00316): [3.1], ("vanilla", "4T", 0.00316): [3.2],
        ("headless", "4T", 0.000316): [3.05], ("vanilla", "4T", 0.000316): [3.15],
    }  # fmt: skip
    rows = [*_rows(scores), {"objective": "vanilla", "status": "FAILED",
                             "value": "4T@0.001", "downstream/score": math.nan}]  # fmt: skip
    found = scaling.search_scores(rows)
    picks = scaling.choose_lrs(found, where=["500G", "4T"])
    assert picks == {"headless": {"500G": 0.001, "4T": 0.001},
                     "vanilla": {"500G": 0.00316, "4T": 0.001}}  # fmt: skip
    assert scaling.edge(found, "vanilla", "500G", 0.00316) == "high"
    assert scaling.edge(found, "headless", "500G", 0.001) is None
    assert scaling.extensions(spec, found, picks) == {"vanilla": ["500G@0.01"]}
    scores[("vanilla", "500G", 0.01)] = [3.2, 3.2]  # better again: one more step
    found = scaling.search_scores(_rows(scores))
    picks = scaling.choose_lrs(found, where=["500G", "4T"])
    assert scaling.extensions(spec, found, picks) == {"vanilla": ["500G@0.0316"]}
    scores[("vanilla", "500G", 0.0316)] = [3.1, 3.1]  # two steps taken: the limit
    found = scaling.search_scores(_rows(scores))
    picks = scaling.choose_lrs(found, where=["500G", "4T"])
    assert picks["vanilla"]["500G"] == 0.0316 and scaling.extensions(spec, found, picks) == {}
    with pytest.raises(HLMError, match="no finished headless trial at 4T"):
        scaling.choose_lrs(scaling.search_scores(rows[:6]), where=["500G", "4T"])


def test_rates_between_the_searched_budgets_are_interpolated_in_log():
    spec = get_sweep(SCALING.PRESETS, "cpu")
    rates = scaling.lr_schedule(spec, {"headless": {"500G": 1e-3, "4T": 1e-3},
                                       "vanilla": {"500G": 2e-3, "4T": 2.5e-4}})  # fmt: skip
    assert rates["headless"] == dict.fromkeys(("500G", "1T", "2T", "4T"), 1e-3)
    assert rates["vanilla"] == {"500G": 2e-3, "1T": 1e-3, "2T": 5e-4, "4T": 2.5e-4}  # halves


def test_the_command_searches_extends_then_runs_each_arm_at_its_rates(monkeypatch, tmp_path):
    """`run_parts` with a stand-in `run_sweep` (no Ray): the search, an extension round for the
    arm whose best rate sat on an edge, then the budgets at the rates found (interpolated
    between), --storage-path to every part, and what the search found on record."""
    import hlm_ray.tune.sweep as sweep

    ran = {}
    score = {
        "headless": lambda lr: abs(math.log10(lr) + 3.0),  # best 1e-3: inside the grid
        "vanilla": lambda lr: abs(math.log10(lr) + 2.0),
    }  # best 1e-2: past the high edge

    def run_sweep(spec, *, name, assumptions=None, storage_path=None, verbose=0):
        ran[name] = (spec, storage_path)
        rows = [
            {"objective": c["objective"], "status": "FINISHED", "value": c["value"],
             "downstream/score": score[c["objective"]](scaling.parse_search_value(c["value"])[1])}
            for c in spec.cells()
        ] if "-lr" in name else []  # fmt: skip
        (tmp_path / name).mkdir()
        return sweep.SweepOutcome(name, tmp_path / name, rows, "", [], None, False, 2.0)

    monkeypatch.setattr(sweep, "run_sweep", run_sweep)
    args = SCALING.SCRIPT.parser().parse_args(["--preset", "cpu", "--storage-path", "s3://b/x"])
    spec = get_sweep(SCALING.PRESETS, "cpu")
    scaling.run_parts(spec, args, "sc")
    # 1e-2 is past the grid (round 1), then the edge of what was tried (round 2 looks past it)
    assert list(ran) == ["sc-lr", "sc-lr+1-vanilla", "sc-lr+2-vanilla", "sc", "sc-prior"]
    assert all(storage == "s3://b/x" for _, storage in ran.values())
    ext = ran["sc-lr+1-vanilla"][0]
    assert ext.objectives == ("vanilla",) and ext.values == ("500G@0.01", "4T@0.01")
    assert ran["sc-lr+2-vanilla"][0].values == ("500G@0.0316", "4T@0.0316")
    tuned = ran["sc"][0]
    for cell in tuned.cells():
        lr = {"headless": 1e-3, "vanilla": 1e-2}[cell["objective"]]
        assert tuned.cell_config(**cell).optim.lr == lr
    record = json.loads((tmp_path / "sc" / scaling.SEARCH_FILE).read_text())
    assert record["picks"]["vanilla"] == {"500G": 0.01, "4T": 0.01}
    assert record["edges"]["vanilla"] == {"500G": None, "4T": None}  # inside what was tried
    assert json.loads((tmp_path / "sc" / scaling.TIMING_FILE).read_text())["search"] == 6.0


def test_the_prior_bias_arm_trains_vanilla_again_at_its_rates_after_the_budgets(
    monkeypatch, tmp_path
):
    """With `sweep.vanilla_prior_arm` (the cpu preset), `<name>-prior` runs the vanilla arm at
    every budget and seed at vanilla's rates, its head's bias started at the log prior."""
    import hlm_ray.tune.sweep as sweep

    ran = {}

    def run_sweep(spec, *, name, assumptions=None, storage_path=None, verbose=0):
        ran[name] = spec
        rows = [{"objective": c["objective"], "status": "FINISHED", "value": c["value"],
                 "downstream/score": 3.0} for c in spec.cells()] if "-lr" in name else []  # fmt: skip
        (tmp_path / name).mkdir()
        return sweep.SweepOutcome(name, tmp_path / name, rows, "", [], None, False, 1.0)

    monkeypatch.setattr(sweep, "run_sweep", run_sweep)
    args = SCALING.SCRIPT.parser().parse_args(["--preset", "cpu"])
    spec = get_sweep(SCALING.PRESETS, "cpu", ["sweep.search_extend=0"])
    scaling.run_parts(spec, args, "sc")
    assert list(ran) == ["sc-lr", "sc", "sc-prior"]
    prior, tuned = ran["sc-prior"], ran["sc"]
    assert prior.objectives == ("vanilla",) and len(prior.cells()) == 12
    for cell in prior.cells():
        cfg = prior.cell_config(**cell)
        assert cfg.init.prior_bias and cfg.objective.name == "vanilla"
        assert cfg.optim.lr == tuned.cell_config(**cell).optim.lr
    assert not tuned.cell_config("500G", "vanilla", 0).init.prior_bias
    assert "prior" in json.loads((tmp_path / "sc" / scaling.TIMING_FILE).read_text())


def test_every_headless_readout_is_compared_with_every_vanilla_arm():
    """The report reads the headless trials three ways (the fine-tuned generator charged its
    fine-tune, the prior and tied readouts not) against vanilla and vanilla+prior."""
    from hlm_ray.tune.scaling_report import arm_points, readout_table

    def trial(arm, seed, budget, x, bpb, **readouts):
        return {"arm": arm, "seed": seed, "budget": budget, "lr": 1e-3, "steps": 1, "tokens": 1,
                "flops": x * 1.05 if arm == "headless" else x, "pretrain_flops": x,
                "seconds": x / 1e9, "pretrain_seconds": x / 1e9, "bpb": bpb,
                "readouts": readouts, "floor": 4.0, "finetune_steps": 40 * (arm == "headless"),
                "finetune_share": 0.05 * (arm == "headless")}  # fmt: skip

    budgets = {"1T": 1e12, "2T": 2e12, "4T": 4e12}
    trials, prior = [], []
    for seed in range(3):
        for b, x in budgets.items():
            v = power_law(x, 1.0) + seed * 0.01
            trials.append(trial("vanilla", seed, b, x, v, **{"bpb/prior": v + 1}))
            h = {"bpb/prior": power_law(x, 3.0) + seed * 0.012, "bpb/tied": v + 0.5 + seed * 0.003}
            trials.append(trial("headless", seed, b, x, power_law(x, 2.0) + seed * 0.012, **h))
            prior.append(trial("vanilla", seed, b, x, power_law(x, 1.5) + seed * 0.01))
    points = arm_points(trials, prior)
    assert sorted({p["arm"] for p in points}) == [
        "headless", "headless·prior", "headless·tied", "vanilla", "vanilla+prior"]  # fmt: skip
    readout = [p for p in points if p["arm"] == "headless·prior"]
    assert all(p["flops"] == p["pretrain_flops"] and p["finetune_share"] == 0 for p in readout)
    charged = [p for p in points if p["arm"] == "headless"]
    assert all(p["flops"] > p["pretrain_flops"] for p in charged)
    table = "\n".join(readout_table(points, 4.0, "flops"))
    assert table.count("\n| headless") == 6  # 3 readouts × 2 vanilla arms
    assert "| headless·prior | vanilla | 3.05× [3.02, 3.09] holds |" in table  # a 3× readout
    assert "> 2× (outside the measured range) |" in table  # at 2T vanilla would need > 4T
    assert "| headless·tied | vanilla | " in table and "reversed" in table


def test_budgets_are_flops_with_si_prefixes_and_bad_ones_fail_before_anything_runs():
    assert [scaling.flops_of(v) for v in ("400G", "1.6T", "64E", 2e11)] == [
        4e11, 1.6e12, 6.4e19, 2e11,
    ]  # fmt: skip
    spec = get_sweep(SCALING.PRESETS, "tiny", ["sweep.values=[5G,1e10]"])
    assert [spec.cell_config(v, "headless", 0).budget.flops for v in spec.values] == [5e9, 1e10]
    for bad in ("sweep.values=[10X]", "sweep.values=[-5G]"):
        with pytest.raises(HLMError, match="positive number of FLOPs"):
            scaling.check_budgets(get_sweep(SCALING.PRESETS, "tiny", [bad]))
    assert SCALING.main(["--preset", "tiny", "--search"]) == 2


# ------------------------------------------------------------------------------ the dry run


def test_the_cpu_dry_run_shows_the_search_its_extension_rule_the_head_and_every_arms_steps(
    capsys,
):
    assert SCALING.main(["--preset", "cpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "learning rates searched: 0.000316, 0.001, 0.00316 at 500G and 4T, seeds 0..1" in out
    assert "one step past it (×3.16) is tried too, at most 2 step(s) per edge" in out
    assert "the vocabulary head is 38% of a vanilla step's FLOPs (V = 2,048" in out
    assert "embedding update: headless dense, vanilla dense" in out
    assert "generator fine-tune: 40 optimizer steps" in out
    assert "| 500G | 237 | 332 | 512 | 7.8% |" in out  # vanilla >= 200 steps at the smallest
    for lr in ("0.000316", "0.001", "0.00316"):
        for budget in ("500G", "4T"):
            for seed in (0, 1):
                assert f"scaling-lr={budget}@{lr} seed {seed}" in out
    for budget in ("500G", "1T", "2T", "4T"):
        for arm in ("headless", "vanilla"):
            for seed in range(3):
                assert f"{arm} scaling={budget} seed {seed} " in out
    assert "3. every budget, vanilla with its head's bias started at the log prior" in out
    assert "60 trials, plus 4 per grid extension" in out


def test_the_paper_dry_run_prints_its_cost_plan(capsys):
    assert SCALING.main(["--preset", "paper", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "plan for scaling-paper: 30 trial(s)" in out and "GPU-hours" in out
    assert "headless scaling=64E seed 2" in out


# ------------------------------------------------------------------------------ end to end


@pytest.mark.ray
@pytest.mark.slow
def test_scaling_tiny_end_to_end(ray_cluster, mlflow_server, tmp_path, monkeypatch, capsys):
    """`python sweeps/scaling.py --preset tiny`, as the suite runs it: the search at both ends,
    the budgets, the report; each arm's trials at the rates its search found, on the parent run;
    every row beside its floor, no verdict where an arm does not beat it; trials trained in their
    own process (local mode)."""
    monkeypatch.chdir(tmp_path)
    use_mlflow_server(mlflow_server, monkeypatch.setenv)
    assert SCALING.main(["--preset", "tiny", "--name", "sc"]) == 0
    root = tmp_path / "runs" / "sweeps"
    text = (root / "sc" / "report.md").read_text()
    assert "The floor (the unigram model of the training tokens" in text
    assert "s for the command (the search" in text and "s in optimizer steps" in text
    for png in ("scaling.png", "lr_search.png"):
        assert (root / "sc" / png).stat().st_size > 1000
    points = read_points(root / "sc")
    floor = points[0]["floor"]
    assert math.isfinite(floor) and all(p["floor"] == floor for p in points)
    for line in text.splitlines():  # no verdict for a row whose arm does not beat the floor
        if line.startswith("| ") and ("| holds" in line or "| reversed" in line):
            budget = line.split(" | ")[0].strip("| ")
            for arm in ("headless", "vanilla"):
                bpb = [p["bpb"] for p in points if p["arm"] == arm and p["budget"] == budget]
                assert beats_floor(bpb, floor), line

    search = [r for r in summary_rows(root / "sc-lr") if r["status"] == "FINISHED"]
    assert len(search) == 8  # 2 arms × 2 rates × 2 budgets × 1 seed
    record = json.loads((root / "sc" / scaling.SEARCH_FILE).read_text())
    client, (parent,), children = sweep_runs(mlflow_server, "sc")
    rows = summary_rows(root / "sc")
    assert len(rows) == 6 and all(r["status"] == "FINISHED" for r in rows)
    by_trial = {c.data.tags["trial_id"]: c for c in children}
    for row in rows:  # the rate of its arm at its budget, in its config and on its MLflow run
        lr = record["rates"][row["objective"]][row["budget_flops"]]
        assert (
            float(parent.data.params[f"scaling.lr.{row['objective']}.{row['budget_flops']}"]) == lr
        )
        saved = yaml.safe_load((root / "sc" / "trials" / row["run"] / "config.yaml").read_text())
        assert saved["optim"]["lr"] == lr and saved["optim"]["embedding_update"] == "dense"
        child = by_trial[row["trial_id"]]
        assert float(child.data.params["optim.lr"]) == lr
        assert child.data.tags["ray_train"] == "local"
        assert child.data.metrics["trial/pretrain_overhead_s"] > 0
    out = capsys.readouterr().out
    assert "rates: headless 10G" in out and "# Compute multiplier: preset tiny" in out
