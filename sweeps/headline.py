"""The paper's headline comparisons (Table 1: encoders on GLUE; Table 3: decoders on LAMBADA after
the headless model is fine-tuned into a generator): headless vs vanilla at an equal budget, with
seeds, in one sweep, one MLflow parent run and one report.

    python sweeps/headline.py --preset tiny            # the smoke test: ~2 minutes, 2 CPUs
    python sweeps/headline.py --preset cpu             # 2 cores, 6 families × 2 arms × 3 seeds
    python sweeps/headline.py --preset paper --dry-run # bert-base, pythia-70m, multilingual
    python sweeps/headline.py --preset cpu --num-seeds 5 --name headline-cpu-5
    python sweeps/headline.py --preset cpu --curve     # score at 25/50/100% of the budget

The axis is the model family (each value a preset plus the settings below), × {headless,
vanilla} × seeds. Both arms of a family get the same pretraining budget: in tokens, or (the
`-flops` / `-seconds` families, GPT-2 tokenizer) in FLOPs or measured training seconds; a headless
decoder is then fine-tuned into a generator on `share` of its pretraining tokens (the paper:
under 2%), and the vanilla decoder pretrains on that many tokens more (the same total). Each
trial's downstream protocol is `hlm_ray.downstream.DOWNSTREAM["headline-<preset>"]`: GLUE-style
tasks (SST-2, CoLA, MRPC, RTE, QNLI; the average leaves RTE out, as the paper's does) for
English encoders, XNLI zero-shot for the multilingual one, LAMBADA accuracy, perplexity and bits
per byte for decoders.

When the trials are done, `hlm_ray.tune.report` compares the arms (mean ± sd over seeds, the
difference with a Welch 95% interval, each score beside its chance / majority-class baseline,
a verdict per family) and writes runs/sweeps/<name>/report.md and headline.png, also logged on
the parent run (artifacts and its description). `--set` config overrides apply to what the
families leave to the base preset; a family's own settings (below) win.
"""

import math
import sys
from dataclasses import dataclass
from functools import cache
from typing import Any

from hlm_ray.classify.tasks import XNLI_LANGUAGES
from hlm_ray.config import Config, flatten
from hlm_ray.presets import load_config
from hlm_ray.tune.axis import Axis, Value
from hlm_ray.tune.spec import SweepSpec

# The sections a family may set; the objective and the seed are the grid's.
SECTIONS = ("model", "tokenizer", "data", "optim", "run")
RUN_FIELDS_OF_THE_TRIAL = ("run.output_dir", "run.seed", "run.device", "run.fail_at_step")


