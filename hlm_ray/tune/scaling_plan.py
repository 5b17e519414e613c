"""What the scaling sweep's dry run and report say about its arms before any number is measured:
each arm's optimizer steps at each budget (the headless arm's at the bound U, which real text
only lowers), the generator fine-tune's steps and FLOPs, and the head's share of a vanilla step.

    print("\n".join(arm_lines(spec)))      # the head's share, then a table per budget
    generator_cost(spec)                   # GeneratorCost(steps=40, tokens=10240, flops=4.2e10)
"""

from __future__ import annotations

from dataclasses import dataclass

from hlm_ray.tune.spec import SweepSpec


@dataclass(frozen=True)
class GeneratorCost:
    """The headless arm's generator fine-tune: the same at every budget."""

    steps: int
    tokens: int
    flops: float
    """Its tokens at the vanilla arm's FLOPs per token (a new head of the same vocabulary)."""


def generator_cost(spec: SweepSpec) -> GeneratorCost:
    from hlm_ray.budget import flops_per_step, tokens_per_step
    from hlm_ray.config import apply_overrides
    from hlm_ray.downstream import DOWNSTREAM
    from hlm_ray.finetune.clm import RECIPES
    from hlm_ray.tune.families import vocab_size_of
    from hlm_ray.tune.scaling import budgets

    plan = DOWNSTREAM[spec.recipe]
    settings = {**RECIPES[plan["clm_recipe"]], **plan.get("clm_settings", {})}
    vanilla = spec.cell_config(budgets(spec)[0], "vanilla", 0)
    per_token = flops_per_step(vanilla, vocab_size_of(vanilla)) / tokens_per_step(vanilla)
    clm = apply_overrides(vanilla, {"optim.global_batch_size": settings["optim.global_batch_size"],
                                    "optim.micro_batch_size": 1})  # fmt: skip
    steps = int(settings["optim.max_steps"])
    tokens = steps * tokens_per_step(clm)
    return GeneratorCost(steps, tokens, tokens * per_token)


def arm_lines(spec: SweepSpec) -> list[str]:
    """The dry run's lines: the head's share of a vanilla step, then per budget each arm's
    optimizer steps and tokens and the fine-tune's share of the headless arm's FLOPs."""
    from hlm_ray.budget import flops_per_step
    from hlm_ray.flops import config_step_flops
    from hlm_ray.tune.families import flops_steps, vocab_size_of
    from hlm_ray.tune.scaling import budgets, flops_of

    first = budgets(spec)[0]
    vanilla = spec.cell_config(first, "vanilla", 0)
    headless = spec.cell_config(first, "headless", 0)
    v = vocab_size_of(vanilla)
    share = config_step_flops(vanilla, v).head_share
    ratio = flops_per_step(vanilla, v) / flops_per_step(headless, v)
    gen = generator_cost(spec)
    per_step = vanilla.optim.global_batch_size * vanilla.data.seq_len
    lines = [
        f"the vocabulary head is {share:.0%} of a vanilla step's FLOPs (V = {v:,}, d = "
        f"{vanilla.model.hidden_size}, {vanilla.model.num_layers} layers); a vanilla step costs "
        f"{ratio:.2f}× a headless one; embedding update: headless "
        f"{headless.optim.embedding_update}, vanilla {vanilla.optim.embedding_update}",
        f"the headless arm's generator fine-tune: {gen.steps} optimizer steps, {gen.tokens:,} "
        f"tokens, {gen.flops:.3g} FLOPs (charged to the headless arm)",
        "",
        "| budget | vanilla steps | headless steps (bound U) | tokens per step | fine-tune share "
        "of the headless arm's FLOPs |",
        "|---|---|---|---|---|",
    ]
    for budget in budgets(spec):
        flops = flops_of(budget)
        steps = {
            a: flops_steps(spec.cell_config(budget, a, 0), flops) for a in ("vanilla", "headless")
        }
        lines.append(
            f"| {budget} | {steps['vanilla']:,} | {steps['headless']:,} | {per_step:,} | "
            f"{gen.flops / (flops + gen.flops):.1%} |"
        )
    return lines
