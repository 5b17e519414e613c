"""What a sweep is: the swept axis and its values × objectives × seeds, on a base config.

    spec = SweepSpec(kind="vocab", base="tiny-encoder", values=(512, 1024))
    spec = with_overrides(spec, ["optim.max_steps=20", "sweep.values=[512,768]"])
    spec.cells()              # [Cell(value=512, objective="headless", seed=0), ...]
    spec.base_config()        # the validated Config every trial starts from

`--set sweep.FIELD=VALUE` sets a field below; any other `--set KEY=VALUE` is a config override
on the base preset (`optim.max_steps=20`). Invalid settings raise `HLMError` naming the option.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import yaml

from hlm_ray.config import OBJECTIVES, Config, apply_overrides, build
from hlm_ray.errors import HLMError
from hlm_ray.presets import load_config

# The config field each ablation sweeps (paper Figure 7 / Figure 8).
AXES = {"vocab": "tokenizer.vocab_size", "batch_size": "optim.micro_batch_size"}
AXIS_LABELS = {"vocab": "vocabulary size", "batch_size": "micro-batch size (in-batch negatives)"}
# Settings that may change when a sweep is resumed: they do not change what a trial computes.
RUNTIME_FIELDS = ("cpus_per_worker", "gpus_per_worker", "max_failures")


@dataclass(frozen=True)
class SweepSpec:
    kind: Literal["vocab", "batch_size"]
    """vocab: tokenizer.vocab_size (a BPE trained per size); batch_size: the per-worker
    micro-batch (global batch = micro-batch × workers, no accumulation)."""
    base: str
    """The config preset every trial starts from (`hlm presets`)."""
    values: tuple[int, ...]
    """The swept values of the axis."""
    objectives: tuple[str, ...] = ("headless", "vanilla")
    num_seeds: int = 1
    """Seeds 0..num_seeds-1 (run.seed) per (value, objective)."""
    overrides: tuple[str, ...] = ()
    """Dotted config overrides on the base preset, `optim.max_steps=20`."""
    recipe: Literal["tiny", "paper"] = "tiny"
    """Downstream protocol size (`hlm_ray.downstream.DOWNSTREAM`)."""
    workers_per_trial: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    max_failures: int = 1
    """Retries of a failed trial (it resumes from its last checkpoint) before it counts as
    failed."""
    allow_smaller_vocab: bool = False
    """When BPE training stops below a requested size (the corpus has too few merges): run at
    the real size (recorded in the summary) instead of stopping with an error."""
    search_samples: int = 4
    """--search: random configurations of (lr, warm-up) tried, early-stopped by ASHA."""
    search_lr: tuple[float, float] = (1e-4, 1e-2)
    """--search: log-uniform range of optim.lr."""
    search_warmup: tuple[int, ...] = (0, 10, 50)
    """--search: choices of optim.warmup_steps."""
    experiment: str = "hlm_ray-sweeps"
    """MLflow experiment of the parent run and its children."""

    def __post_init__(self):
        if not self.values:
            raise HLMError(
                "sweep.values is empty: the grid has no trials; give at least one value, "
                "e.g. --set sweep.values=[512,1024]"
            )
        if len(set(self.values)) != len(self.values) or min(self.values) <= 0:
            raise HLMError(f"sweep.values={list(self.values)} must be distinct positive integers")
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
            (self.search_samples >= 1, "search_samples", "must be >= 1"),
            (0 < self.search_lr[0] <= self.search_lr[1], "search_lr", "must be 0 < low <= high"),
            (bool(self.search_warmup), "search_warmup", "give at least one warm-up"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise HLMError(f"sweep.{name}={getattr(self, name)!r} is not allowed; {allowed}")

    @property
    def axis(self) -> str:
        return AXES[self.kind]

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

    def cell_config(self, value: int, objective: str, seed: int) -> Config:
        """The config of one trial, as Tune resolves `param_space` for it."""
        extra: dict[str, Any] = {self.axis: value, "objective.name": objective, "run.seed": seed}
        if self.kind == "batch_size":
            extra["optim.global_batch_size"] = global_batch(value, self.workers_per_trial)
        return apply_overrides(self.base_config(), extra)

    def param_space(self, *, search: bool = False) -> dict[str, Any]:
        """Tune's space: the base config as a nested dict with `grid_search` at the axis, the
        objective and the seed (the trial turns it back into a `Config` on its first line).

        With `search`, optim.lr and optim.warmup_steps are sampled (`search_samples` times)
        for one cell of the grid: validation losses, which ASHA compares, differ in scale
        between objectives and vocabularies."""
        from ray import tune

        config = self.base_config().to_dict()
        section, field = self.axis.split(".")
        if search:
            config[section][field] = self.values[0]
            config["objective"]["name"] = self.objectives[0]
            config["run"]["seed"] = 0
            config["optim"]["lr"] = tune.loguniform(*self.search_lr)
            config["optim"]["warmup_steps"] = tune.choice(list(self.search_warmup))
            # ASHA compares the validation loss at each report (a checkpoint): evaluate there.
            config["run"]["eval_every"] = config["run"]["checkpoint_every"]
        else:
            config[section][field] = tune.grid_search(list(self.values))
            config["objective"]["name"] = tune.grid_search(list(self.objectives))
            config["run"]["seed"] = tune.grid_search(list(range(self.num_seeds)))
        if self.kind == "batch_size":
            # The paper's batch is the device batch: K = the in-batch negatives of one worker.
            config["optim"]["global_batch_size"] = tune.sample_from(
                partial(_global_batch_of, self.workers_per_trial)
            )
        return {"config": config}

    def identity(self) -> dict[str, Any]:
        """What a resumed sweep must match: everything but the runtime settings."""
        data = dataclasses.asdict(self)
        return {k: _plain(v) for k, v in data.items() if k not in RUNTIME_FIELDS}


def with_overrides(spec: SweepSpec, items: list[str]) -> SweepSpec:
    """`sweep.FIELD=VALUE` items set spec fields; the others are appended as config overrides.

    The config overrides are checked here (an unknown key fails before any work)."""
    data = dataclasses.asdict(spec)
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
    new = build(SweepSpec, data, prefix="sweep.")
    new.base_config()  # unknown preset, unknown key or invalid value: fail now
    return new


def global_batch(micro_batch: int, workers: int) -> int:
    return micro_batch * workers


def _global_batch_of(workers: int, resolved: dict[str, Any]) -> int:
    """`sample_from` callback: Tune passes the config resolved so far (the grid values)."""
    return global_batch(resolved["config"]["optim"]["micro_batch_size"], workers)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
