"""The paper's compute claim as a compute multiplier: a headless and a vanilla decoder trained at
budgets in FLOPs spaced geometrically, each arm at its own tuned learning rate, both fitted
(bits per byte of held-out text against compute), and the compute the vanilla arm needs to
reach the headless arm's loss, with a 95% interval over seeds.

    python sweeps/scaling.py --preset tiny             # the smoke test: minutes, 2 CPUs
    python sweeps/scaling.py --preset cpu --dry-run    # every trial: budget, arm, lr, seed
    python sweeps/scaling.py --preset cpu              # GPT-2 tokenizer, 4 budgets × 3 seeds
    python sweeps/scaling.py --preset paper --dry-run  # pythia-70m budgets: the cost plan
    python sweeps/scaling.py --preset cpu --set sweep.search_lr=[3e-4,3e-2] --set sweep.search_samples=5

One command runs three sweeps (`hlm_ray.tune.scaling`): `<name>-lr`, each arm at each learning
rate of the search at the smallest budget; `<name>`, every budget × arm × seed at the rate its
arm's search chose (recorded on the parent run, `sweep.arm_overrides`); `<name>-shared-lr`,
the budgets again at the preset's `optim.lr` for an arm whose search chose another. Then
`hlm_ray.tune.scaling_report` writes runs/sweeps/<name>/report.md and its figures (also on the
parent MLflow run): the fits, the multiplier against FLOPs and against seconds, tuned and
shared. The same `--name` resumes all three.
"""

import sys

from hlm_ray.tune.axis import Axis, Figure
from hlm_ray.tune.cli import SweepScript
from hlm_ray.tune.families import GPT2_CPU_SETTINGS, OPENWEBTEXT
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
    description="Loss against training FLOPs for both arms, each at its own tuned learning "
    "rate, and the compute multiplier with its interval.",
)

# Each arm at its fastest: the headless table updated row-wise (its step cost flat in V); the
# vanilla GPT-2's tied table feeds its head, so it stays dense.
EMBEDDING_UPDATE = ("headless:optim.embedding_update=lazy", "vanilla:optim.embedding_update=dense")
# Budgets decide the steps, and each trial warms up over a tenth of its own; the final step is
# always evaluated and checkpointed.
SHORT_RUNS = {"budget.warmup_share": 0.1, "run.eval_every": 1_000_000, "run.eval_batches": 2}

# tiny: the tiny GPT-2 (its own 1k BPE), 9-46 steps, one seed (no interval: the smoke test).
TINY = {"optim.global_batch_size": 16, "run.log_every": 10, "run.checkpoint_every": 20}
TINY |= SHORT_RUNS
# cpu: d=128, 2 layers, the GPT-2 tokenizer (V = 50,257, where the head is 94% of a vanilla
# step); 1,024 tokens a step (one micro-batch: K = 1,008 rows), so the smallest budget still
# buys the vanilla arm 7 steps (the headless arm 88 at the bound U); 1.2T is the headline
# comparison's equal-FLOPs budget.
CPU = {k: v for k, v in GPT2_CPU_SETTINGS.items() if k != "optim.warmup_steps"}
CPU |= {"optim.global_batch_size": 16, "run.log_every": 50, "run.checkpoint_every": 250}
CPU |= SHORT_RUNS
# paper: pythia-70m on OpenWebText; its full run (143k steps) is 7.2e19 FLOPs headless.
PAPER = {"data.sources": OPENWEBTEXT, "budget.warmup_share": 0.01}


def preset(model: str, settings: dict, values, **fields) -> SweepSpec:
    overrides = tuple(f"{k}={v}" for k, v in settings.items())
    return SweepSpec(
        AXIS,
        model,
        tuple(values),
        overrides=overrides,
        arm_overrides=EMBEDDING_UPDATE if fields.pop("lazy", True) else (),
        **fields,
    )


PRESETS = {
    "tiny": preset(
        "tiny-gpt2",
        TINY,
        ("10G", "20G", "40G"),
        num_seeds=1,
        recipe="scaling-tiny",
        search_lr=(3e-3, 1e-2),
        search_samples=2,
    ),
    "cpu": preset(
        "tiny-gpt2",
        CPU,
        ("300G", "600G", "1.2T", "2.4T"),
        num_seeds=3,
        recipe="scaling-cpu",
        search_lr=(1e-3, 1e-2),
        search_samples=3,
    ),
    "paper": preset(
        "pythia-70m",
        PAPER,
        ("250P", "1E", "4E", "16E", "64E"),
        num_seeds=3,
        recipe="scaling-paper",
        search_lr=(1e-4, 1e-2),
        search_samples=5,
        workers_per_trial=8,
        cpus_per_worker=4,
        gpus_per_worker=1,
        lazy=False,
    ),
}
SCRIPT = SweepScript(
    AXIS, PRESETS, adjust=refuse_search, plan=plan_text, run=run_parts, report=write_report
)
main = SCRIPT.main

if __name__ == "__main__":
    sys.exit(main())
