"""The replica's decode loop in a process of its own: `DecodeLoop`'s interface over a pipe.

    engine = DecodeProcess(model_dir, device="cpu", max_rows=32)   # starts the child
    job = engine.submit(rows, notify)        # as DecodeLoop: notify runs on a reader thread
    engine.cancel(job); engine.stats; engine.submitted_at; engine.alive; engine.close()

Why: a replica is one Python process, so its event loop (HTTP, routing, parsing, tokenizing,
answering) and its decode thread take turns on one interpreter lock. With a small model, where
a decoding step is mostly Python, the two cannot overlap: on 2 cores the served tokens/s of 32
clients stayed at 0.7 of the same batch decoded in process, however the lock's switch interval
was set. Here the child owns the model and the `DecodeLoop` (its own lock, its own core); the
replica keeps the tokenizer and everything HTTP.

Messages (pickled over a `multiprocessing` pipe; ids are the parent's job numbers):
  parent -> child  ("submit", [(id, [(prompt_ids, params, seed, deadline)], stream)])
                   ("cancel", id) | ("stats", token) | ("stop",)
  child -> parent  ("ready", frozen) | ("failed", message)     once, after loading the model
                   ("jobs", [news], stats)                       after a decoding pass, where
                   news is ("events", id, [[Delta]])             a streamed job's steps,
                           ("done", id, [Completion], [[Delta]]) every row finished,
                           ("error", id, exception)              the job failed alone
                   ("stats", token, stats)
The child exits when the pipe closes: a replica that dies, even by SIGKILL, takes it along.
Deadlines are `time.monotonic()` values, one clock for both processes on Linux.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hlm_ray.errors import HLMError, one_line
from hlm_ray.generate import Row
from hlm_ray.serve.engine import Job

log = logging.getLogger("ray.serve")
START_TIMEOUT_S = 600.0  # loading a large model from a slow disk
# A burst's requests cross to the child in messages of at most this many, the last at the end of
# the event loop's turn: the child prefills each group while the replica parses the next, so the
# prefill left after the last arrival (on the round's critical path, before the first step) is
# of a few requests, not of all those parsed in the turn. 2 cores, 16 alternated runs each of
# the serving benchmark: served / in-process median 0.803 at 4 against 0.755 with one
# message per turn.
FLUSH_EVERY = 4


@dataclass(frozen=True)
class ChildSpec:
    """What the child needs to load the model and run its `DecodeLoop` (sent to it once)."""

    model: str  # a local model folder
    device: str
    max_rows: int
    wait_s: float = 0.0
    allow_raw_head: bool = False
    readout: str | None = None
    name: str | None = None
    num_threads: int | None = None
    switch_interval_s: float | None = None


class DecodeProcess:
    """`DecodeLoop` run by a child process (module docstring). `options`: the rest of
    `ChildSpec` (device, max_rows, ...)."""

    def __init__(self, model: str, **options: Any) -> None:
        spec = ChildSpec(model, **options)
        ctx = mp.get_context("spawn")  # no fork of a process holding threads (and CUDA)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(child, spec), name="hlm-decode")
        self._proc.daemon = True
        self._proc.start()
        child.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self._proc.kill()
            raise HLMError(f"the decode process did not load {model} in {START_TIMEOUT_S:g} s")
        try:
            first = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            first = ("failed", f"it exited with code {self._proc.exitcode}")
        if first[0] != "ready":
            raise HLMError(f"the decode process could not start: {first[1]}")
        self.frozen_objects: int = first[1]
        """How many objects the child froze once loaded (`engine.freeze_loaded_heap`)."""
        self.stats: dict[str, Any] = {}
        self._closing = False
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        # Jobs submitted from an event loop wait here for the loop's next turn, or until
        # FLUSH_EVERY of them wait, so that a burst crosses the pipe in a few messages (one
        # pickling, one write, one wake-up of the child each), not one per request.
        self._outbox: list[tuple[Job, tuple]] = []
        self._fresh = threading.Condition()
        self._stats_asked = 0  # the last stats request sent, and the last one answered
        self._stats_answered = 0
        self.submitted_at = 0.0
        """Unix time requests last left for the child (as `DecodeLoop.submitted_at`)."""
        self._reader = threading.Thread(target=self._read, name="decode-reader", daemon=True)
        self._reader.start()
        self.refresh_stats()

    # ------------------------------------------------------------------------- any thread

    def submit(self, rows: list[Row], notify: Callable[[], None], *, stream: bool = False) -> Job:
        # Each row's place in its job (`Delta.index`) is set where the rows decode: by the
        # child's `DecodeLoop` when it takes the job.
        job = Job(rows, notify, stream, id=next(self._ids))
        self._jobs[job.id] = job
        payload = [(row.prompt_ids, row.params, row.seed, row.deadline) for row in rows]
        with self._send_lock:
            self._outbox.append((job, (job.id, payload, stream)))
            first, full = len(self._outbox) == 1, len(self._outbox) >= FLUSH_EVERY
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on an event loop: nothing to gather it with
            loop = None
        if loop is None or full:
            self._flush()
        elif first:
            loop.call_soon(self._flush)
        return job

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        self._flush()  # its submission first
        self._jobs.pop(job.id, None)
        with contextlib.suppress(OSError, ValueError):
            self._send(("cancel", job.id))

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def refresh_stats(self, timeout_s: float = 2.0) -> dict[str, Any]:
        """The child's counters now (blocks up to `timeout_s`; the last known ones after)."""
        with self._fresh:
            self._stats_asked += 1
            token = self._stats_asked
            try:
                self._send(("stats", token))
            except (OSError, ValueError):
                return self.stats
            self._fresh.wait_for(lambda: self._stats_answered >= token, timeout_s)
        return self.stats

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError, ValueError):
            self._send(("stop",))
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()

    # ------------------------------------------------------------------------- internals

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _flush(self) -> None:
        """Send the waiting submissions as one message; if the child is gone, they fail."""
        with self._send_lock:
            waiting, self._outbox = self._outbox, []
            if not waiting:
                return
            try:
                self._conn.send(("submit", [message for _, message in waiting]))
                self.submitted_at = time.time()
                return
            except (OSError, ValueError) as err:
                error = HLMError(f"the decode process is gone ({err})")
        for job, _ in waiting:
            self._finish(job, error=error)

    def _read(self) -> None:
        """The reader thread: hands each child message to its job."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "stats":
                self._set_stats(message[2], message[1])
                continue
            self._set_stats(message[2])  # ("jobs", [news], stats)
            for news in message[1]:
                self._take(news)
        self._proc.join(1)
        err = HLMError(f"the decode process exited (code {self._proc.exitcode})")
        if not self._closing:
            log.error("%s; failing %d request(s) in flight", err, len(self._jobs))
        for job in list(self._jobs.values()):
            self._finish(job, error=err)

    def _take(self, news: tuple) -> None:
        kind, job = news[0], self._jobs.get(news[1])
        if job is None:  # cancelled, or failed already
            return
        if kind == "events":
            job.events.extend(news[2])
            job.notify()
        elif kind == "done":
            for row, result in zip(job.rows, news[2], strict=True):
                row.result = result
            job.events.extend(news[3])
            self._finish(job)
        elif kind == "error":
            self._finish(job, error=news[2])

    def _finish(self, job: Job, error: BaseException | None = None) -> None:
        self._jobs.pop(job.id, None)
        job.error = error
        job.done = True
        job.notify()

    def _set_stats(self, stats: dict[str, Any], token: int | None = None) -> None:
        with self._fresh:
            self.stats = stats
            self._stats_answered = max(self._stats_answered, token or 0)
            self._fresh.notify_all()


# ----------------------------------------------------------------------------- the child


def _child_main(conn, spec: ChildSpec) -> None:
    import sys

    import torch

    from hlm_ray.generate import Generator
    from hlm_ray.serve.engine import DecodeLoop, freeze_loaded_heap

    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    if spec.switch_interval_s:
        sys.setswitchinterval(spec.switch_interval_s)
    jobs: dict[int, Job] = {}
    news: list[tuple] = []  # what a decoding pass told its jobs, sent when the pass ends

    def send_news() -> None:  # on the decode thread, after each pass: one message, one wake-up
        if news:
            batch = news.copy()
            news.clear()
            with contextlib.suppress(OSError, ValueError):  # the replica is gone
                conn.send(("jobs", batch, dict(engine.stats)))

    def fetch(block: bool, timeout: float | None) -> list[Job] | None:
        # The decode thread reads the pipe itself, between passes, and waits on it only when it
        # has nothing to decode: a message the replica sends during a pass wakes no thread here.
        # A reader thread blocked on the pipe woke at every message, and the replica's event
        # loop paid for it inside `send`, about 8 times a burst of 32 requests (serving
        # benchmark, 2 cores, pickling included: 85 -> 71 us median, 244 -> 135 us mean, 325 ->
        # 138 us at p90). This thread is the only one that sends once "ready" is out, and
        # `engine` exists by then: the replica sends nothing before it.
        new: list[Job] = []
        try:
            if block and not conn.poll(timeout):
                return new
            while conn.poll(0):
                message = conn.recv()
                kind = message[0]
                if kind == "submit":
                    for key, payload, stream in message[1]:
                        rows = [Row(ids, params, seed, end) for ids, params, seed, end in payload]
                        job = Job(rows, None, stream, id=key)
                        job.notify = notifier(job)
                        jobs[key] = job
                        new.append(job)
                elif kind == "cancel":
                    job = jobs.pop(message[1], None)
                    if job is not None:
                        job.cancelled = True  # its rows leave before the next pass
                elif kind == "stats":
                    conn.send(("stats", message[1], dict(engine.stats)))
                elif kind == "stop":
                    return None
        except (EOFError, OSError):  # the replica is gone
            return None
        return new

    def notifier(job: Job) -> Callable[[], None]:
        def notify() -> None:  # on the decode thread
            events = [job.events.popleft() for _ in range(len(job.events))]
            if job.error is not None:
                jobs.pop(job.id, None)
                news.append(("error", job.id, _portable(job.error)))
            elif job.done:
                jobs.pop(job.id, None)
                results = [row.result for row in job.rows]
                news.append(("done", job.id, results, events))
            elif events:
                news.append(("events", job.id, events))

        return notify

    try:
        gen = Generator.load(
            spec.model,
            device=spec.device,
            allow_raw_head=spec.allow_raw_head,
            readout=spec.readout,
            name=spec.name,
        )
        engine = DecodeLoop(
            gen, max_rows=spec.max_rows, wait_s=spec.wait_s, after_pass=send_news, fetch=fetch
        )
    except Exception as err:
        conn.send(("failed", one_line(err, with_type=True)))
        return
    conn.send(("ready", freeze_loaded_heap()))
    engine.join()


def _portable(err: BaseException) -> BaseException:
    """The error itself when it pickles (its type and message reach the replica's log and the
    500's message); else a RuntimeError with its one-line summary."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(one_line(err, with_type=True))
