"""How long a run waits for the cluster to place its worker group, and what it says meanwhile.

    failure = ray.train.FailureConfig(max_failures=2, controller_failure_limit=retries(600))
    callbacks = [placement_wait(workers=2, resources={"CPU": 2}, timeout_s=600)]

Ray Train starts a worker group and gives up on it after `RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`
(60 s by default) when the cluster cannot place every worker (a node lost and not back, the
CPUs held by other jobs); its controller then retries forever (`controller_failure_limit` -1),
printing `Training failed due to controller error: The worker group startup timed out` with a
traceback at every try, while the job stays RUNNING. Here the tries are bounded by a time,
`timeout_s` (`hlm train --placement-timeout`, a sweep's `sweep.placement_timeout_s`): the run
fails with one line once it has waited that long in all, and until then each try says in one
line that the run is waiting for room, not failing.
"""

from __future__ import annotations

import logging
import math
import os
import time
from functools import cache
from typing import Any

PLACEMENT_TIMEOUT_S = 600.0
"""How long a run waits, in all, for the cluster to place its workers (long enough for a node
to be replaced or rejoin; the cluster box's rejoined in 1-3 minutes)."""
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
RAY_START_TIMEOUT_S = 60.0  # Ray Train 2.60's default for one try
POLICY_LOGGER = "ray.train.v2._internal.execution.failure_handling.default"


def start_timeout_s() -> float:
    """One try's wait (Ray Train's setting, which it passes on to its controller)."""
    return float(os.environ.get(START_TIMEOUT_ENV, RAY_START_TIMEOUT_S))


def retries(timeout_s: float) -> int:
    """`controller_failure_limit` for a wait of `timeout_s` in all: the tries after the first
    that fit in it (at least one try, which is no retry)."""
    return max(0, math.ceil(timeout_s / start_timeout_s()) - 1)


def is_placement_timeout(error: BaseException | None) -> bool:
    """Whether Ray Train's error is a worker group it could not place in time (its class is
    private to Ray: known by name)."""
    failure = getattr(error, "controller_failure", None)
    return type(failure).__name__ == "WorkerGroupStartupTimeoutError"


def waiting_line(workers: int, resources: dict[str, float], tries: int, timeout_s: float) -> str:
    each = " + ".join(f"{v:g} {k}" for k, v in resources.items())
    waited = tries * start_timeout_s()
    return (
        f"waiting for the cluster to place {workers} worker(s) of {each}: not placed after "
        f"{waited:.0f} s of the {timeout_s:.0f} s this run waits (--placement-timeout); "
        "training starts once they fit (a node back, CPUs freed), not a failure yet"
    )


def failed_line(workers: int, resources: dict[str, float], timeout_s: float) -> str:
    each = " + ".join(f"{v:g} {k}" for k, v in resources.items())
    return (
        f"the cluster could not place {workers} worker(s) of {each} in {timeout_s:.0f} s "
        "(--placement-timeout): a node lost and not back, or its CPUs held by other jobs"
    )


def placement_wait(workers: int, resources: dict[str, float], timeout_s: float | None) -> Any:
    """The Train controller's callback that says, at each try, that the run waits (`timeout_s`
    None: `PLACEMENT_TIMEOUT_S`); its `retries` bound Ray's, its `failure(error)` says why a
    run that waited too long failed."""
    timeout_s = PLACEMENT_TIMEOUT_S if timeout_s is None else timeout_s
    return _callback_class()(workers, resources, timeout_s)


@cache
def _callback_class() -> type:
    from ray.train.v2._internal.execution.callback import ControllerCallback  # Ray: here

    class PlacementWait(ControllerCallback):
        """In the Train controller: Ray's record of each retry of a placement timeout
        replaced by one line that says the run waits."""

        def __init__(self, workers: int, resources: dict[str, float], timeout_s: float):
            self.workers, self.resources, self.timeout_s = workers, resources, timeout_s
            self.retries = retries(timeout_s)  # FailureConfig's controller_failure_limit
            self.tries = 0

        def failure(self, error: BaseException) -> str | None:
            """Why the run failed, when it waited too long for room; else None."""
            if not is_placement_timeout(error):
                return None
            return failed_line(self.workers, self.resources, self.timeout_s)

        def after_controller_start(self, train_run_context: Any) -> None:
            logging.getLogger(POLICY_LOGGER).addFilter(quiet_placement_retries)

        def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
            error = getattr(current_state, "training_failed_error", None)
            if type(current_state).__name__ in RETRY_STATES and is_placement_timeout(error):
                self.tries += 1
                line = waiting_line(self.workers, self.resources, self.tries, self.timeout_s)
                print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)

    return PlacementWait


RETRY_STATES = ("ReschedulingState", "RestartingState")


def quiet_placement_retries(record: logging.LogRecord) -> bool:
    """Ray's failure policy logs every retry with its traceback ("Training failed due to
    controller error"); a retry of a placement timeout is the `PlacementWait` line instead."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (str(record.msg).startswith("[FailurePolicy] RETRY") and is_placement_timeout(exc))
