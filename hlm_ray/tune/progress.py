"""One console line per trial as it starts and as it ends, in place of Tune's status tables.

    tune.RunConfig(callbacks=[TrialProgress(num_trials=6, short="vocab")], verbose=0)

    [00:41] trial 1/6 started: vocab=1000 headless seed 0
    [01:32] trial 1/6 finished in 51 s: vocab=1000 headless seed 0, score 0.5120, 8,120 tokens/s
    [00:44] trial 5/6 finished in 40 s since the sweep resumed: ...      # a resumed sweep

Lines go through `hlm_ray.console.say`: to the terminal while the sweep's log takes the rest.
"""

from __future__ import annotations

import math
import time

from ray.tune import Callback

from hlm_ray.console import say


def trial_label(config: dict, short: str) -> str:
    """`vocab=1000 headless seed 0` from a trial's Tune config (value + the nested Config dict)."""
    inner = config.get("config", {})
    objective = inner.get("objective", {}).get("name", "?")
    seed = inner.get("run", {}).get("seed", 0)
    return f"{short}={config.get('value')} {objective} seed {seed}"


def outcome_label(result: dict | None) -> str:
    """What a finished trial reached: its downstream score and training speed, when reported."""
    result = result or {}
    if result.get("trial/error"):  # a diverged trial: it ends without Tune's retries
        return f", failed: {result['trial/error']}"
    score, speed = result.get("downstream/score"), result.get("tokens_per_s")
    parts = []
    if isinstance(score, (int, float)) and math.isfinite(score):
        parts.append(f"score {score:.4f}")
    if isinstance(speed, (int, float)) and math.isfinite(speed):
        parts.append(f"{speed:,.0f} tokens/s")
    return (", " + ", ".join(parts)) if parts else ""


def trial_number(trial_id: str) -> int | None:
    """A trial's place in the sweep, from 1: Tune's ids end with the order it made them in
    (`a1b2c_00003`: the fourth), and keep it when a sweep is resumed."""
    tail = trial_id.rpartition("_")[2]
    return int(tail) + 1 if tail.isdigit() else None


class TrialProgress(Callback):
    """Numbers trials by their place in the sweep; times each from its start in this run
    (a resumed sweep's lines say that their times start with the resume)."""

    resumed = False
    """Set by the sweep before a resumed `Tuner.fit()` (the callback itself is restored by Tune
    from the first run's pickle, not built again)."""

    def __init__(self, num_trials: int, short: str) -> None:
        self.num_trials = num_trials
        self.short = short
        self.started = time.monotonic()
        self.order: dict[str, int] = {}
        self.began: dict[str, float] = {}

    def setup(self, **info):
        self.started = time.monotonic()  # a restored sweep's callback was pickled long ago

    def _line(self, trial, what: str) -> str:
        n = trial_number(trial.trial_id) or self.order.setdefault(
            trial.trial_id, len(self.order) + 1
        )
        elapsed = int(time.monotonic() - self.started)
        clock = f"[{elapsed // 60:02d}:{elapsed % 60:02d}]"
        return (
            f"{clock} trial {n}/{self.num_trials} {what}: {trial_label(trial.config, self.short)}"
        )

    def on_trial_start(self, iteration, trials, trial, **info):
        self.began[trial.trial_id] = time.monotonic()
        say(self._line(trial, "started"))

    def _took(self, trial) -> str:
        began = self.began.get(trial.trial_id)
        if began is None:
            return ""
        since = " since the sweep resumed" if TrialProgress.resumed else ""
        return f" in {time.monotonic() - began:.0f} s{since}"

    def on_trial_complete(self, iteration, trials, trial, **info):
        line = self._line(trial, "finished" + self._took(trial))
        say(line + outcome_label(trial.last_result))

    def on_trial_error(self, iteration, trials, trial, **info):
        say(self._line(trial, "failed" + self._took(trial)) + " (its error is in the sweep log)")
