"""The report of a headless-vs-vanilla comparison over seeds: a table, a verdict per family, a figure.

    trials = [Trial(family="bert-cpu", objective="headless", seed=0, scores={...}), ...]
    scores = [Score("glue:sst2/score", "SST-2 acc", "bert-cpu", baseline=0.5086), ...]
    rows = compare(trials, scores)                    # per score: each arm, Δ [95% CI], verdict
    text = markdown(rows, title="...", notes=[...])   # the report.md table and its verdicts
    plot_arms(rows, trials, Path("headline.png"), title="headline, preset cpu, 3 seeds")

Per arm: mean ± sample sd over seeds. The difference is headless − vanilla with Welch's 95% t
interval (unpaired): a seed fixes the data order and the initial weights of both arms, but
nothing says a seed that is lucky for one objective is lucky for the other, and Welch does not
need it to be (`paired=True` gives the paired-by-seed interval instead). A row's verdict:
"holds" when the interval excludes 0 in the paper's direction (headless better: higher accuracy,
lower perplexity and bits per byte), "reversed" when it excludes 0 the other way, else "cannot be
told apart from noise", which is also the verdict, with the reason, when there is no interval (an
arm with one seed; zero spread, e.g. both arms collapsed to the majority class).

Every score has a floor or a baseline: classification the majority class, LAMBADA accuracy the
most frequent last word, bits per byte and perplexity the unigram model of the run's own training
tokens (a trial metric, `Score.floor_key`). An arm whose 95% interval of the mean includes it, or
whose mean is no better, is marked ("≈ chance", "at floor"), and a comparison where either arm is
so gets no verdict at all: "no verdict", with the reason. An arm that has learnt nothing the
floor does not already know cannot tell which objective is better.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hlm_ray.tune import stats

ARMS = ("vanilla", "headless")
NEAR_CHANCE = "≈ chance"
AT_FLOOR = "at floor"
FLOOR_NOTE = "unigram of the training tokens"


@dataclass(frozen=True)
class Trial:
    family: str
    objective: str
    seed: int
    scores: dict[str, float]


@dataclass(frozen=True)
class Score:
    """One row of the report: a trial score of one family."""

    key: str
    """The trial's metric (`downstream.json`), e.g. "lambada/accuracy"."""
    label: str
    family: str
    higher_is_better: bool = True
    baseline: float | None = None
    """What a model that learnt nothing scores (None: no chance level, e.g. tokens/s)."""
    baseline_note: str = ""
    arm_keys: tuple[tuple[str, str], ...] = ()
    """(arm, metric) pairs where an arm is read from another metric than `key` (the headless
    decoder's prior readout against the vanilla decoder's own head)."""
    floor_key: str = ""
    """The trial metric that holds this score's floor (the unigram model of the run's training
    tokens, scored the same way: `bpb/unigram_floor`); the baseline is its mean over the
    family's trials, which share tokenizer and corpus."""
    headline: bool = False
    """The family's verdict sentence is about this row (GLUE average, LAMBADA accuracy)."""
    fmt: str = "{:.4f}"


@dataclass(frozen=True)
class Row:
    score: Score
    arms: dict[str, stats.Summary]
    values: dict[str, list[float]]
    diff: stats.Difference
    verdict: str
    near_chance: dict[str, bool] = field(default_factory=dict)
    """Per arm: not better than the baseline or floor (`stats.near_baseline`)."""
    baseline: float | None = None
    """The score's baseline, or its floor as the trials measured it."""
    why: str = ""
    """Why there is no verdict (an arm at its floor or baseline), empty otherwise."""


def majority_of(plan: dict, task: str) -> float:
    """The majority-class score of a GLUE `task` on the evaluation rows its downstream `plan`
    (`hlm_ray.downstream.DOWNSTREAM[recipe]`) scores: the plan's eval limit, else its recipe's."""
    from hlm_ray.classify.baselines import majority_baseline
    from hlm_ray.classify.recipes import recipe as classify_recipe

    limit = plan.get("classify_settings", {}).get(
        "eval_limit", classify_recipe(plan["classify"], task).eval_limit
    )
    return majority_baseline(task, eval_limit=limit)


