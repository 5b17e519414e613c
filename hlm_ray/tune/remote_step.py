"""A sweep trial's downstream step on a node of the cluster, started again elsewhere when that
node is lost.

    scores, logged = run_on_a_node(_downstream_task, args, cpus=2.0, gpus=0.0, attempts=2)

The step holds one worker's resources for as long as it runs. As a Ray task it waited minutes
for its node's loss: on the cluster box, with the node cut off mid-step (alive, its packets
dropped), the head declared the node dead in 15 s, but Ray ran the task again only 7.5 minutes
after the cut, once its connection to the lost worker timed out; meanwhile the trial showed
RUNNING with no CPU used. So the step runs in an actor of its own: the GCS places it, and
declares it dead with its node, which fails the call at once (`RayActorError`); the step then
starts again in a new actor on a node with room, up to `attempts` times in all. The actor ends
with its step, giving its CPUs back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from hlm_ray.console import say
from hlm_ray.errors import one_line


class _Step:
    """The actor a step runs in (no state: one call, then it is killed)."""

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


def run_on_a_node(
    fn: Callable[..., Any], args: tuple, *, cpus: float, gpus: float, attempts: int
) -> Any:
    """`fn(*args)` in an actor holding `cpus` and `gpus`, outside the caller's placement group
    (a Tune trial's holds only its token of memory); again in a new actor when the one it ran
    in died with its node, up to `attempts` times. `fn`'s own errors are raised at once."""
    import ray
    from ray.exceptions import RayActorError
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    step_class = ray.remote(_Step).options(
        num_cpus=cpus,
        num_gpus=gpus,
        max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=None),
    )
    for attempt in range(1, attempts + 1):
        step = step_class.remote()
        try:
            return ray.get(step.run.remote(fn, *args))
        except RayActorError as err:
            if attempt == attempts:
                raise
            say(
                f"the downstream step's node was lost ({one_line(err, limit=160)}); starting it "
                f"again on a node with room (attempt {attempt + 1} of {attempts})"
            )
        finally:
            with contextlib.suppress(Exception):  # dead already, or gone with its node
                ray.kill(step)
    raise AssertionError("unreachable")
