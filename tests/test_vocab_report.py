"""Figure 7's report (hlm_ray.tune.vocab_report) and the compute budgets of the vocab and headline
sweeps, as plain functions: no Ray, no training."""

import pytest

from hlm_ray.budget import flops_per_step
from hlm_ray.tune import families, report, stats
from hlm_ray.tune.scripts import load_script
from hlm_ray.tune.vocab_report import at_chance, plot_vs_vocab, scores_sentence, speed_sentence


def test_speed_sentence_says_which_arm_falls_and_which_stays_flat():
    speed = {
        "vanilla": {1024: [40_000.0], 8192: [20_000.0], 32768: [8_000.0]},
        "headless": {1024: [50_000.0, 52_000.0], 32768: [49_000.0, 51_000.0]},
    }
    text = speed_sentence(speed, {"vanilla": "dense", "headless": "lazy"})
    assert "vanilla's training speed (dense embedding update) falls" in text
    assert "-80%" in text
    assert "headless's training speed (lazy embedding update) stays within 15%" in text
    assert speed_sentence({"vanilla": {1024: [1.0]}}, {}).startswith("The speed figure has")
    uneven = speed_sentence({"headless": {1024: [100.0], 8192: [40.0], 32768: [95.0]}}, {})
    assert "ends within 15% of where it starts but is uneven" in uneven


def _row(v, headless, vanilla, baseline=0.5):
    trials = [report.Trial(v, "headless", i, {"s": x}) for i, x in enumerate(headless)]
    trials += [report.Trial(v, "vanilla", i, {"s": x}) for i, x in enumerate(vanilla)]
    return report.compare(trials, [report.Score("s", "acc", v, baseline=baseline)])[0]


def test_scores_sentence_from_the_numbers():
    noise = [_row("1024", [0.50, 0.52, 0.49], [0.51, 0.50, 0.52])]
    text = scores_sentence(noise)
    assert "cannot be told apart at any size" in text
    assert "2 of the 2 points are at chance" in text
    apart = noise + [_row("32768", [0.80, 0.81, 0.82], [0.60, 0.61, 0.62])]
    text = scores_sentence(apart)
    assert "outside the noise at 1 of 2 sizes (V=32768: holds" in text
    one_seed = scores_sentence([_row("1024", [0.7], [0.6])])
    assert "one seed per point gives no interval" in one_seed
    collapsed = scores_sentence([_row("1024", [0.51, 0.51], [0.49, 0.49])])
    assert "cannot be told apart at any size" in collapsed and "zero spread at V=1024" in collapsed


def test_at_chance_marks_points_whose_interval_includes_the_baseline():
    assert at_chance([0.50, 0.53, 0.48], 0.51)
    assert at_chance([0.40], 0.51)  # one seed, below the baseline
    assert not at_chance([0.80, 0.82, 0.81], 0.51)
    assert not at_chance([0.80, 0.82, 0.81], None)


def test_figure_names_task_baseline_chance_and_each_arms_update(tmp_path):
    points = {"headless": {1024: [0.50, 0.52], 8192: [0.80, 0.82]}, "vanilla": {1024: [0.7]}}
    fig = plot_vs_vocab(
        points,
        tmp_path / "fig.png",
        title="Figure 7a: SST-2 accuracy vs V",
        y_label="SST-2 accuracy",
        labels={"headless": "headless (lazy embedding update)"},
        baseline=(0.51, "majority class (0.510)"),
    )
    assert (tmp_path / "fig.png").is_file()
    ax = fig.axes[0]
    assert "SST-2" in ax.get_title() and ax.get_ylabel() == "SST-2 accuracy"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "headless (lazy embedding update)" in legend and "vanilla" in legend
    assert "majority class (0.510)" in legend
    assert any(t.startswith("at chance") for t in legend)
    flat = [line for line in ax.get_lines() if set(line.get_ydata()) == {0.51}]
    assert flat, "the baseline is drawn"
    # Only the headless point at V=1024 is at chance: one ring.
    rings = [c for c in ax.collections if c.get_label().startswith("at chance")]
    assert len(rings) == 1 and len(rings[0].get_offsets()) == 1
    assert tuple(rings[0].get_offsets()[0]) == (1024, pytest.approx(0.51))


