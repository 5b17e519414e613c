"""The replica's access log: one line per completion request (id, status, latency, token
counts), written in batches at quiet moments rather than on the request's path.

    access = AccessLog(logging.getLogger("ray.serve"))
    access.started(); ...; access.add(rid, 200, 12.5, 7, 16, 1, False, "tiny/1", "")
    access.finished()          # none left in flight: the queued lines are written now

Why: each line costs the replica's one event loop ~40 us in Ray's log-record factory and
Serve's handlers, a tenth of a request's path there (py-spy, docs/benchmarks.md); written when
no request is in flight, they cost the requests nothing. Lines are never dropped: with
requests always in flight they are written at the latest `flush_s` or `batch_lines` later,
and `flush()` writes what is queued (the replica calls it when it shuts down).
"""

from __future__ import annotations

import asyncio
import logging

LINE = (
    "completion %s status=%d latency_ms=%.1f prompt_tokens=%d completion_tokens=%d "
    "rows=%d stream=%s model=%s%s"
)


class AccessLog:
    """Access lines queued on an event loop and written in batches (module docstring)."""

    def __init__(self, logger: logging.Logger, *, flush_s: float = 0.5, batch_lines: int = 256):
        self.logger = logger
        self.flush_s = flush_s
        self.batch_lines = batch_lines
        self.in_flight = 0
        self._lines: list[tuple] = []
        self._timer: asyncio.TimerHandle | None = None

    def started(self) -> None:
        self.in_flight += 1

    def finished(self) -> None:
        """A request was answered; with none left in flight, write the queue on the loop's
        next turn (after this answer went out)."""
        self.in_flight -= 1
        if self.in_flight == 0 and self._lines:
            asyncio.get_running_loop().call_soon(self.flush)

    def add(self, *fields) -> None:
        """Queue one line (`LINE`'s fields); off an event loop it is written at once."""
        self._lines.append(fields)
        if len(self._lines) >= self.batch_lines:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = loop.call_later(self.flush_s, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        lines, self._lines = self._lines, []
        for fields in lines:
            self.logger.info(LINE, *fields)
