"""The paper's compute claim as a compute multiplier: a headless and a vanilla decoder trained at
budgets in FLOPs spaced geometrically, each arm at learning rates searched at the smallest and the
largest budget (interpolated between), both arms with the same (dense) embedding update; the
compute the vanilla arm needs to reach the headless arm's loss, read between vanilla's measured
budgets with a t interval over seeds; every score beside its floor, the unigram model of the
training tokens.

    python sweeps/scaling.py --preset tiny             # the smoke test: minutes, 2 CPUs
    python sweeps/scaling.py --preset cpu --dry-run    # every trial: budget, arm, lr, seed, steps
    python sweeps/scaling.py --preset cpu              # 2k BPE, 4 budgets over 8×, 3 seeds
    python sweeps/scaling.py --preset paper --dry-run  # pythia-70m budgets: the cost plan
    python sweeps/scaling.py --preset cpu --set sweep.search_lr=[1e-4,1e-2] --set sweep.search_samples=5

One command runs the learning-rate search (`<name>-lr`, and `<name>-lr+<k>-<arm>` past an edge of
the grid), the budgets (`<name>`) and, in the cpu preset, the vanilla arm again with its head's
bias started at the log prior of the training tokens (`<name>-prior`) (`hlm_ray.tune.scaling`);
then `hlm_ray.tune.scaling_report` writes runs/sweeps/<name>/report.md and its figures (also on
the parent MLflow run): the headless arm read three ways (fine-tuned, prior, tied), each against
both vanilla arms. The same
`--name` resumes every part. The generator fine-tune of the headless arm is the same at every
budget (`hlm_ray.finetune.generators.GENERATORS`, chosen by `hlm_ray.tune.generator_grid`), and its
FLOPs are charged to the headless arm.
"""

import sys

from hlm_ray.tune.axis import Axis, Figure
from hlm_ray.tune.cli import SweepScript
from hlm_ray.tune.families import DECODER_CPU_SETTINGS, OPENWEBTEXT
from hlm_ray.tune.scaling import budget_settings, check_budgets, plan_text, refuse_search, run_parts
from hlm_ray.tune.scaling_report import write_report
from hlm_ray.tune.spec import SweepSpec

AXIS = Axis(
    name="scaling",
    field="budget.flops",
    settings=budget_settings,  # "400G" -> budget.flops = 4e11
    check=check_budgets,
    short="c",
    label="training budget (FLOPs)",
    column=("budget (FLOPs)", "budget_flops"),
    figures=(Figure("bpb_vs_budget.png", "text_bpb", "bits per byte of held-out text"),),
    description="Loss against training FLOPs for both arms, each at its searched learning "
    "rates, and the compute multiplier with its interval.",
)

# Budgets decide the steps, and each trial warms up over a tenth of its own; the final step is
# always evaluated and checkpointed. Both arms update their embeddings densely (the tied table
# feeds vanilla's head): the arms differ in their objective alone.
SHORT_RUNS = {"budget.warmup_share": 0.1, "run.eval_every": 1_000_000, "run.eval_batches": 2}
SHORT_RUNS |= {"optim.embedding_update": "dense"}

# tiny: the tiny GPT-2 (its own 1k BPE), 9-46 steps, one seed, two rates at each end (no
# interval, no extension: the smoke test).
TINY = {"optim.global_batch_size": 16, "run.log_every": 10, "run.checkpoint_every": 20}
TINY |= SHORT_RUNS
# cpu: the cpu decoder (d=128, 2 layers, a 2,048-token BPE of the corpus: the head is 38% of a
# vanilla step, 45% at pythia-70m's shapes; 8 sequences of 64 tokens a step). 500G buys the
# vanilla arm 237 steps and the headless arm 332; 4T eight times as many.
CPU = {**DECODER_CPU_SETTINGS, "run.log_every": 50, "run.checkpoint_every": 500, **SHORT_RUNS}
# paper: pythia-70m on OpenWebText; its full run (143k steps) is 7.2e19 FLOPs headless.
PAPER = {"data.sources": OPENWEBTEXT, "budget.warmup_share": 0.01}


def preset(model: str, settings: dict, values, **fields) -> SweepSpec:
    return SweepSpec(AXIS, model, tuple(values), overrides=tuple(f"{k}={v}" for k, v in settings.items()), **fields)  # fmt: skip


PRESETS = {
    "tiny": preset(
        "tiny-gpt2",
        TINY,
        ("10G", "20G", "40G"),
        num_seeds=1,
        recipe="scaling-tiny",
        search_lr=(3e-3, 1e-2),
        search_samples=2,
        search_seeds=1,
        search_extend=0,
    ),
    "cpu": preset(
        "tiny-gpt2",
        CPU,
        ("500G", "1T", "2T", "4T"),
        num_seeds=3,
        recipe="scaling-cpu",
        search_lr=(3.162e-4, 3.162e-3),
        search_samples=3,
        search_seeds=2,
        search_extend=2,
        vanilla_prior_arm=True,
    ),
    "paper": preset(
        "pythia-70m",
        PAPER,
        ("250P", "1E", "4E", "16E", "64E"),
        num_seeds=3,
        recipe="scaling-paper",
        search_lr=(3e-4, 3e-3),
        search_samples=3,
        search_seeds=2,
        search_extend=1,
        workers_per_trial=8,
        cpus_per_worker=4,
        gpus_per_worker=1,
    ),
}
SCRIPT = SweepScript(
    AXIS, PRESETS, adjust=refuse_search, plan=plan_text, run=run_parts, report=write_report
)
main = SCRIPT.main

if __name__ == "__main__":
    sys.exit(main())