@dataclass(frozen=True)
class Family:
    """One row group of the report: a model (a preset and overrides) and its budget."""

    preset: str
    overrides: dict[str, Any]
    tokens: int
    """Pretraining tokens of each arm (rounded down to whole optimizer steps)."""
    share: float | None = None
    """Decoders: the headless arm's generator fine-tune, as a share of its pretraining tokens;
    the vanilla arm pretrains on as many tokens more. None: encoders (the GLUE fine-tune is the
    same for both arms)."""
    clm_tokens_per_step: int | None = None
    """Tokens per step of the generator fine-tune (its recipe's batch × seq_len)."""
    paper: str = ""
    """What it reproduces."""
    budget: str = "tokens"
    """What the arms share: tokens (`tokens` each), flops (`flops` each: each arm trains on
    the tokens its head lets it afford) or seconds (`seconds` of measured training each, up
    to `tokens` worth of steps, which is also the schedule's length)."""
    flops: float | None = None
    seconds: float | None = None
    curve: bool = False
    """Keep checkpoints at 25%, 50% and 100% of each arm's steps (`--curve` scores them)."""

    def config(self) -> Config:
        return load_config(self.preset, overrides=dict(self.overrides))

    def pretrain_steps(self) -> int:
        cfg = self.config()
        return self.tokens // (cfg.optim.global_batch_size * cfg.data.seq_len)

    def finetune_steps(self) -> int | None:
        """The headless arm's generator fine-tune steps (what `run_downstream` derives)."""
        if self.share is None:
            return None
        cfg = self.config()
        pretrain_tokens = self.pretrain_steps() * cfg.optim.global_batch_size * cfg.data.seq_len
        return max(1, math.floor(self.share * pretrain_tokens / self.clm_tokens_per_step))

    def steps(self, objective: str) -> int:
        """Pretraining steps of an arm: the budget, plus the fine-tune's tokens for a vanilla
        decoder (in its own steps, rounded to the nearest). At equal FLOPs: the steps the
        arm's `flops_budget` buys (the dry run's bound U for the headless arm)."""
        if self.budget == "flops":
            return flops_steps(self.arm_config(objective), self.flops_budget(objective))
        steps = self.pretrain_steps()
        if self.share is None or objective == "headless" or self.budget == "seconds":
            return steps
        cfg = self.config()
        extra_tokens = self.finetune_steps() * self.clm_tokens_per_step
        return steps + round(extra_tokens / (cfg.optim.global_batch_size * cfg.data.seq_len))

    def arm_config(self, objective: str) -> Config:
        from hlm_ray.config import apply_overrides

        return apply_overrides(self.config(), {"objective.name": objective})

    def flops_budget(self, objective: str) -> float:
        """`flops` for both arms, plus for a vanilla decoder the FLOPs of its headless twin's
        generator fine-tune (`share` of the headless arm's pretraining tokens, priced at the
        vanilla arm's FLOPs per token: a new head of the same vocabulary)."""
        if self.share is None or objective == "headless":
            return self.flops
        from hlm_ray.budget import flops_per_step, tokens_per_step

        headless = self.arm_config("headless")
        vanilla = self.arm_config("vanilla")
        headless_tokens = flops_steps(headless, self.flops) * tokens_per_step(headless)
        v = vocab_size_of(vanilla)
        per_token = flops_per_step(vanilla, v) / tokens_per_step(vanilla)
        return self.flops + self.share * headless_tokens * per_token


def vocab_size_of(cfg: Config) -> int:
    """The arm's vocabulary (a tokenizer file is loaded once per path)."""
    t = cfg.tokenizer
    return _vocab_size(t.kind, t.path, t.vocab_size) if t.kind == "file" else t.vocab_size


@cache
def _vocab_size(kind: str, path: str | None, size: int) -> int:
    from hlm_ray.config import apply_overrides
    from hlm_ray.plan import vocab_size_of as size_of
    from hlm_ray.presets import load_config

    cfg = load_config("tiny-encoder")
    return size_of(apply_overrides(cfg, {"tokenizer.kind": kind, "tokenizer.path": path}))


def flops_steps(cfg: Config, flops: float) -> int:
    """The steps `flops` buys an arm (`hlm_ray.budget`'s floor rule; U at its bound)."""
    from hlm_ray.budget import flops_per_step

    return math.floor(flops / flops_per_step(cfg, vocab_size_of(cfg)))