def test_vocab_cpu_gives_every_trial_the_same_flops():
    vocab = load_script("vocab")
    spec = vocab.PRESETS["cpu"]
    assert spec.num_seeds >= 3 and set(spec.values) == {1024, 4096, 16384, 50257}
    budgets = {spec.cell_config(c["value"], c["objective"], c["seed"]).budget.flops
               for c in spec.cells()}  # fmt: skip
    assert budgets == {vocab.EQUAL_FLOPS}
    steps = vocab.equal_flops_steps(spec)
    for (value, objective), n in steps.items():
        cfg = spec.cell_config(value, objective, 0)
        per_step = flops_per_step(cfg, value)
        assert n * per_step <= vocab.EQUAL_FLOPS < (n + 1) * per_step
    vanilla = [steps[(v, "vanilla")] for v in sorted(spec.values)]
    assert vanilla == sorted(vanilla, reverse=True) and vanilla[0] > 2 * vanilla[-1]
    # The headless head scores only the batch's own targets: its steps hardly move with V.
    headless = [steps[(v, "headless")] for v in sorted(spec.values)]
    assert max(headless) - min(headless) <= 0.05 * max(headless)
    assert all(h > v for h, v in zip(headless, vanilla, strict=True))
    # The objectives compare at the same embedding update (the lazy one's speed is probed apart).
    updates = {o: spec.cell_config(1024, o, 0).optim.embedding_update for o in spec.objectives}
    assert updates == {"headless": "dense", "vanilla": "dense"}
    big = spec.cell_config(50257, "vanilla", 0).tokenizer
    assert (big.kind, big.path) == ("file", "tokenizers/gpt2")
    # What Tune resolves for each trial is the config the cell stands for.
    from ray.tune.search.variant_generator import generate_variants

    from hlm_ray.config import Config

    resolved = [Config.from_dict(v["config"]) for _, v in generate_variants(spec.param_space())]
    assert sorted(c.tokenizer.kind for c in resolved) == ["bpe"] * 18 + ["file"] * 6
    for cell in spec.cells():
        assert resolved.count(spec.cell_config(**cell)) == 1, cell


def test_the_demo_reaches_a_vocabulary_where_the_head_matters():
    spec = load_script("vocab").PRESETS["tiny"]
    assert max(spec.values) >= 32768
    assert {spec.cell_config(32768, o, 0).optim.embedding_update for o in spec.objectives} == {
        "dense"
    }


def test_headline_equal_compute_rows():
    spec = load_script("headline").PRESETS["cpu"]
    assert {"bert-cpu", "gpt2-cpu", "bert-cpu-flops", "gpt2-cpu-flops"} <= set(spec.values)
    for name, ratio, tokenizer in (("bert-cpu-flops", 2, "tokenizers/gpt2"),
                                   ("gpt2-cpu-flops", 1.3, None)):  # fmt: skip
        f = families.FAMILIES[name]
        arms = {o: families.arm_settings(name, o) for o in ("headless", "vanilla")}
        assert arms["headless"].keys() == arms["vanilla"].keys()
        assert arms["headless"]["budget.flops"] == f.flops
        # The cheaper head buys the headless arm more tokens at the same FLOPs.
        assert f.steps("headless") > ratio * f.steps("vanilla")
        cfg = spec.cell_config(name, "vanilla", 0)
        assert cfg.tokenizer.path == tokenizer
    # The cpu decoder: a 2k BPE (the head 38% of a vanilla step), vanilla hundreds of steps,
    # each arm at its own searched rate, both arms the same (dense) embedding update.
    gpt2 = families.FAMILIES["gpt2-cpu-flops"]
    cfg = {o: spec.cell_config("gpt2-cpu-flops", o, 0) for o in ("headless", "vanilla")}
    assert cfg["vanilla"].tokenizer.vocab_size == 2048 and gpt2.steps("vanilla") >= 900
    assert {o: c.optim.lr for o, c in cfg.items()} == families.DECODER_CPU_LRS
    assert {c.optim.embedding_update for c in cfg.values()} == {"dense"}
    # The vanilla arm's FLOPs also cover its twin's generator fine-tune (tens of steps).
    extra = families.arm_settings("gpt2-cpu-flops", "vanilla")["budget.flops"] - gpt2.flops
    ft = families.GENERATORS["cpu"]
    assert ft["optim.max_steps"] >= 20
    tokens = ft["optim.max_steps"] * ft["optim.global_batch_size"] * 64
    per_token = flops_per_step(gpt2.arm_config("vanilla"), 2048) / (8 * 64)
    assert extra == pytest.approx(tokens * per_token)
    for name, cap in (("bert-cpu-seconds", 1_200), ("gpt2-cpu-seconds", 2_400)):
        arms = [families.arm_settings(name, o) for o in ("headless", "vanilla")]
        assert arms[0]["budget.seconds"] == arms[1]["budget.seconds"] == families.CPU_SECONDS
        # The schedule (and cap) is more steps than 60 s buy either arm on 2 cores.
        assert arms[0]["optim.max_steps"] == arms[1]["optim.max_steps"] == cap


def test_verdict_of_a_per_size_row_uses_the_headline_statistics():
    row = _row("4096", [0.80, 0.81, 0.82], [0.60, 0.61, 0.62])
    assert row.verdict == stats.HOLDS
    assert row.diff == stats.welch([0.80, 0.81, 0.82], [0.60, 0.61, 0.62])


