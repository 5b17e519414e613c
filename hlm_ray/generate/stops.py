"""Stop sequences in streamed text: where the first one starts, and how much of the text's end
must be held back because it could still become one.

    first_stop("a cat. A dog", (".",))   # 5
    held_back("the en", ("end",))        # 2: "en" may be the start of "end"
"""

from __future__ import annotations

from collections.abc import Sequence


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the earliest stop sequence starts in `text[start:]`, if any."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that could be the start of a stop sequence."""
    longest = max((len(s) for s in stops), default=1) - 1
    for k in range(min(longest, len(text)), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0
