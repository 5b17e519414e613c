"""A sweep's console: a few lines for the person at the terminal, everything else in a log file.

    with console_to_log(folder / "sweep.log") as console:   # Ray's and Tune's output -> the log
        console.say("trial 1/6 started: vocab=1000 headless")  # -> the terminal and the log
        run_the_trials()
    print(table)                                            # the terminal again

Inside the block, file descriptors 1 and 2 (Ray's C++ logs, workers' output forwarded to the
driver, Tune's tables, warnings) and `sys.stdout` / `sys.stderr` point at the log file, as
Lightning and nanochat keep their consoles to progress and results. `say` writes to the
terminal (the descriptor saved before the redirection) and to the log. Under a test's capture
(`sys.stdout` without a file descriptor) only the Python streams are redirected.
"""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

_current: Console | None = None


class Console:
    """Where `say` writes: the terminal and the log."""

    def __init__(self, terminal: TextIO, log: TextIO) -> None:
        self.terminal = terminal
        self.log = log

    def say(self, line: str) -> None:
        for stream in (self.terminal, self.log):
            stream.write(line + "\n")
            stream.flush()


def say(line: str) -> None:
    """A line for the terminal: through the open `console_to_log` block, else a plain print."""
    if _current is None:
        print(line, flush=True)
    else:
        _current.say(line)


@contextmanager
def console_to_log(path: Path) -> Iterator[Console]:
    """Send everything written in the block to `path` (appended), except `Console.say`."""
    global _current
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    log = open(path, "a", buffering=1)  # noqa: SIM115 (closed in finally)
    log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n")
    saved: list[tuple[int, int]] = []
    try:
        terminal_fd = os.dup(sys.stdout.fileno())
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        terminal = sys.stdout  # a test's capture: no descriptor to save or redirect
    else:
        terminal = os.fdopen(terminal_fd, "w", buffering=1)
        for fd in (1, 2):
            saved.append((fd, os.dup(fd)))
            os.dup2(log.fileno(), fd)
    streams = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = log
    previous, _current = _current, Console(terminal, log)
    try:
        yield _current
    finally:
        _current = previous
        log.flush()
        sys.stdout, sys.stderr = streams
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)
        if terminal is not streams[0]:
            terminal.close()
        log.close()


class Lines:
    """A progress bar's file where the output is not a terminal (a Ray worker's, which Ray
    forwards to the driver's console line by line, each prefixed `(RayTrainWorker pid=...)`):
    every refresh of the bar becomes one whole line. tqdm writes a carriage return before each
    refresh and blanks to clear the bar, which there showed as the prefix over an empty line.

        bar = tqdm(total=n, file=Lines(sys.stderr), mininterval=10)
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()
        if line:
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