# The paper's corpora, by hub name (OpenWebText2 is not on the hub; OpenWebText is its nearest).
OPENWEBTEXT = ["Skylion007/openwebtext"]
WIKIPEDIA = [f"wikimedia/wikipedia:20231101.{lang}" for lang in XNLI_LANGUAGES]
_TINY_RUN = {"run.log_every": 10, "run.eval_every": 20, "run.checkpoint_every": 20}
_TINY_RUN |= {"run.eval_batches": 2}
# The cpu families' model and optimizer: d=128, 2 layers, a 4k BPE (both families, both arms).
CPU_SETTINGS = {
    "model.hidden_size": 128,
    "model.num_layers": 2,
    "model.num_heads": 2,
    "tokenizer.vocab_size": 4096,
    "optim.lr": 1e-3,
    "optim.warmup_steps": 30,
    "run.log_every": 50,
    "run.eval_every": 300,
    "run.checkpoint_every": 300,
}
# The paper's decoder tokenizer (GPT-2, 50,257 tokens; shipped in the data folder), for the
# equal-compute rows: the head is then most of a vanilla step, which the compute budgets price.
GPT2_CPU_SETTINGS = {
    **{k: v for k, v in CPU_SETTINGS.items() if k != "tokenizer.vocab_size"},
    "tokenizer.kind": "file",
    "tokenizer.path": "tokenizers/gpt2",
    "optim.warmup_steps": 5,
}
# Equal FLOPs, for every arm at V = 50,257: ~116 vanilla encoder steps, ~30 vanilla decoder steps,
# ~380 headless encoder steps (the dry run lists them).
CPU_FLOPS = 2e12
# Equal seconds: measured training time of each arm (the deadline of `budget.seconds`).
CPU_SECONDS = 60.0
# The generator recipes' batches (hlm_ray.finetune.clm.RECIPES): tiny 32, text 256 sequences.
FAMILIES: dict[str, Family] = {
    # tiny: the smoke test (seconds of training; scores stay at chance).
    "tiny-encoder": Family(
        "tiny-encoder", {**_TINY_RUN, "optim.warmup_steps": 4}, tokens=40 * 32 * 64
    ),
    "tiny-gpt2": Family(
        "tiny-gpt2",
        {**_TINY_RUN, "optim.warmup_steps": 4},
        tokens=40 * 32 * 64,
        share=0.02,
        clm_tokens_per_step=32 * 64,
    ),
    # cpu, equal tokens: these two families took 16 min on 2 loaded cores; GLUE leaves chance.
    "bert-cpu": Family(
        "tiny-encoder",
        CPU_SETTINGS,
        tokens=600 * 32 * 64,
        paper="Table 1 (bert-base, GLUE) at CPU scale",
    ),
    "gpt2-cpu": Family(
        "tiny-gpt2",
        CPU_SETTINGS,
        tokens=600 * 32 * 64,
        share=0.02,
        clm_tokens_per_step=32 * 64,
        paper="Table 3 (pythia-70m, LAMBADA) at CPU scale",
    ),
    "tiny-encoder-curve": Family(
        "tiny-encoder", {**_TINY_RUN, "optim.warmup_steps": 4}, tokens=40 * 32 * 64, curve=True
    ),
    # --curve: bert-cpu with its checkpoints at 25%, 50% and 100% of the budget kept and scored.
    "bert-cpu-curve": Family(
        "tiny-encoder",
        CPU_SETTINGS,
        tokens=600 * 32 * 64,
        curve=True,
        paper="Figures 3-4 (score against pretraining tokens) at CPU scale",
    ),
    # cpu, equal compute (Table 1's equal GPU-hours row, Figure 7): the GPT-2 tokenizer for
    # the decoder and, matching it, for the encoder; every arm the same FLOPs, or the same
    # measured training seconds (up to 1,200 steps, the schedule's length).
    "bert-cpu-flops": Family(
        "tiny-encoder",
        GPT2_CPU_SETTINGS,
        tokens=600 * 32 * 64,
        budget="flops",
        flops=CPU_FLOPS,
        paper="Table 1's equal-compute row at CPU scale (GPT-2 tokenizer, equal FLOPs)",
    ),
    "gpt2-cpu-flops": Family(
        "tiny-gpt2",
        GPT2_CPU_SETTINGS,
        tokens=600 * 32 * 64,
        share=0.02,
        clm_tokens_per_step=32 * 64,
        budget="flops",
        flops=CPU_FLOPS,
        paper="Table 3 at equal FLOPs, CPU scale (GPT-2 tokenizer)",
    ),
    "bert-cpu-seconds": Family(
        "tiny-encoder",
        GPT2_CPU_SETTINGS,
        tokens=1200 * 32 * 64,
        budget="seconds",
        seconds=CPU_SECONDS,
        paper="Table 1's equal GPU-hours row at CPU scale (GPT-2 tokenizer, equal seconds)",
    ),
    "gpt2-cpu-seconds": Family(
        "tiny-gpt2",
        GPT2_CPU_SETTINGS,
        tokens=1200 * 32 * 64,
        share=0.02,
        clm_tokens_per_step=32 * 64,
        budget="seconds",
        seconds=CPU_SECONDS,
        paper="Table 3 at equal training seconds, CPU scale (GPT-2 tokenizer)",
    ),
    # paper: the models and budgets of Tables 1, 3 and 8 (a cluster).
    "bert-base": Family(
        "bert-base",
        {"data.sources": OPENWEBTEXT},
        tokens=1_000_000 * 256 * 128,
        paper="Table 1: GLUE, bert-base, 1M steps of 256 × 128 tokens",
    ),
    "pythia-70m": Family(
        "pythia-70m",
        {"data.sources": OPENWEBTEXT},
        tokens=143_000 * 1024 * 2048,
        share=0.02,
        clm_tokens_per_step=256 * 2048,
        paper="Table 3: LAMBADA, pythia-70m, 143k steps of 1024 × 2048 tokens",
    ),
    "distilbert-multilingual": Family(
        "distilbert-multilingual",
        # The hub tokenizer's size (what the plan prices where the hub is unreachable).
        {"data.sources": WIKIPEDIA, "optim.micro_batch_size": 8, "tokenizer.vocab_size": 119_547},
        tokens=400_000 * 64 * 128,
        paper="Table 8: XNLI zero-shot, distilbert-multilingual, 400k steps of 64 × 128",
    ),
}