def compare(trials: Sequence[Trial], scores: Sequence[Score], *, paired: bool = False) -> list[Row]:
    """One row per score: each arm over its seeds, the difference, the verdict (withheld where
    an arm does not beat the score's floor or baseline)."""
    rows = []
    for score in scores:
        values = {}
        for arm in ARMS:
            mine = sorted(
                (t for t in trials if t.family == score.family and t.objective == arm),
                key=lambda t: t.seed,
            )
            key = dict(score.arm_keys).get(arm, score.key)
            values[arm] = [t.scores.get(key, math.nan) for t in mine]
        if paired and len(values["headless"]) != len(values["vanilla"]):
            raise ValueError(f"{score.family}: paired by seed needs the same seeds in both arms")
        arms = {arm: stats.describe(values[arm]) for arm in ARMS}
        diff = stats.difference(values["headless"], values["vanilla"], paired_by_seed=paired)
        baseline = score.baseline if not score.floor_key else floor_of(trials, score)
        near = {
            a: stats.near_baseline(arms[a], baseline, higher_is_better=score.higher_is_better)
            for a in ARMS
        }
        verdict, why = stats.verdict(diff, higher_is_better=score.higher_is_better), ""
        late = [a for a in ARMS if near[a] and arms[a].n]
        if late:
            what = "its floor" if score.floor_key else "its baseline"
            verdict = stats.WITHHELD
            why = f"{' and '.join(late)} {'does' if len(late) == 1 else 'do'} not beat {what}"
        rows.append(Row(score, arms, values, diff, verdict, near, baseline, why))
    return rows


def floor_of(trials: Sequence[Trial], score: Score) -> float | None:
    """The mean of `score.floor_key` over the family's trials (None: none measured it)."""
    found = [t.scores[score.floor_key] for t in trials
             if t.family == score.family and math.isfinite(t.scores.get(score.floor_key, math.nan))]  # fmt: skip
    return sum(found) / len(found) if found else None


def _num(value: float, fmt: str) -> str:
    return fmt.format(value) if value is not None and math.isfinite(value) else "–"


def arm_cell(row: Row, arm: str) -> str:
    s = row.arms[arm]
    if s.n == 0:
        return "no finished trial"
    text = _num(s.mean, row.score.fmt) + (f" ± {_num(s.sd, row.score.fmt)}" if s.n > 1 else "")
    mark = AT_FLOOR if row.score.floor_key else NEAR_CHANCE
    return text + (f" ({mark})" if row.near_chance.get(arm) else "")


def diff_cell(row: Row) -> str:
    d, fmt = row.diff, row.score.fmt
    if not math.isfinite(d.estimate):
        return "–"
    sign = "+" if d.estimate >= 0 else ""
    interval = f" [{_num(d.low, fmt)}, {_num(d.high, fmt)}]" if math.isfinite(d.low) else ""
    return f"{sign}{_num(d.estimate, fmt)}{interval}"


