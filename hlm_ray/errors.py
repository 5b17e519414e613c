"""The one exception type users see, and the one way an error becomes one line of text.

Raise `HLMError` for bad input: the message is a single line that says what was wrong and what
to do. The CLI prints it as ``error: <message>`` and exits with status 2, without a traceback
(`exit_status` does that for a module run as a command).

    raise HLMError("tokenizer.vocab_size=100 is below the 261 byte-level + special tokens; use >= 261")

`one_line` turns any exception (often multi-line: Hugging Face, MLflow, Ray) into one line for
such a message, a log warning, a summary cell or an HTTP answer:

    one_line(err)                        # its first non-empty line
    one_line(err, with_type=True)        # "ValueError: <first line>"
    one_line(err, last=True, limit=200)  # Ray's wrapped errors end with the real cause
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class HLMError(Exception):
    """Bad input or an unusable environment, explained in one line."""


class TrainingDiverged(HLMError):
    """The loss (or the gradient) of a run is not finite: a property of its settings and data,
    not a transient fault, so it is never retried (a restart diverges again)."""


DIVERGED = "training diverged:"
"""How every divergence error begins (`train.log_window.check_finite_loss`, `train.step`)."""


def is_divergence(err: BaseException) -> bool:
    return isinstance(err, TrainingDiverged) or (
        isinstance(err, HLMError) and str(err).startswith(DIVERGED)
    )


class TorchTooOld(HLMError, RuntimeError):
    """An option needs a newer torch than the one installed (a RuntimeError too: a benchmark
    records the arm as unsupported and goes on)."""


def exit_status(command: Callable[[], int]) -> int:
    """Run a command: its own exit status, or 2 with its HLMError printed as one line."""
    try:
        return command()
    except HLMError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def one_line(
    error: BaseException | str,
    *,
    with_type: bool = False,
    last: bool = False,
    limit: int | None = None,
    empty: str | None = None,
) -> str:
    """One line of `error`'s text: its first (or `last`) non-empty line, prefixed by the
    exception's type name with `with_type`, clipped to `limit` characters with "...".

    An exception with no text gives `empty`, or else its type name ("" for an empty string)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if lines:
        line = lines[-1] if last else lines[0]
    elif empty is not None:
        line = empty
    else:
        line = "" if isinstance(error, str) or with_type else type(error).__name__
    if with_type and isinstance(error, BaseException):
        line = f"{type(error).__name__}: {line}"
    if limit is not None and len(line) > limit:
        line = line[: limit - 3] + "..."
    return line
