"""JSON files with one clear error that names the bad line: JSON-lines files read one object a
line, and the small JSON files of a run folder.

    for where, record in json_objects(path, expected='{"context", "continuation"}'):
        ...    # where: "data.jsonl, line 3", for the caller's own errors about the record
    settings = json_file(run / "launch.json", fix="delete it and give the flags again")

Blank lines are skipped; a byte-order mark is allowed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from hlm_ray.errors import HLMError


def json_objects(path: str | Path, *, expected: str) -> Iterator[tuple[str, dict]]:
    """(where, record) for each non-blank line of `path`; `expected` says what a line should be
    (in the error when a line is JSON but not an object)."""
    with Path(path).open(encoding="utf-8-sig") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            where = f"{path}, line {number}"
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                raise HLMError(f"{where}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise HLMError(
                    f"{where}: expected a JSON object with {expected}, got {record!r:.40}"
                )
            yield where, record


def json_file(path: str | Path, *, fix: str) -> dict:
    """The JSON object in `path`; a file that is empty, cut short or not an object (a write cut
    by a full disk or a power loss, an editor's slip) raises `HLMError` naming it, where it
    broke, and `fix`: what to do about it."""
    text = Path(path).read_text(errors="replace")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        why = "it is empty" if not text.strip() else (
            f"not JSON at line {err.lineno}, column {err.colno}: {err.msg}"
        )  # fmt: skip
        raise HLMError(f"{path} is damaged ({why}); {fix}") from None
    if not isinstance(value, dict):
        raise HLMError(f"{path} is damaged (it holds {type(value).__name__}, not an object); {fix}")
    return value
