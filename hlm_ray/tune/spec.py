"""What a sweep is: an `Axis` and its values × objectives × seeds, on a base config.

    spec = SweepSpec(axis=VOCAB, base="tiny-encoder", values=(512, 1024))
    spec = with_overrides(spec, ["optim.max_steps=20", "sweep.values=[512,768]"])
    spec = get_sweep(PRESETS, "tiny", ["sweep.num_seeds=2"])   # a script's named scales
    tiny_scale(VOCAB, "tiny-encoder", (1024, 8192))      # the demo scale of a script's PRESETS
    paper_scale(VOCAB, "bert-small", (16_384, 32_768))   # the paper's scale: CC-News, GPUs
    spec.cells()              # [{"value": 512, "objective": "headless", "seed": 0}, ...]
    spec.base_config()        # the validated Config every trial starts from
    SweepSpec(..., arm_overrides=("headless:optim.lr=3e-3", "vanilla:optim.lr=1e-3"))  # per arm
    SweepSpec(..., arm_overrides=("vanilla@500G:optim.lr=1e-3", ...))   # per arm and value

`--set sweep.FIELD=VALUE` sets a field below; any other `--set KEY=VALUE` is a config override
on the base preset (`optim.max_steps=20`). Invalid settings raise `HLMError` naming the option.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cache, partial
from typing import Any, Literal

import yaml

from hlm_ray.config import OBJECTIVES, Config, apply_overrides, build
from hlm_ray.errors import HLMError
from hlm_ray.presets import load_config
from hlm_ray.train.placement_wait import PLACEMENT_TIMEOUT_S
from hlm_ray.tune.axis import Axis, Value

# A trial of a tiny sweep: few steps and small evaluations, seconds of training on one CPU core.
TINY_TRIAL = (
    "optim.max_steps=40",
    "optim.warmup_steps=4",
    "run.log_every=10",
    "run.eval_every=20",
    "run.checkpoint_every=20",
    "run.eval_batches=2",
)
# The paper's pretraining data: CC-News, from the hub (override data.sources without the hub).
CC_NEWS = "data.sources=[vblagoje/cc_news]"

# Settings that may change when a sweep is resumed: they do not change what a trial computes.
RUNTIME_FIELDS = (
    "cpus_per_worker", "gpus_per_worker", "max_failures", "local_trials", "placement_timeout_s",
)  # fmt: skip


@dataclass(frozen=True)
class SweepSpec:
    axis: Axis
    """What the sweep varies (defined by its script in `sweeps/`)."""
    base: str
    """The config preset every trial starts from (`hlm presets`)."""
    values: tuple[Value, ...]
    """The swept values of the axis (numbers, or short names where the axis defines them)."""
    objectives: tuple[str, ...] = ("headless", "vanilla")
    num_seeds: int = 1
    """Seeds 0..num_seeds-1 (run.seed) per (value, objective)."""
    overrides: tuple[str, ...] = ()
    """Dotted config overrides on the base preset, `optim.max_steps=20`."""
    arm_overrides: tuple[str, ...] = ()
    """Config overrides of one arm, `objective:key=value` (`vanilla:optim.lr=1e-3`), or of one
    arm at one value of the axis, `objective@value:key=value` (`vanilla@500G:optim.lr=1e-3`),
    applied after the axis's settings; every arm of a value must set the same keys (the scaling
    sweep gives each arm, at each budget, the learning rate its search found)."""
    recipe: Literal[
        "tiny", "paper", "headline-tiny", "headline-cpu", "headline-paper", "scaling-tiny",
        "scaling-cpu", "scaling-paper", "none",
    ] = "tiny"  # fmt: skip
    """Downstream protocol (`hlm_ray.downstream.DOWNSTREAM`); the headline-* ones are
    `sweeps/headline.py`'s (more GLUE tasks, the generator's fine-tuning share), the scaling-*
    ones `sweeps/scaling.py`'s (bits per byte alone). `none`: no downstream step (pretraining
    only: the summary's downstream columns stay empty)."""
    workers_per_trial: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    max_failures: int = 1
    """Restarts of a trial's failed Train worker group (a worker or its node lost), and retries
    of a failed trial (its process lost, a downstream error); both resume from the trial's last
    checkpoint. A trial that still fails counts as failed."""
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S
    """How long, in all, a trial waits for the cluster to place its worker group (a node lost
    and not back) before it fails (`hlm train --placement-timeout`)."""
    allow_smaller_vocab: bool = False
    """When BPE training stops below a requested size (the corpus has too few merges): run at
    the real size (recorded in the summary) instead of stopping with an error."""
    search_samples: int = 4
    """--search: random configurations of (lr, warm-up) tried, early-stopped by ASHA."""
    search_lr: tuple[float, float] = (1e-4, 1e-2)
    """--search: log-uniform range of optim.lr."""
    search_warmup: tuple[int, ...] = (0, 10, 50)
    """--search: choices of optim.warmup_steps."""
    search_seeds: int = 2
    """The scaling sweep's learning-rate search: seeds of each (arm, budget, rate)."""
    search_extend: int = 2
    """The scaling sweep's learning-rate search: grid steps tried past an edge where an arm's
    best rate sits on it, at most, per arm and budget."""
    vanilla_prior_arm: bool = False
    """The scaling sweep: also train the vanilla arm with its head's bias started at the log
    prior of the training tokens (`init.prior_bias`), at vanilla's rates: the same knowledge the
    headless arm's prior readout gets."""
    experiment: str = "hlm_ray-sweeps"
    """MLflow experiment of the parent run and its children."""
    local_trials: bool = True
    """A one-worker CPU trial on a one-node cluster trains in the trial's own process (Ray
    Train's local mode, `ScalingConfig(num_workers=0)`) instead of starting a worker group:
    seconds less per trial; checkpoints, resume and Tune's retries work the same (false: always
    a worker group)."""

    def __post_init__(self):
        if not self.values:
            raise HLMError(
                "sweep.values is empty: the grid has no trials; give at least one value, "
                "e.g. --set sweep.values=[512,1024]"
            )
        numbers = [v for v in self.values if not isinstance(v, str)]
        if len(set(self.values)) != len(self.values) or any(v <= 0 for v in numbers):
            raise HLMError(
                f"sweep.values={list(self.values)} must be distinct, and numbers positive"
            )
        if not self.objectives:
            raise HLMError(
                "sweep.objectives is empty: the grid has no trials; "
                "e.g. --set sweep.objectives=[headless,vanilla]"
            )
        unknown = [o for o in self.objectives if o not in OBJECTIVES]
        if unknown:
            raise HLMError(
                f"sweep.objectives: unknown objective {unknown[0]!r}; choose from "
                f"{', '.join(OBJECTIVES)}"
            )
        checks = [
            (self.num_seeds >= 1, "num_seeds", "must be >= 1"),
            (self.workers_per_trial >= 1, "workers_per_trial", "must be >= 1"),
            (self.cpus_per_worker > 0, "cpus_per_worker", "must be > 0"),
            (self.gpus_per_worker >= 0, "gpus_per_worker", "must be >= 0"),
            (self.max_failures >= 0, "max_failures", "must be >= 0"),
            (self.placement_timeout_s > 0, "placement_timeout_s", "must be > 0 (seconds)"),
            (self.search_samples >= 1, "search_samples", "must be >= 1"),
            (self.search_seeds >= 1, "search_seeds", "must be >= 1"),
            (self.search_extend >= 0, "search_extend", "must be >= 0"),
            (0 < self.search_lr[0] <= self.search_lr[1], "search_lr", "must be 0 < low <= high"),
            (bool(self.search_warmup), "search_warmup", "give at least one warm-up"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise HLMError(f"sweep.{name}={getattr(self, name)!r} is not allowed; {allowed}")
        for value in self.values:
            keys = {o: set(self.arm_settings(o, value)) for o in self.objectives}
            if self.arm_overrides and len({frozenset(k) for k in keys.values()}) > 1:
                raise HLMError(
                    f"sweep.arm_overrides={list(self.arm_overrides)}: every arm must set the same "
                    f"keys ({'; '.join(f'{o}: {sorted(k)}' for o, k in keys.items())})"
                )

    def arm_settings(self, objective: str, value: Value | None = None) -> dict[str, Any]:
        """The `arm_overrides` of one arm (at one value of the axis), {dotted key: value}."""
        return arm_settings(self.arm_overrides, objective, value)

    def cells(self) -> list[dict[str, Any]]:
        """Every (value, objective, seed) of the grid, in Tune's order."""
        return [
            {"value": v, "objective": o, "seed": s}
            for s in range(self.num_seeds)
            for o in self.objectives
            for v in self.values
        ]

    def base_config(self) -> Config:
        """The preset with the overrides; the arms differ only in what the grid sets (an
        ablation), so per-objective preset settings are not applied."""
        return load_config(self.base, overrides=list(self.overrides))

    def cell_config(self, value: Value, objective: str, seed: int) -> Config:
        """The config of one trial, as Tune resolves `param_space` for it."""
        extra = {
            **self.axis.overrides(value, self.workers_per_trial, objective),
            **self.arm_settings(objective, value),
            "objective.name": objective,
            "run.seed": seed,
        }
        return apply_overrides(self.base_config(), extra)

    def param_space(self, *, search: bool = False) -> dict[str, Any]:
        """Tune's space: the base config as a nested dict with `grid_search` at the axis, the
        objective and the seed (the trial turns it back into a `Config` on its first line).

        With `search`, optim.lr and optim.warmup_steps are sampled (`search_samples` times)
        for one cell of the grid: validation losses, which ASHA compares, differ in scale
        between objectives and vocabularies."""
        from ray import tune

        config = self.base_config().to_dict()
        if search:
            value = self.values[0]
            config["objective"]["name"] = self.objectives[0]
            config["run"]["seed"] = 0
            config["optim"]["lr"] = tune.loguniform(*self.search_lr)
            config["optim"]["warmup_steps"] = tune.choice(list(self.search_warmup))
            # ASHA compares the validation loss at each report (a checkpoint): evaluate there.
            config["run"]["eval_every"] = config["run"]["checkpoint_every"]
        else:
            value = tune.grid_search(list(self.values))
            config["objective"]["name"] = tune.grid_search(list(self.objectives))
            config["run"]["seed"] = tune.grid_search(list(range(self.num_seeds)))
        # Each field a value or an arm sets is resolved from the value and the objective (grid
        # values resolve first).
        keys = {
            k
            for v in self.values
            for o in self.objectives
            for k in _cell_overrides(self.axis, v, self.workers_per_trial, o, self.arm_overrides)
        }
        for key in sorted(keys):
            *sections, name = key.split(".")  # "optim.lr", or a top-level "preset"
            target = config
            for section in sections:
                target = target[section]
            target[name] = tune.sample_from(
                partial(_axis_setting, self.axis, self.workers_per_trial, self.arm_overrides, key)
            )
        return {"config": config, "value": value}

    def identity(self) -> dict[str, Any]:
        """What a resumed sweep must match: everything but the runtime settings."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "axis"}
        return {
            "kind": self.axis.name,
            "axis": self.axis.field,
            **{k: _plain(v) for k, v in data.items() if k not in RUNTIME_FIELDS},
        }


def tiny_scale(axis: Axis, base: str, values, *overrides: str, **fields) -> SweepSpec:
    """A script's `tiny` preset: `TINY_TRIAL` then `overrides` on `base`, the tiny downstream
    recipe, one CPU per worker; `fields` set any other `SweepSpec` field."""
    overrides = (*TINY_TRIAL, *overrides)
    return SweepSpec(axis, base, tuple(values), overrides=overrides, recipe="tiny", **fields)


def paper_scale(axis: Axis, base: str, values, *overrides: str, **fields) -> SweepSpec:
    """A script's `paper` preset: the paper's data (`CC_NEWS`) then `overrides`, its downstream
    recipe, 4 CPUs and one GPU per worker; `fields` set any other `SweepSpec` field."""
    gpus = {"cpus_per_worker": 4, "gpus_per_worker": 1, **fields}
    return SweepSpec(
        axis, base, tuple(values), overrides=(CC_NEWS, *overrides), recipe="paper", **gpus
    )


def with_overrides(spec: SweepSpec, items: list[str]) -> SweepSpec:
    """`sweep.FIELD=VALUE` items set spec fields; the others are appended as config overrides.

    The config overrides are checked here (an unknown key fails before any work)."""
    data = {f.name: getattr(spec, f.name) for f in fields(spec)}
    config_items = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise HLMError(f"override {item!r} must look like key=value, e.g. optim.lr=3e-4")
        key = key.strip()
        if key.startswith("sweep."):
            data[key.removeprefix("sweep.")] = yaml.safe_load(value.strip())
        else:
            config_items.append(f"{key}={value.strip()}")
    data["overrides"] = [*data["overrides"], *config_items]
    new = build(SweepSpec, data, prefix="sweep.")  # the axis is kept as it is
    base = new.base_config()  # unknown preset, unknown key or invalid value: fail now
    for objective in new.objectives:
        for value in new.values:
            apply_overrides(base, new.arm_settings(objective, value))
    return new


def get_sweep(
    presets: dict[str, SweepSpec], preset: str, overrides: list[str] | None = None
) -> SweepSpec:
    """A script's named sweep (`PRESETS[preset]`) with `--set` overrides applied."""
    if preset not in presets:
        raise HLMError(f"unknown sweep preset {preset!r}; choose one of: {', '.join(presets)}")
    return with_overrides(presets[preset], list(overrides or []))


def _axis_setting(
    axis: Axis, workers: int, arm_overrides: tuple[str, ...], key: str, resolved: dict[str, Any]
) -> Any:
    """`sample_from` callback: Tune passes the space resolved so far (the grid's value and
    objective)."""
    objective = resolved["config"]["objective"]["name"]
    return _cell_overrides(axis, resolved["value"], workers, objective, arm_overrides).get(key)


@cache
def _cell_overrides(
    axis: Axis, value: Value, workers: int, objective: str, arm_overrides: tuple[str, ...] = ()
) -> dict[str, Any]:
    """`axis.overrides` of one cell and its arm's `arm_overrides`, computed once for all its
    keys: Tune resolves each key with its own callback, and a headline family's overrides load
    presets and price steps (tens of keys × a few ms each, for every cell). Read only: the dict
    is shared."""
    out = dict(axis.overrides(value, workers, objective))
    return {**out, **arm_settings(arm_overrides, objective, value)}


def arm_settings(
    arm_overrides: tuple[str, ...], objective: str, value: Value | None = None
) -> dict[str, Any]:
    """{dotted key: value} of the `objective:key=value` items that name `objective`, and of the
    `objective@value:key=value` items that name it and `value` (matched as text)."""
    out = {}
    for item in arm_overrides:
        arm, colon, setting = item.partition(":")
        arm, at, where = arm.partition("@")
        key, eq, setting_value = setting.partition("=")
        if (not colon or not eq or arm.strip() not in OBJECTIVES or not key.strip()
                or (at and not where.strip())):  # fmt: skip
            raise HLMError(
                f"sweep.arm_overrides: {item!r} must look like objective:key=value or "
                "objective@value:key=value, e.g. vanilla:optim.lr=1e-3"
            )
        if arm.strip() == objective and (not at or str(value) == where.strip()):
            out[key.strip()] = yaml.safe_load(setting_value.strip())
    return out


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