def test_curve_checkpoints_at_a_quarter_a_half_and_the_end():
    from hlm_ray.tune.curve import checkpoint_settings, curve_steps

    assert curve_steps(600) == [150, 300, 600]
    assert checkpoint_settings(600) == {
        "run.checkpoint_every": 150,
        "run.eval_every": 150,
        "run.keep_checkpoints": 4,
    }
    assert checkpoint_settings(612)["run.checkpoint_every"] == 153
    odd = checkpoint_settings(10)  # steps 2 (2.5 rounded to even), 5, 10: every step kept
    assert curve_steps(10) == [2, 5, 10] and odd["run.keep_checkpoints"] == 10
    arm = families.arm_settings("bert-cpu-curve", "vanilla")
    assert arm["run.checkpoint_every"] == 100 and arm["optim.max_steps"] == 400


def _curve_args(argv: list[str]):
    """The headline script's arguments after its --curve hook."""
    from hlm_ray.tune.headline import curve_args

    script = load_script("headline").SCRIPT
    args = script.parser().parse_args(argv)
    curve_args(args, script.axis)
    return args


def test_curve_sweeps_the_presets_curve_families_under_its_own_name():
    args = _curve_args(["--preset", "cpu", "--curve", "--set", "sweep.values=[bert-cpu]"])
    assert args.set == ["sweep.values=[bert-cpu]", "sweep.values=[bert-cpu-curve]"]
    assert args.name == "headline-cpu-curve"
    assert _curve_args(["--preset", "tiny", "--curve", "--name", "x"]).name == "x"
    plain = _curve_args(["--preset", "cpu"])
    assert plain.set == [] and plain.name is None
    with pytest.raises(Exception, match="--curve runs with --preset"):
        _curve_args(["--preset", "paper", "--curve"])


def test_curve_figure_draws_score_against_tokens_and_flops(tmp_path):
    from hlm_ray.tune.curve import plot_curve

    points = [
        {"objective": arm, "seed": seed, "step": step, "tokens": step * 2048.0,
         "flops": step * (5e9 if arm == "headless" else 9e9), "scores": {"s": 0.5 + step / 1e3}}
        for arm in ("headless", "vanilla") for seed in (0, 1) for step in (150, 300, 600)
    ]  # fmt: skip
    fig = plot_curve(points, tmp_path / "c.png", title="t", y_label="GLUE avg", key="s",
                     baseline=0.43)  # fmt: skip
    left, right = fig.axes
    assert (left.get_xlabel(), right.get_xlabel()) == ("pretraining tokens", "pretraining FLOPs")
    legend = [t.get_text() for t in right.get_legend().get_texts()]
    assert sorted(legend) == ["headless", "majority-class baseline", "vanilla"]
    # The vanilla line's last point sits at 600 steps × its FLOPs per step.
    xs = [line.get_xdata() for line in right.get_lines() if len(line.get_xdata()) == 3]
    assert max(max(x) for x in xs) == pytest.approx(600 * 9e9)


def test_the_score_is_named_by_the_recipe_with_its_majority_baseline():
    from hlm_ray.classify.baselines import majority_baseline
    from hlm_ray.classify.recipes import recipe
    from hlm_ray.tune.vocab_report import downstream_score

    label, base, note = downstream_score("tiny")
    assert label.startswith("SST-2 accuracy") and note == "majority class"
    limit = recipe("tiny", "glue:sst2").eval_limit
    assert base == majority_baseline("glue:sst2", eval_limit=limit)
    label, base, note = downstream_score("paper")
    assert label == "GLUE-style average (CoLA MCC, SST-2 accuracy, MRPC accuracy, QNLI accuracy)"
    assert note == "mean of the tasks' majority classes" and 0 < base < 0.5
    assert downstream_score("none")[1] is None  # pretraining only: no score, no baseline


def test_the_report_says_what_each_arm_trained_at_equal_seconds(tmp_path):
    import json

    from hlm_ray.tune.headline import reached_notes

    rows = [("headless", 0, 900), ("headless", 1, 700), ("vanilla", 0, 40), ("vanilla", 1, 30)]
    lines = ["run,status,family,objective,seed"]
    for arm, seed, steps in rows:
        run = f"{arm}-s{seed}"
        lines.append(f"{run},FINISHED,gpt2-cpu-seconds,{arm},{seed}")
        (tmp_path / "trials" / run).mkdir(parents=True)
        summary = {"steps": steps, "tokens": steps * 2048}
        (tmp_path / "trials" / run / "summary.json").write_text(json.dumps(summary))
    lines.append("x,FINISHED,bert-cpu,headless,0")  # an equal-token family: nothing to add
    (tmp_path / "summary.csv").write_text("\n".join(lines) + "\n")
    spec = load_script("headline").PRESETS["cpu"]
    assert reached_notes(spec, tmp_path) == [
        "`gpt2-cpu-seconds` as trained (mean over seeds): headless 800 steps = 1,638,400 tokens; "
        "vanilla 35 steps = 71,680 tokens."
    ]
