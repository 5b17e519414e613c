"""One line when the run storage keeps training waiting, and one when it lets it go on.

    with waiting_on_storage("s3://bucket/runs/x", step=20):   # rank 0, around a checkpoint
        mirror.push(...); ray.train.report(..., checkpoint=...)

Training waits for each checkpoint to be stored (Ray Train uploads it inside `report`, the run
mirror before it): an object store or shared volume that stops answering stalls the run with no
error, for as long as the store takes (the cluster box: 60 s with S3 unreachable from rank 0's
node). A tracking outage says what it does; so does this: after `STALL_S` without the store
taking the checkpoint, a line that says training is waiting on it, and once it is stored, how
long it took.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

STALL_S = 30.0
"""A checkpoint of the tiny presets is stored in a second or two; 30 s is a store that stalls."""


@contextmanager
def waiting_on_storage(
    where: str, step: int, after_s: float | None = None, say: Callable[[str], None] | None = None
) -> Iterator[None]:
    after_s = STALL_S if after_s is None else after_s
    say = say or (lambda line: print(line, flush=True))  # a worker's stdout: the job's log
    started = time.monotonic()
    stalled = threading.Event()

    def late() -> None:
        stalled.set()
        say(
            f"checkpoint {step}: the run storage {where} has not taken it in {after_s:.0f} s "
            "(it does not answer?); training waits for it and goes on once it is stored"
        )

    timer = threading.Timer(after_s, late)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if stalled.is_set():
            waited = time.monotonic() - started
            say(f"checkpoint {step}: stored in {where} after {waited:.0f} s; training goes on")
