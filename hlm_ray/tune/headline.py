"""The headline comparison's report (`sweeps/headline.py`): per family, each arm's scores
over seeds beside their chance / majority-class baselines, the difference with a Welch 95%
interval and a verdict (`hlm_ray.tune.report`), what each arm's budget bought; with --curve,
the scores at 25%, 50% and 100% of the budget (`hlm_ray.tune.curve`).

    files = write_reports(spec, "headline-cpu", "cpu")    # [report.md, headline.png, ...]
    report_scores(spec)          # the report's rows: GLUE tasks and average, LAMBADA, bpb
    budget_notes(spec)           # what both arms of each family were given, in words
    add_curve_flag(parser); curve_args(args, axis)       # --curve: its families and name

Everything lands in runs/sweeps/<name> and on the sweep's parent MLflow run (artifacts and its
description).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from hlm_ray.errors import HLMError
from hlm_ray.tune.axis import Axis
from hlm_ray.tune.families import FAMILIES, Family, vocab_size_of
from hlm_ray.tune.spec import SweepSpec

GLUE_LABELS = {
    "glue:sst2": "SST-2 acc",
    "glue:cola": "CoLA MCC",
    "glue:mrpc": "MRPC acc",
    "glue:rte": "RTE acc (not in the average)",
    "glue:qnli": "QNLI acc",
    "xnli:en": "XNLI zero-shot acc (7 languages)",
}


def lambada_majority(limit: int | None) -> tuple[float, str]:
    """Accuracy of always answering the most frequent final word of the scored passages."""
    from collections import Counter

    from hlm_ray.evaluate.lambada import load_lambada

    words = Counter(e["continuation"].strip() for e in load_lambada(limit=limit))
    word, count = words.most_common(1)[0]
    return count / sum(words.values()), f'always "{word}"'


def report_scores(spec: SweepSpec) -> list:
    """The report's rows for the sweep's families, each with its baseline."""
    from hlm_ray.classify.baselines import chance_baseline
    from hlm_ray.downstream import DOWNSTREAM
    from hlm_ray.tune.report import Score, majority_of

    plan = DOWNSTREAM[spec.recipe]
    scores = []
    for value in spec.values:
        family = FAMILIES[str(value)]
        cfg = family.config()
        if cfg.model.family == "decoder":
            acc, note = lambada_majority(plan["lambada_limit"])
            scores += [
                Score("lambada/accuracy", "LAMBADA acc", str(value), baseline=acc,
                      baseline_note=f"most frequent last word, {note}", headline=True),
                Score("lambada/perplexity", "LAMBADA ppl", str(value), higher_is_better=False,
                      fmt="{:.4g}", floor_key="lambada/unigram_perplexity"),
                Score("bpb", "bits per byte", str(value), higher_is_better=False,
                      floor_key="bpb/unigram_floor"),
                *readout_scores(str(value)),
            ]  # fmt: skip
            continue
        tasks = plan.get("tasks_by_model_type", {}).get(cfg.model.arch, plan["glue_tasks"])
        rows, averaged = [], []
        for task in tasks:
            if task.startswith("xnli:"):
                base, note = chance_baseline(task), "chance, 3 classes"
            else:
                base, note = majority_of(plan, task), "majority class"
                if task == "glue:cola":
                    note = "majority class: MCC 0"
            rows.append(Score(f"{task}/score", GLUE_LABELS[task], str(value), baseline=base,
                              baseline_note=note))  # fmt: skip
            if task not in plan.get("average_excludes", ()):
                averaged.append(base)
        label = "GLUE avg (RTE excluded)" if len(tasks) > 1 else rows[0].label
        scores.append(
            Score("downstream/score", label, str(value), baseline=sum(averaged) / len(averaged),
                  baseline_note="mean of the tasks' baselines", headline=True)
        )  # fmt: skip
        scores += rows if len(tasks) > 1 else []
    return scores


def generator_note(f: Family) -> str:
    """What a decoder family's generator fine-tune is, and its share of the headless arm's
    FLOPs (the fine-tune's tokens at the vanilla arm's FLOPs per token)."""
    if not f.generates:
        return ""
    from hlm_ray.budget import flops_per_step

    headless = f.arm_config("headless")
    pretrain = (f.flops if f.budget == "flops"
                else f.steps("headless") * flops_per_step(headless, vocab_size_of(headless)))  # fmt: skip
    ft = f.finetune_flops()
    how = (f"{f.finetune_steps():,} steps of {f.generator['optim.global_batch_size']} sequences "
           f"at lr {f.generator['optim.lr']:g}" if f.generator
           else f"{f.finetune_steps():,} step(s), share {f.share:g} of its pretraining tokens")  # fmt: skip
    said = f"the headless arm's generator fine-tune: {how} = {f.finetune_tokens():,} tokens, {ft:.3g} FLOPs"
    if f.budget == "seconds":
        return said + " (not in its seconds)"
    return (
        said
        + f", {ft / (pretrain + ft):.1%} of the arm's compute; the vanilla arm gets as much more"
    )


def lr_note(f: Family) -> str:
    if not f.lrs:
        return ""
    rates = ", ".join(f"{arm} {lr:g}" for arm, lr in f.lrs.items())
    return f"learning rates: {rates} ({f.lr_note})"


READOUT_LABELS = {
    "bpb/prior": "bits per byte, headless read through its prior (no fine-tune)",
    "bpb/tied": "bits per byte, headless read through its tied embeddings (no fine-tune)",
}


def readout_scores(family: str) -> list:
    """The headless decoder's other readouts (`hlm_ray.evaluate.readouts`) against the vanilla
    decoder's own head, each beside the same floor."""
    from hlm_ray.tune.report import Score

    return [
        Score(key, label, family, higher_is_better=False, floor_key="bpb/unigram_floor",
              arm_keys=(("headless", key), ("vanilla", "bpb")))
        for key, label in READOUT_LABELS.items()
    ]  # fmt: skip