def family_settings(value: Value, workers: int) -> dict[str, Any]:
    """The family's config (every field of its sections the trial does not set itself)."""
    family = FAMILIES[str(value)]
    flat = dict(flatten(family.config().to_dict()))
    keep = {
        k: v
        for k, v in flat.items()
        if k.split(".")[0] in SECTIONS and k not in RUN_FIELDS_OF_THE_TRIAL
    }
    keep["preset"] = family.preset
    return {**keep, **arm_settings(value, "headless")}


def arm_settings(value: Value, objective: str) -> dict[str, Any]:
    """The arm's budget (`budget.tokens`, which the run logs as budget/*) and the steps it
    becomes (`hlm_ray.budget`'s floor rule; set here too so a resumed trial knows its length).
    A vanilla decoder pretrains on its headless twin's fine-tuning tokens too."""
    family = FAMILIES[str(value)]
    cfg = family.config()
    steps = family.steps(objective)
    if family.curve:  # checkpoints at the curve's steps, all kept
        from hlm_ray.tune.curve import checkpoint_settings

        return {
            "optim.max_steps": steps,
            "budget.tokens": steps * cfg.optim.global_batch_size * cfg.data.seq_len,
            **checkpoint_settings(steps),
        }
    if family.budget == "flops":  # the worker turns the FLOPs into steps (U measured)
        return {"optim.max_steps": steps, "budget.flops": family.flops_budget(objective)}
    if family.budget == "seconds":  # a deadline; max_steps is the cap and the schedule
        return {"optim.max_steps": steps, "budget.seconds": family.seconds}
    return {
        "optim.max_steps": steps,
        "budget.tokens": steps * cfg.optim.global_batch_size * cfg.data.seq_len,
    }


def check_families(spec: SweepSpec) -> None:
    from hlm_ray.errors import HLMError

    unknown = [v for v in spec.values if str(v) not in FAMILIES]
    if unknown:
        raise HLMError(
            f"sweep.values: unknown family {unknown[0]!r}; choose from {', '.join(FAMILIES)}"
        )
    if set(spec.objectives) != {"headless", "vanilla"}:
        raise HLMError("the headline comparison needs sweep.objectives=[headless,vanilla]")
    if not spec.recipe.startswith("headline-"):
        raise HLMError(
            f"sweep.recipe={spec.recipe}: the headline report needs its downstream scores; "
            "use headline-tiny, headline-cpu or headline-paper"
        )


AXIS = Axis(
    name="headline",
    field="preset",
    short="f",
    label="model family",
    column=("family", "family"),
    description="Headless vs vanilla at equal budget, with seeds (paper Tables 1 and 3).",
    settings=family_settings,
    arm_settings=arm_settings,
    check=check_families,
)

PRESETS = {
    "tiny": SweepSpec(
        axis=AXIS,
        base="tiny-encoder",
        values=("tiny-encoder", "tiny-gpt2"),
        num_seeds=2,
        recipe="headline-tiny",
    ),
    "cpu": SweepSpec(
        axis=AXIS,
        base="tiny-encoder",
        values=(
            "bert-cpu",
            "gpt2-cpu",
            "bert-cpu-flops",
            "gpt2-cpu-flops",
            "bert-cpu-seconds",
            "gpt2-cpu-seconds",
        ),
        num_seeds=3,
        recipe="headline-cpu",
    ),
    "paper": SweepSpec(
        axis=AXIS,
        base="bert-base",
        values=("bert-base", "pythia-70m", "distilbert-multilingual"),
        num_seeds=3,
        recipe="headline-paper",
        cpus_per_worker=4,
        gpus_per_worker=1,
        workers_per_trial=8,
    ),
}


