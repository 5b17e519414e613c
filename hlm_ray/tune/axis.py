"""What an ablation varies, described once: the `Axis` record a `sweeps/*.py` script defines.

    VOCAB = Axis(
        name="vocab",                          # the sweep's kind: default name, MLflow tag, resume
        field="tokenizer.vocab_size",          # the config field each value sets
        label="vocabulary size",               # the figures' x axis
        column=("vocab (asked)", "vocab_size"),  # the value's header in summary.md / summary.csv
        figures=(Figure("fig7a_score_vs_vocab.png", "downstream/score", "downstream score"),),
        check=check_vocab_sizes,               # optional: raise HLMError before anything runs
        short="v",                             # run names (default the name's first letter)
    )

`hlm_ray.tune` knows no axis by name: the grid, the trial, the summary and the figures read
only this record. A value may set more than its field (`settings`: the batch-size axis also
sets the global batch; the negatives axis maps "own" / "all_workers" / N to two objective
fields). Values are numbers or short strings; string values are plotted as categories.
`arm_settings` adds what differs between the arms of one value (the headline comparison gives
the vanilla decoder the headless arm's fine-tuning share on top of the common budget).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Value = int | float | str


@dataclass(frozen=True)
class Figure:
    """One PNG of the sweep: summary column `metric` against the swept value, per objective."""

    filename: str
    metric: str
    """A summary column (`hlm_ray.tune.summary.COLUMNS`), e.g. "downstream/score"."""
    label: str
    """The y axis label."""


@dataclass(frozen=True)
class Axis:
    name: str
    """Short id of the ablation: the default sweep name (<name>-<preset>), the MLflow tag
    `sweep_kind`, part of what a resumed sweep must match."""
    field: str
    """The dotted config field the swept value sets (`tokenizer.vocab_size`)."""
    label: str
    """What the value is, in words (the figures' x axis)."""
    column: tuple[str, str]
    """The value's (Markdown header, CSV column name) in the summary."""
    figures: tuple[Figure, ...] = ()
    description: str = ""
    """One line for the script's --help."""
    settings: Callable[[Value, int], dict[str, Any]] | None = None
    """(value, workers per trial) -> the dotted config overrides the value stands for; None:
    just `{field: value}`."""
    arm_settings: Callable[[Value, str], dict[str, Any]] | None = None
    """(value, objective) -> overrides of that arm on top of `settings`; every arm of a value
    must set the same keys. None: the arms differ only in `objective.name`."""
    check: Callable[[Any], None] | None = None
    """(the `SweepSpec`) -> raise `HLMError` for values that can never run; called before Ray
    starts."""
    prepared: Callable[[Any, dict[int, int]], None] | None = None
    """(the `SweepSpec`, {requested vocabulary size: real size}), once the tokenizers are built:
    may refuse a size or warn."""
    log_x: bool = True
    """Plot numeric values on a log2 axis."""
    short: str = ""
    """Run-name prefix of the value: `headless-<short><value>-s<seed>-<trial id>` (default:
    the name's first letter)."""

    def __post_init__(self):
        if not self.short:
            object.__setattr__(self, "short", self.name[0])

    def overrides(self, value: Value, workers: int, objective: str | None = None) -> dict[str, Any]:
        """The config overrides of one value of the axis (of one arm, given its objective)."""
        out = {self.field: value} if self.settings is None else self.settings(value, workers)
        if objective is not None and self.arm_settings is not None:
            out = {**out, **self.arm_settings(value, objective)}
        return out

    def identity(self) -> dict[str, Any]:
        return {"name": self.name, "field": self.field}