def compute_note(name: str, f: Family, per_step: int) -> str:
    """A compute-budget family's line: what each arm was given and what it became."""
    v = vocab_size_of(f.config())
    head = f"`{name}` ({f.preset}, V = {v:,}; {f.paper})"
    extra = [x for x in (generator_note(f), lr_note(f)) if x]
    tail = ("; " + "; ".join(extra)) if extra else ""
    if f.budget == "seconds":
        return (
            f"{head}: each arm trains for {f.seconds:g} s of measured training time "
            f"(`budget.seconds`; at most {f.pretrain_steps():,} steps, the schedule's length); "
            "the steps each reached are its trials' `steps` in summary.md" + tail + "."
        )
    arms = "; ".join(
        f"{o}: {f.flops_budget(o):.3g} FLOPs = {f.steps(o):,} steps × {per_step:,} tokens "
        f"= {f.steps(o) * per_step:,} tokens"
        for o in ("headless", "vanilla")
    )
    return (
        f"{head}: equal FLOPs (`budget.flops`, `hlm_ray.flops`), {arms} (headless steps at the "
        f"dry run's bound U; the worker measures U and may give it more){tail}."
    )


def budget_notes(spec: SweepSpec) -> list[str]:
    notes = []
    for value in spec.values:
        f = FAMILIES[str(value)]
        per_step = f.tokens_per_step()
        if f.budget != "tokens":
            notes.append(compute_note(str(value), f, per_step))
            continue
        line = (
            f"`{value}` ({f.preset}; {f.paper or 'smoke scale'}): both arms pretrain "
            f"{f.pretrain_steps():,} steps × {per_step:,} tokens = {f.pretrain_steps() * per_step:,}"
            " tokens"
        )
        if f.generates:
            line += (
                f"; {generator_note(f)} (the vanilla arm pretrains {f.steps('vanilla'):,} steps "
                f"= {f.steps('vanilla') * per_step:,} tokens: the same total)"
            )
        if f.lrs:
            line += f"; {lr_note(f)}"
        notes.append(line + ".")
    notes.append(
        "Baselines: GLUE tasks the majority class of the evaluation rows (accuracy = its share, "
        "CoLA MCC = 0), XNLI chance (1/3), LAMBADA accuracy the most frequent final word of the "
        "scored passages; LAMBADA perplexity and bits per byte the unigram model of each run's own "
        "training tokens, scored on the same texts (their floor); a row where an arm does not beat "
        "its baseline or floor gets no verdict."
    )
    notes.append(
        "The GLUE/XNLI files here are dev sets, split into fine-tuning and evaluation rows "
        "(`hlm_ray.classify.tasks`): these are not GLUE dev scores."
    )
    return notes


