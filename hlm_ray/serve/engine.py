"""The replica's decode loop: one thread that owns a `RunningBatch` and, between decoding steps,
admits the rows of newly arrived requests and lets finished or abandoned ones leave (continuous
batching). No Ray: the Serve app submits jobs and awaits them.

    engine = DecodeLoop(generator, max_rows=32)
    job = engine.submit(rows, notify=lambda: loop.call_soon_threadsafe(event.set))
    ...                       # notify runs on the decode thread: when the job is done or failed,
    job.done, job.error       # and, for a streamed job, after every step that gave it text
    job.events.popleft()      # a streamed job's [Delta] per step (Delta.index: choice index)
    engine.cancel(job)        # the client went away: its rows leave at the next step
    engine.stats              # prefills, steps, rows per step, busy seconds (GET /healthz)

Why a loop rather than batches of requests (`serve.batch`): requests reach a replica one by one,
a few milliseconds apart, and a batch decodes for as many steps as its longest row; a batch of
the first few arrivals makes the later ones wait for all its steps and then decode in a second,
smaller batch. Here a request's rows are prefilled at the next step boundary and decode with
every row already running, so the replica decodes one batch of everything in flight. An idle
loop with a first-batch wait (`wait_s`) prefills the requests as they arrive and starts its
first step when the batch is full or the wait ends, so that a burst starts (and ends) together.

Failures stay with their request: when a prefill of several requests fails, each is prefilled
alone and only those that fail get the error; when a step fails, each request's rows step alone
and only those that fail leave (the others are merged back and go on, their text unchanged).
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hlm_ray.batching import RunningBatch
from hlm_ray.generate import Delta, Generator, Row

log = logging.getLogger("ray.serve")


@dataclass
class Job:
    """One request's rows in the decode loop."""

    rows: list[Row]
    notify: Callable[[], None]
    """Called on the decode thread when the job finishes or fails (and after each step that
    gave a streamed job text); it must only hand over to the caller's thread."""
    stream: bool = False
    events: deque[list[Delta]] = field(default_factory=deque)
    """A streamed job's deltas, one list per step (filled on the decode thread)."""
    error: Exception | None = None
    done: bool = False
    """Every row has its result, or the job failed (then `error` is set)."""
    cancelled: bool = False
    id: int = -1
    """The job's number in a `DecodeProcess` (its messages name it)."""


