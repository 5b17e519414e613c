"""Speed comparisons with an interval from the runs' own step times, so that one seed per arm can
still be told apart when the gap is many times the step-to-step spread.

    samples = steady_tokens_per_s(summary)        # per-step tokens/s after the warm-up steps
    d = speed_difference([h_run], [v_run])         # Welch over steps (one run per arm), or over
                                                   # the runs' means (two or more runs per arm)

A run's `step_seconds` (summary.json) are its optimizer steps' wall seconds; the first
`WARMUP_SHARE` of them (at least `MIN_WARMUP`) are left out: allocation and caches warm up there.
With one run per arm the interval is Welch's over the steps: it says the two runs' speeds differ
beyond their step-to-step spread, not how far apart two runs on another day would be (steps of
one run are not independent draws of a machine's speed); with two or more runs per arm it is
Welch's over the runs' mean speeds, which carries that run-to-run noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hlm_ray.tune import stats

WARMUP_SHARE = 0.1
MIN_WARMUP = 3


def steady(values: Sequence[float]) -> list[float]:
    """`values` without their warm-up head."""
    drop = max(MIN_WARMUP, int(len(values) * WARMUP_SHARE))
    return list(values[drop:])


def steady_tokens_per_s(summary: dict) -> list[float]:
    """Each steady-state step's tokens/s of a run (its summary.json); [] without step times."""
    seconds = (summary.get("step_seconds") or {}).get("values") or []
    steps = int(summary.get("steps") or 0)
    per_step = summary["tokens"] / steps if steps else 0
    return [per_step / t for t in steady(seconds) if t > 0]


def speed_difference(
    a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]
) -> stats.Difference:
    """mean tokens/s of arm a − arm b: each arm a list of runs, each run its steady per-step
    tokens/s (module docstring for which interval)."""
    a = [r for r in a if r]
    b = [r for r in b if r]
    if len(a) >= stats.MIN_SEEDS and len(b) >= stats.MIN_SEEDS:
        return stats.welch([sum(r) / len(r) for r in a], [sum(r) / len(r) for r in b])
    steps_a = [x for r in a for x in r]
    steps_b = [x for r in b for x in r]
    d = stats.welch(steps_a, steps_b)
    return replace(d, method=f"welch over steps ({len(steps_a)} + {len(steps_b)} steps)")