def reached_notes(spec: SweepSpec, folder) -> list[str]:
    """What each arm of a compute-budget family really trained: steps and tokens from its
    trials' summary.json (mean over seeds; at equal seconds these are the result)."""
    import csv
    import json

    column = spec.axis.column[1]
    reached: dict[tuple[str, str], list[tuple[int, int]]] = {}
    with (folder / "summary.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            path = folder / "trials" / row["run"] / "summary.json"
            family = FAMILIES.get(row[column])
            if row["status"] != "FINISHED" or family is None or family.budget == "tokens":
                continue
            if path.is_file():
                s = json.loads(path.read_text())
                reached.setdefault((row[column], row["objective"]), []).append(
                    (int(s["steps"]), int(s["tokens"]))
                )
    notes = []
    for value in spec.values:
        arms = [
            (o, reached[(str(value), o)]) for o in spec.objectives if (str(value), o) in reached
        ]
        if arms:
            said = "; ".join(
                f"{o} {sum(s for s, _ in r) / len(r):,.0f} steps = {sum(t for _, t in r) / len(r):,.0f}"
                f" tokens" for o, r in arms
            )  # fmt: skip
            notes.append(f"`{value}` as trained (mean over seeds): {said}.")
    return notes


def write_report(spec: SweepSpec, name: str, preset: str, scores: list) -> list:
    """report.md, headline.png (the forest plot of the differences) and headline_arms.png (each
    arm's scores) in runs/sweeps/<name> (`scores`: `report_scores(spec)`), logged on the parent
    run."""
    from hlm_ray.paths import resolve_output
    from hlm_ray.tune import report
    from hlm_ray.tune.sweep import SWEEPS_DIR

    folder = resolve_output(SWEEPS_DIR) / name
    trials = report.read_trials(folder, spec.axis.column[1])
    rows = report.compare(trials, scores)
    seeds = f"{spec.num_seeds} seed{'s' if spec.num_seeds > 1 else ''}"
    title = f"Headless vs vanilla at equal budget: preset {preset}, {seeds} per arm"
    png = report.plot_forest(rows, folder / "headline.png", title=title)
    arms_png = report.plot_arms(rows, folder / "headline_arms.png", title=title)
    text = report.markdown(
        rows,
        title=title,
        scale=f"the {preset} scale",
        notes=[*budget_notes(spec), *reached_notes(spec, folder)],
        figure=png.name,
    )
    md = folder / "report.md"
    md.write_text(text)
    report.log_to_parent(folder, [md, png, arms_png], text, spec.experiment)
    return [md, png, arms_png]


CURVE_FAMILIES = {"tiny": ("tiny-encoder-curve",), "cpu": ("bert-cpu-curve",)}
"""What `--curve` sweeps per preset: the encoder, whose GLUE average leaves chance at this scale
(the decoders' LAMBADA accuracy stays at 0, a flat curve)."""


def add_curve_flag(parser: argparse.ArgumentParser) -> None:
    presets = ", ".join(CURVE_FAMILIES)
    parser.add_argument(
        "--curve",
        action="store_true",
        help=f"the data-efficiency curve (presets {presets}): the preset's encoder family, its "
        "checkpoints at 25%%, 50%% and 100%% of the budget scored (default name <sweep>-<preset>-curve)",
    )


def curve_args(args: argparse.Namespace, axis: Axis) -> None:
    """--curve: sweep the preset's curve families (after any --set sweep.values), into
    runs/sweeps/<sweep>-<preset>-curve unless --name says otherwise."""
    if not args.curve:
        return
    if args.preset not in CURVE_FAMILIES:
        raise HLMError(f"--curve runs with --preset {', '.join(CURVE_FAMILIES)}")
    args.set = [*args.set, f"sweep.values=[{','.join(CURVE_FAMILIES[args.preset])}]"]
    args.name = args.name or f"{axis.name}-{args.preset}-curve"


def write_reports(spec: SweepSpec, name: str, preset: str) -> list[Path]:
    """report.md and headline.png; with curve families, the curve appended to report.md and
    curve.png. The files, report.md first."""
    scores = report_scores(spec)  # reads the tasks' files for their baselines: once
    files = write_report(spec, name, preset, scores)
    if any(FAMILIES[str(v)].curve for v in spec.values):
        text, more = write_curve(spec, name, next(s for s in scores if s.headline))
        with files[0].open("a") as f:
            f.write("\n" + text)
        files += more
    return files


def write_curve(spec: SweepSpec, name: str, score) -> tuple[str, list]:
    """Score each trial's kept checkpoints (`hlm_ray.tune.curve`), draw curve.png of the
    headline `score`; a Markdown table of the points (mean ± sd over seeds per arm and step)
    and the files."""
    from hlm_ray.budget import flops_per_step
    from hlm_ray.paths import resolve_output
    from hlm_ray.tune import curve, stats
    from hlm_ray.tune.sweep import SWEEPS_DIR

    folder = resolve_output(SWEEPS_DIR) / name
    per_step = {
        (str(v), o): flops_per_step(FAMILIES[str(v)].arm_config(o),
                                    vocab_size_of(FAMILIES[str(v)].config()))
        for v in spec.values for o in spec.objectives
    }  # fmt: skip
    points = curve.score_checkpoints(folder, spec.recipe, flops_per_step=per_step,
                                     value_column=spec.axis.column[1])  # fmt: skip
    png = folder / "curve.png"
    curve.plot_curve(points, png, key=score.key, y_label=score.label,
                           baseline=score.baseline,
                           title=f"{score.label} at 25%, 50%, 100% of the budget: {name}, "
                                 f"{spec.num_seeds} seeds per arm")  # fmt: skip
    lines = [f"## Data efficiency: {score.label} during pretraining", "",
             "| family | arm | step | tokens | FLOPs | score (mean ± sd over seeds) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    keys = sorted({(p["value"], p["objective"], p["step"]) for p in points})
    for value, arm, step in keys:
        at = [p for p in points if (p["value"], p["objective"], p["step"]) == (value, arm, step)]
        s = stats.describe([p["scores"].get(score.key, math.nan) for p in at])
        sd = f" ± {s.sd:.4f}" if math.isfinite(s.sd) else ""
        lines.append(f"| {value} | {arm} | {step:,} | {at[0]['tokens']:,.0f} | "
                     f"{at[0]['flops']:.3g} | {s.mean:.4f}{sd} (n={s.n}) |")  # fmt: skip
    lines += ["", f"![curve]({png.name})"]
    return "\n".join(lines) + "\n", [folder / "curve.png"]
