"""The paper's headline comparisons (Table 1: encoders on GLUE; Table 3: decoders on LAMBADA after
the headless model is fine-tuned into a generator): headless vs vanilla at an equal budget, with
seeds, in one sweep, one MLflow parent run and one report.

    python sweeps/headline.py --preset tiny            # the smoke test: ~2 minutes, 2 CPUs
    python sweeps/headline.py --preset cpu             # 2 cores, 6 families × 2 arms × 3 seeds
    python sweeps/headline.py --preset paper --dry-run # bert-base, pythia-70m, multilingual
    python sweeps/headline.py --preset cpu --num-seeds 5 --name headline-cpu-5
    python sweeps/headline.py --preset cpu --curve     # score at 25/50/100% of the budget

The axis is the model family (`hlm_ray.tune.families`: a preset, its settings and the budget
both arms share) × {headless, vanilla} × seeds. Each trial's downstream protocol is
`hlm_ray.downstream.DOWNSTREAM["headline-<preset>"]`: GLUE-style tasks (SST-2, CoLA, MRPC, RTE,
QNLI; the average leaves RTE out, as the paper's does) for English encoders, XNLI zero-shot for
the multilingual one, LAMBADA accuracy, perplexity and bits per byte for decoders.

When the trials are done, `hlm_ray.tune.headline` compares the arms (mean ± sd over seeds, the
difference with a Welch 95% interval, each score beside its chance / majority-class baseline,
a verdict per family) and writes runs/sweeps/<name>/report.md and headline.png, also logged on
the parent run. `--set` config overrides apply to what the families leave to the base preset;
a family's own settings win.
"""

import sys
from typing import Any

from hlm_ray.config import flatten
from hlm_ray.tune.axis import Axis, Value
from hlm_ray.tune.cli import SweepScript
from hlm_ray.tune.families import FAMILIES, arm_settings, check_families
from hlm_ray.tune.headline import add_curve_flag, curve_args, write_reports
from hlm_ray.tune.spec import SweepSpec

# The sections a family may set; the objective and the seed are the grid's.
SECTIONS = ("model", "tokenizer", "data", "optim", "run")
RUN_FIELDS_OF_THE_TRIAL = ("run.output_dir", "run.seed", "run.device", "run.fail_at_step")


def family_settings(value: Value, workers: int) -> dict[str, Any]:
    """The family's preset and config (every field of its sections the trial does not set
    itself), with the headless arm's budget (`arm_settings` gives each arm its own)."""
    family = FAMILIES[str(value)]
    flat = dict(flatten(family.config().to_dict()))
    keep = {
        k: v
        for k, v in flat.items()
        if k.split(".")[0] in SECTIONS and k not in RUN_FIELDS_OF_THE_TRIAL
    }
    keep["preset"] = family.preset
    return {**keep, **arm_settings(value, "headless")}


AXIS = Axis(
    name="headline",
    field="preset",
    settings=family_settings,
    arm_settings=arm_settings,
    check=check_families,
    short="f",
    label="model family",
    column=("family", "family"),
    description="Headless vs vanilla at equal budget, with seeds (paper Tables 1 and 3).",
)

PRESETS = {
    "tiny": SweepSpec(
        AXIS,
        base="tiny-encoder",
        values=("tiny-encoder", "tiny-gpt2"),
        num_seeds=2,
        recipe="headline-tiny",
    ),
    "cpu": SweepSpec(
        AXIS,
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
        AXIS,
        base="bert-base",
        values=("bert-base", "pythia-70m", "distilbert-multilingual"),
        num_seeds=3,
        recipe="headline-paper",
        cpus_per_worker=4,
        gpus_per_worker=1,
        workers_per_trial=8,
    ),
}

SCRIPT = SweepScript(AXIS, PRESETS, flags=add_curve_flag, adjust=curve_args, report=write_reports)
main = SCRIPT.main

if __name__ == "__main__":
    sys.exit(main())