def markdown_rows(rows: Sequence[Row]) -> str:
    lines = [
        "| family | score | vanilla | headless | Δ headless − vanilla [95% CI] | baseline | "
        "verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s = row.score
        direction = "↑" if s.higher_is_better else "↓"
        base = _num(row.baseline, s.fmt) if row.baseline is not None else "none"
        note = FLOOR_NOTE if s.floor_key else s.baseline_note
        if note and row.baseline is not None:
            base += f" ({note})"
        elif s.floor_key:
            base = "none (the run's training tokens were not found to count)"
        cells = [
            s.family,
            f"{s.label} {direction}",
            arm_cell(row, "vanilla"),
            arm_cell(row, "headless"),
            diff_cell(row),
            base,
            verdict_cell(row),
        ]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def verdict_cell(row: Row) -> str:
    """The verdict, with why there is none (an arm at its floor) or no interval (too few seeds,
    zero spread)."""
    why = row.why or row.diff.reason
    return f"{row.verdict} ({why})" if why else row.verdict


def verdict_sentence(row: Row, scale: str) -> str:
    """One sentence: does the paper's direction hold for this family at this scale?"""
    s, d = row.score, row.diff
    n = f"{row.arms['headless'].n} + {row.arms['vanilla'].n} seeds"
    if not math.isfinite(d.estimate):
        return f"**{s.family}**: no comparison ({s.label} missing in an arm)."
    measured = f"headless − vanilla on {s.label} = {diff_cell(row)} ({n})"
    better = "higher" if s.higher_is_better else "lower"
    if row.verdict == stats.WITHHELD:
        what = f"**no verdict** at {scale}: {row.why}, so the comparison is not read"
    elif row.verdict == stats.HOLDS:
        what = f"the paper's direction (headless {better}) **holds** at {scale}"
    elif row.verdict == stats.REVERSED:
        what = f"the paper's direction is **reversed** at {scale} (vanilla is better)"
    else:
        what = f"the difference **cannot be told apart from noise** at {scale}"
        if d.reason:
            what += f" ({d.reason})"
    chance = [a for a in ARMS if row.near_chance.get(a)]
    mark = AT_FLOOR if row.score.floor_key else NEAR_CHANCE
    tail = (
        f"; {' and '.join(chance)} {'is' if len(chance) == 1 else 'are'} {mark}"
        if chance and row.verdict != stats.WITHHELD
        else ""
    )
    return f"**{s.family}**: {measured}: {what}{tail}."


def markdown(
    rows: Sequence[Row], *, title: str, scale: str, notes: Sequence[str] = (), figure: str = ""
) -> str:
    """The whole report: title, verdicts (one per family, on its headline row), table, notes."""
    verdicts = [verdict_sentence(r, scale) for r in rows if r.score.headline]
    parts = [f"# {title}", "", *(f"- {v}" for v in verdicts), "", markdown_rows(rows), ""]
    parts += [
        "Cells: mean ± sample sd over seeds. Δ: Welch 95% t interval of the difference of means "
        "(unpaired). Verdict: *holds* when the interval excludes 0 in the paper's direction "
        "(headless better; ↑ higher is better, ↓ lower), *reversed* when it excludes 0 the other "
        f"way. *{NEAR_CHANCE}* / *{AT_FLOOR}*: the arm's 95% interval of the mean (one seed: "
        "its score) includes the baseline (or the floor: the unigram model of the run's own "
        "training tokens, scored on the same texts), or its mean is no better; a row where "
        f"either arm is so gets *{stats.WITHHELD}*, with the reason.",
    ]
    if notes:
        parts += ["", *(f"- {n}" for n in notes)]
    if figure:
        parts += ["", f"![{title}]({figure})"]
    return "\n".join(parts) + "\n"


VERDICT_COLORS = {stats.HOLDS: "tab:green", stats.REVERSED: "tab:red"}  # else gray: noise


def plot_forest(rows: Sequence[Row], out_png: Path, *, title: str) -> Path:
    """The headline as a forest plot: one line per family and score, headless − vanilla (the
    point) with its 95% interval (the bar), the zero line, the verdict at the right (green
    holds, red reversed, gray cannot be told apart). Scores differ in unit and scale (accuracy,
    perplexity, bits per byte), so each line has its own x-axis; the arrow says which side is
    better. A difference without an interval (too few seeds, zero spread) is a hollow point."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    n = max(1, len(rows))
    fig = Figure(figsize=(7.5, 0.55 * n + 1.1), layout="constrained")
    fig.suptitle(title, fontsize=10)
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    for ax, row in zip(axes, rows, strict=False):
        d = row.diff
        color = VERDICT_COLORS.get(row.verdict, "gray")
        has_interval = not d.reason and math.isfinite(d.low) and math.isfinite(d.high)
        if has_interval:
            ax.errorbar(
                [d.estimate], [0], xerr=[[d.estimate - d.low], [d.high - d.estimate]],
                fmt="o", color=color, capsize=3, ms=5,
            )  # fmt: skip
            lo, hi = min(d.low, 0.0), max(d.high, 0.0)
        else:
            ax.plot([d.estimate], [0], "o", mfc="white", color=color, ms=5)
            lo, hi = min(d.estimate, 0.0), max(d.estimate, 0.0)
        pad = 0.15 * (hi - lo) or 0.1 * max(abs(d.estimate), 1e-3)
        ax.set_xlim(lo - pad, hi + pad)
        ax.axvline(0.0, color="k", lw=0.8)
        ax.set_yticks([0], [f"{row.score.family}: {row.score.label} "
                            f"{'↑' if row.score.higher_is_better else '↓'}"])  # fmt: skip
        ax.tick_params(axis="x", labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4))  # long labels (-0.00015) ran together
        ax.tick_params(axis="y", labelsize=8)
        ax.set_ylim(-1, 1)
        said = row.verdict if has_interval else "no interval"
        if row.verdict == stats.WITHHELD:
            said = f"no verdict: {row.why}"
        ax.text(1.01, 0.5, said, transform=ax.transAxes, color=color, va="center", fontsize=8)
        ax.grid(alpha=0.3, axis="x")
    axes[-1].set_xlabel("headless − vanilla (95% interval over seeds), in each score's unit")
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def plot_arms(rows: Sequence[Row], out_png: Path, *, title: str) -> Path:
    """One panel per score: a bar per arm (mean), error bars of ±1 sd across seeds, each seed a
    dot, the baseline as a dashed line."""
    from matplotlib.figure import Figure

    cols = min(4, max(1, len(rows)))
    nrows = math.ceil(len(rows) / cols) if rows else 1
    fig = Figure(figsize=(3.0 * cols, 2.8 * nrows + 0.6), layout="constrained")
    fig.suptitle(title)
    colors = {"vanilla": "tab:orange", "headless": "tab:blue"}
    for i, row in enumerate(rows):
        ax = fig.add_subplot(nrows, cols, i + 1)
        for x, arm in enumerate(ARMS):
            s = row.arms[arm]
            if s.n == 0:
                continue
            err = s.sd if math.isfinite(s.sd) else 0.0
            ax.bar(x, s.mean, color=colors[arm], alpha=0.6, yerr=err, capsize=4)
            seeds = [v for v in row.values[arm] if math.isfinite(v)]
            ax.scatter([x] * len(seeds), seeds, color="k", s=10, zorder=3)
        if row.baseline is not None:
            label = "floor (unigram)" if row.score.floor_key else "baseline"
            ax.axhline(row.baseline, color="gray", ls="--", lw=1, label=label)
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xticks(range(len(ARMS)), ARMS)
        arrow = "↑" if row.score.higher_is_better else "↓"
        ax.set_title(f"{row.score.family}: {row.score.label} {arrow}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def read_trials(folder: Path, value_column: str) -> list[Trial]:
    """The finished trials of the sweep in `folder`: its summary.csv rows (`value_column`: the
    axis's CSV column) with every score of their `downstream.json`."""
    import csv
    import json

    trials = []
    with (folder / "summary.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            path = folder / "trials" / row["run"] / "downstream.json"
            if row["status"] != "FINISHED" or not path.is_file():
                continue
            scores = {k: float(v) for k, v in json.loads(path.read_text()).items()}
            trials.append(Trial(row[value_column], row["objective"], int(row["seed"]), scores))
    return trials


def log_to_parent(
    folder: Path, files: Sequence[Path], description: str, experiment: str, params=None
) -> None:
    """The report's files as artifacts of the sweep's parent MLflow run (its id in sweep.json),
    and the report at the top of the run's description, above the sweep's own per-value table
    and figures (kept in sweep.json), with `params` ({name: value}) if given; the run is closed
    again as it was."""
    import json

    from hlm_ray.tracking import MlflowTracker

    state = json.loads((folder / "sweep.json").read_text())
    run_id = state.get("parent_run_id")
    if not run_id:
        return
    parent = MlflowTracker(experiment, run_id=run_id)
    if params:
        parent.log_params(params)
    for path in files:
        parent.log_artifact(path)
    if state.get("note"):
        description = f"{description}\n\n---\n\n{state['note']}"
    parent.set_tags({"mlflow.note.content": description})
    parent.finish("FINISHED")