# ------------------------------------------------------------------------------ the report

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
    from hlm_ray.classify.baselines import chance_baseline, majority_baseline
    from hlm_ray.classify.finetune import recipe as classify_recipe
    from hlm_ray.downstream import DOWNSTREAM
    from hlm_ray.tune.report import Score

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
                      fmt="{:.4g}"),
                Score("bpb", "bits per byte", str(value), higher_is_better=False),
            ]  # fmt: skip
            continue
        tasks = plan.get("tasks_by_model_type", {}).get(cfg.model.arch, plan["glue_tasks"])
        rows, averaged = [], []
        for task in tasks:
            if task.startswith("xnli:"):
                base, note = chance_baseline(task), "chance, 3 classes"
            else:
                settings = classify_recipe(plan["classify"], task)
                limit = plan.get("classify_settings", {}).get("eval_limit", settings.eval_limit)
                base, note = majority_baseline(task, eval_limit=limit), "majority class"
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


def compute_note(name: str, f: Family, per_step: int) -> str:
    """A compute-budget family's line: what each arm was given and what it became."""
    v = vocab_size_of(f.config())
    head = f"`{name}` ({f.preset}, V = {v:,}; {f.paper})"
    if f.budget == "seconds":
        return (
            f"{head}: each arm trains for {f.seconds:g} s of measured training time "
            f"(`budget.seconds`; at most {f.pretrain_steps():,} steps, the schedule's length); "
            "the steps each reached are its trials' `steps` in summary.md"
            + ("; the headless arm's generator fine-tune is not in the seconds" if f.share
               else "") + "."
        )  # fmt: skip
    arms = "; ".join(
        f"{o}: {f.flops_budget(o):.3g} FLOPs = {f.steps(o):,} steps × {per_step:,} tokens "
        f"= {f.steps(o) * per_step:,} tokens"
        for o in ("headless", "vanilla")
    )
    extra = (
        "; the vanilla arm's FLOPs include its twin's generator fine-tune "
        f"(share {f.share:g} of the headless arm's tokens)"
        if f.share
        else ""
    )
    return (
        f"{head}: equal FLOPs (`budget.flops`, `hlm_ray.flops`), {arms} (headless steps at the "
        f"dry run's bound U; the worker measures U and may give it more){extra}."
    )


