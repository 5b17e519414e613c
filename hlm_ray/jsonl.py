"""JSON-lines files read one object a line, with one clear error that names the bad line.

    for where, record in json_objects(path, expected='{"context", "continuation"}'):
        ...    # where: "data.jsonl, line 3", for the caller's own errors about the record

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