def freeze_loaded_heap() -> int:
    """Move every object alive now (the model, torch, transformers, the app) out of the garbage
    collector's reach; returns how many. Call once loading is done. A full collection then scans
    what was made since, not the ~390k objects a loaded tiny decoder's process holds: 270 ms per
    full collection before, under 0.1 ms after (`docs/serving.md`), a pause that would land on
    every request in flight."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


_WAKE = object()
_STOP = object()


class DecodeLoop:
    """The decode thread of a replica (module docstring)."""

    def __init__(
        self,
        generator: Generator,
        *,
        max_rows: int,
        wait_s: float = 0.0,
        after_pass: Callable[[], None] | None = None,
        fetch: Callable[[bool, float | None], list[Job] | None] | None = None,
    ) -> None:
        self.gen = generator
        self.max_rows = max_rows
        self.wait_s = wait_s
        """How long an idle loop waits for more requests before its first step (it prefills
        those that arrive meanwhile; a full batch steps at once)."""
        self.after_pass = after_pass
        """Called on the decode thread after each pass (admissions and a step), once every
        job the pass touched was notified (`DecodeProcess`'s child sends their news at once)."""
        self.stats = {"batches": 0, "steps": 0, "decoded_rows": 0, "max_batch_requests": 0,
                      "max_batch_rows": 0, "busy_s": 0.0, "busy_cpu_s": 0.0,
                      "busy_since": 0.0, "idle_since": 0.0, "stepping_since": 0.0}  # fmt: skip
        self._fetch = fetch or self._from_inbox
        """`fetch(block, timeout)`: the jobs submitted since the last call, waiting for
        something first when `block` (up to `timeout` s; None: until it comes); None once the
        loop is closed. Default: what `submit`, `cancel` and `close` queue on this object.
        `DecodeProcess`'s child reads its pipe instead."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: deque[Job] = deque()
        self._running: dict[int, Job] = {}  # id(row) -> its job, for rows in the batch
        self._batch = RunningBatch(generator)
        self.submitted_at = 0.0
        """Unix time a request was last handed to this loop (by the replica's event loop)."""
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------- any thread

    def submit(self, rows: list[Row], notify: Callable[[], None], *, stream: bool = False) -> Job:
        """Queue a request's rows (`Delta.index` is the row's place in `rows`)."""
        job = Job(rows, notify, stream)
        self.submitted_at = time.time()
        self._inbox.put(job)
        return job

    def cancel(self, job: Job) -> None:
        """Stop decoding `job` (its client went away); it gets no result."""
        job.cancelled = True
        self._inbox.put(_WAKE)

    def close(self) -> None:
        self._inbox.put(_STOP)

    # ------------------------------------------------------------------------- the thread

    def _run(self) -> None:
        # While the first batch forms (up to `wait_s` after an idle loop's first request), the
        # requests that arrive are prefilled as they come, on this thread, while the replica is
        # still reading the later ones; the first step waits for the batch to fill or the wait
        # to end. Rows then start decoding together, as with one prefill, but the prefills no
        # longer sit after the last arrival: only the last arrivals' does.
        forming_until: float | None = None
        while True:
            idle = not self._batch.rows and not self._pending
            if forming_until is not None:
                wait = max(0.0, forming_until - time.monotonic())
                alive = self._receive(block=True, timeout=wait)
            else:
                alive = self._receive(block=idle)
            if not alive:
                break
            if idle and self._pending and self.wait_s > 0:
                forming_until = time.monotonic() + self.wait_s
            if self.stats["idle_since"] >= self.stats["busy_since"]:
                self.stats["busy_since"] = time.time()
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                self._leave_cancelled()
                self._admit()
                if forming_until is not None and (
                    self._full() or time.monotonic() >= forming_until
                ):
                    forming_until = None
                if forming_until is None and self._batch.rows:
                    if self.stats["stepping_since"] < self.stats["busy_since"]:
                        self.stats["stepping_since"] = time.time()  # this busy spell's first
                    self._step()
            except Exception as err:  # a bug here: fail what is running rather than hang it
                log.exception("decode loop error")
                for job in {id(j): j for j in self._running.values()}.values():
                    self._fail(job, err)
                self._running.clear()
                self._batch = RunningBatch(self.gen)
                forming_until = None
            self.stats["busy_s"] += time.perf_counter() - start
            self.stats["busy_cpu_s"] += time.thread_time() - cpu
            if self.after_pass is not None:
                self.after_pass()
            if not self._batch.rows and not self._pending:
                self.stats["idle_since"] = time.time()
                forming_until = None

    def _receive(self, *, block: bool, timeout: float | None = None) -> bool:
        """Move submitted jobs to the pending queue (`fetch`); False when the loop is closed.
        Each row's `index` becomes its place in its job, whichever way the job came."""
        jobs = self._fetch(block, timeout)
        if jobs is None:
            return False
        for job in jobs:
            for i, row in enumerate(job.rows):
                row.index = i
        self._pending.extend(jobs)
        return True

    def _from_inbox(self, block: bool, timeout: float | None) -> list[Job] | None:
        jobs: list[Job] = []
        while True:
            try:
                item = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
            except queue.Empty:
                return jobs
            if item is _STOP:
                return None
            if isinstance(item, Job):
                jobs.append(item)
            block = False  # then take what else is there, without waiting

    def join(self) -> None:
        """Wait until the loop has closed."""
        self._thread.join()

    def _full(self) -> bool:
        """No more rows fit the forming batch (pending ones are left only when they do not)."""
        return len(self._batch.rows) >= self.max_rows or bool(self._pending)

    def _leave_cancelled(self) -> None:
        self._pending = deque(job for job in self._pending if not job.cancelled)
        gone = [row for row in self._batch.rows if self._running[id(row)].cancelled]
        if gone:
            self._batch.drop(gone)
            for row in gone:
                self._running.pop(id(row))

    def _admit(self) -> None:
        """Prefill the pending jobs that fit in the batch, in arrival order."""
        jobs, room = [], self.max_rows - len(self._batch.rows)
        while self._pending and (len(self._pending[0].rows) <= room or not self._batch.rows):
            job = self._pending.popleft()
            room -= len(job.rows)
            jobs.append(job)
            if room <= 0:
                break
        if not jobs:
            return
        self.stats["batches"] += 1
        try:
            events = self._batch.admit([row for job in jobs for row in job.rows])
        except Exception:
            if len(jobs) == 1:
                events = self._admit_alone(jobs[0])
            else:  # find the request that fails: each is prefilled alone
                events = [event for job in jobs for event in self._admit_alone(job)]
        for job in jobs:
            if job.error is None:
                self._running.update((id(row), job) for row in job.rows if row.result is None)
        self._deliver(events, jobs)

    def _admit_alone(self, job: Job) -> list:
        for row in job.rows:
            row.reset()
        try:
            return self._batch.admit(job.rows)
        except Exception as err:
            self._fail(job, err)
            return []

    def _step(self) -> None:
        rows = self._batch.rows
        jobs = {id(self._running[id(row)]): self._running[id(row)] for row in rows}
        stats = self.stats
        stats["steps"] += 1
        stats["decoded_rows"] += len(rows)
        stats["max_batch_rows"] = max(stats["max_batch_rows"], len(rows))
        stats["max_batch_requests"] = max(stats["max_batch_requests"], len(jobs))
        try:
            events = self._batch.step()
        except Exception:
            events = self._step_alone(list(jobs.values()))
        self._deliver(events, list(jobs.values()))

    def _step_alone(self, jobs: list[Job]) -> list:
        """Step each job's rows on their own; jobs that fail leave, the others merge back."""
        events, parts = [], []
        for job in jobs:
            part = self._batch.take(job.rows)
            try:
                events += part.step()
                parts.append(part)
            except Exception as err:
                self._fail(job, err)
        for part in parts:
            self._batch.merge(part)
        return events

    def _fail(self, job: Job, err: Exception) -> None:
        job.error, job.done = err, True
        for row in job.rows:
            self._running.pop(id(row), None)
        job.notify()

    def _deliver(self, events: list, jobs: list[Job]) -> None:
        """Hand each job its deltas; notify the streamed ones and those that finished."""
        grouped: dict[int, list[Delta]] = {}
        owner = {id(row): job for job in jobs for row in job.rows}
        for row, delta in events:
            grouped.setdefault(id(owner[id(row)]), []).append(delta)
        for job in jobs:
            if job.done:  # failed above
                continue
            deltas = grouped.get(id(job))
            if job.stream and deltas:
                job.events.append(deltas)
            if all(row.result is not None for row in job.rows):
                job.done = True
                for row in job.rows:
                    self._running.pop(id(row), None)
                job.notify()
            elif job.stream and deltas:
                job.notify()