def budget_notes(spec: SweepSpec) -> list[str]:
    notes = []
    for value in spec.values:
        f = FAMILIES[str(value)]
        cfg = f.config()
        per_step = cfg.optim.global_batch_size * cfg.data.seq_len
        if f.budget != "tokens":
            notes.append(compute_note(str(value), f, per_step))
            continue
        line = (
            f"`{value}` ({f.preset}; {f.paper or 'smoke scale'}): both arms pretrain "
            f"{f.pretrain_steps():,} steps × {per_step:,} tokens = {f.pretrain_steps() * per_step:,}"
            " tokens"
        )
        if f.share is not None:
            ft = f.finetune_steps() * f.clm_tokens_per_step
            line += (
                f"; the headless arm is then fine-tuned into a generator for "
                f"{f.finetune_steps():,} step(s) = {ft:,} tokens (share {f.share:g} of its "
                f"pretraining tokens), and the vanilla arm pretrains {f.steps('vanilla'):,} steps "
                f"= {f.steps('vanilla') * per_step:,} tokens (the same total)"
            )
        notes.append(line + ".")
    notes.append(
        "Baselines: GLUE tasks the majority class of the evaluation rows (accuracy = its share, "
        "CoLA MCC = 0), XNLI chance (1/3), LAMBADA accuracy the most frequent final word of the "
        "scored passages; perplexity and bits per byte have no chance level."
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

    reached: dict[tuple[str, str], list[tuple[int, int]]] = {}
    with (folder / "summary.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            path = folder / "trials" / row["run"] / "summary.json"
            family = FAMILIES.get(row[AXIS.column[1]])
            if row["status"] != "FINISHED" or family is None or family.budget == "tokens":
                continue
            if path.is_file():
                s = json.loads(path.read_text())
                reached.setdefault((row[AXIS.column[1]], row["objective"]), []).append(
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


def write_report(spec: SweepSpec, name: str, preset: str) -> list:
    """report.md and headline.png in runs/sweeps/<name>, logged on the parent run."""
    from hlm_ray.paths import resolve_output
    from hlm_ray.tune import report
    from hlm_ray.tune.sweep import SWEEPS_DIR

    folder = resolve_output(SWEEPS_DIR) / name
    trials = report.read_trials(folder, AXIS.column[1])
    rows = report.compare(trials, report_scores(spec))
    seeds = f"{spec.num_seeds} seed{'s' if spec.num_seeds > 1 else ''}"
    title = f"Headless vs vanilla at equal budget: preset {preset}, {seeds} per arm"
    png = report.plot_arms(rows, folder / "headline.png", title=title)
    text = report.markdown(
        rows,
        title=title,
        scale=f"the {preset} scale",
        notes=[*budget_notes(spec), *reached_notes(spec, folder)],
        figure=png.name,
    )
    md = folder / "report.md"
    md.write_text(text)
    report.log_to_parent(folder, [md, png], text, spec.experiment)
    return [md, png]


CURVE_FAMILIES = {"tiny": ("tiny-encoder-curve",), "cpu": ("bert-cpu-curve",)}
"""What `--curve` sweeps per preset: the encoder, whose GLUE average leaves chance at this scale
(the decoders' LAMBADA accuracy stays at 0, a flat curve)."""


def curve_argv(argv: list[str]) -> tuple[list[str], bool]:
    """`argv` without --curve, and with the curve's families and sweep name when it was there."""
    if "--curve" not in argv:
        return argv, False
    from hlm_ray.errors import HLMError

    argv = [a for a in argv if a != "--curve"]
    preset = argv[argv.index("--preset") + 1] if "--preset" in argv else "tiny"
    if preset not in CURVE_FAMILIES:
        raise HLMError(f"--curve runs with --preset {', '.join(CURVE_FAMILIES)}")
    values = ",".join(CURVE_FAMILIES[preset])
    argv = [*argv, "--set", f"sweep.values=[{values}]"]
    if "--name" not in argv:
        argv += ["--name", f"{AXIS.name}-{preset}-curve"]
    return argv, True


def write_curve(spec: SweepSpec, name: str) -> tuple[str, list]:
    """Score each trial's kept checkpoints (`hlm_ray.tune.curve`), draw curve.png; a Markdown
    table of the points (mean ± sd over seeds per arm and step) and the files."""
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
                                     value_column=AXIS.column[1])  # fmt: skip
    score = next(s for s in report_scores(spec) if s.headline)
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


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The sweep (`hlm_ray.tune.cli.sweep_main`), then its report (`hlm sweep headline` passes
    its own `prog`); with `--curve`, the data-efficiency sweep and its curve."""
    from hlm_ray.errors import HLMError
    from hlm_ray.tune.cli import build_parser, sweep_main
    from hlm_ray.tune.spec import get_sweep

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv, with_curve = curve_argv(argv)
    except HLMError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    status = sweep_main(AXIS, PRESETS, argv, prog)
    args = build_parser(AXIS, PRESETS, prog).parse_args(argv)
    if args.dry_run or status not in (0, 1):
        return status
    flags = {"num_seeds": args.num_seeds, "workers_per_trial": args.workers_per_trial}
    items = [*args.set, *(f"sweep.{k}={v}" for k, v in flags.items() if v is not None)]
    try:
        spec = get_sweep(PRESETS, args.preset, items)
        name = args.name or f"{AXIS.name}-{args.preset}"
        files = write_report(spec, name, args.preset)
        if with_curve:
            text, more = write_curve(spec, name)
            with files[0].open("a") as f:
                f.write("\n" + text)
            files += more
    except HLMError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n" + files[0].read_text())
    print("report: " + ", ".join(str(p) for p in files))
    return status


if __name__ == "__main__":
    sys.exit(main())
