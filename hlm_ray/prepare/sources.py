"""Sources -> files -> pieces (units of work) -> documents, the same way in every process.

    files = resolve_sources(["corpus/en", "my.jsonl"], text_field="text")  # [SourceFiles]
    pieces = make_pieces(files, piece_bytes=8 << 20)                        # [Piece]
    docs = read_documents(pieces[0], text_field="text", invalid_utf8="refuse")

A document is a JSON line's / parquet row's text field, or, in a .txt file, a paragraph (text
between blank lines); a .txt file without a blank line in its first MiB is read a line at a
time (WikiText-style: one paragraph a line). Documents are stripped; empty ones are dropped.
Large files are cut into pieces at document boundaries, so a piece's documents are exactly the
ones a single reader of the whole file sees there, whatever the cut: tokenization in parallel
pieces equals tokenization of the whole stream.

Hub datasets are streamed once into JSON-lines files under ``cache_dir("hub")`` and then read
like local files; an unreachable hub fails within seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

from hlm_ray.errors import HLMError
from hlm_ray.paths import (
    DATA_ENV,
    HubDataset,
    cache_dir,
    data_dir,
    data_dir_said,
    has_shared,
    hub_specs,
    load_hub,
)

SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
_BLANK = re.compile(rb"\n[ \t\r\f\v]*\n")
_BLANK_STR = re.compile(r"\n[ \t\r\f\v]*\n")
_SNIFF = 1 << 20  # bytes read to decide a .txt file's document unit and check it is text
HUB_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class SourceFiles:
    """One source as given, the files it stands for, and a fingerprint of them."""

    source: str
    files: tuple[str, ...]
    fingerprint: str
    num_bytes: int


@dataclass(frozen=True)
class Piece:
    """A unit of work: bytes [start, stop) of a text/JSON-lines file, or one parquet row group
    (start = the group's index). `unit` is paragraph | line | jsonl | parquet."""

    index: int
    path: str
    unit: str
    start: int
    stop: int

    def to_row(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- resolving


def resolve_sources(sources, *, text_field: str = "text") -> list[SourceFiles]:
    """Every source's files (sorted), checked readable and not binary; hub datasets staged."""
    if isinstance(sources, str):
        sources = [sources]
    if not sources:
        raise HLMError("no sources given; pass files, folders or hub dataset names")
    return [_resolve(str(s), text_field) for s in sources]


def _resolve(source: str, text_field: str) -> SourceFiles:
    path = Path(source).expanduser()
    if not path.exists() and has_shared(source):
        path = data_dir() / source
    if path.exists():
        files = _files_of(path)
    elif source.startswith(("/", "./", "../", "~")) or Path(source).suffix in SUFFIXES:
        raise HLMError(
            f"no file or folder {source} (nor {data_dir() / source}); pass an existing path, "
            "a folder of .txt/.jsonl/.parquet files, or a hub dataset name"
        )
    else:
        files = stage_hub(source, text_field)
    for f in files:
        _check_file(f)
    stats = [(os.path.basename(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
    digest = hashlib.sha256(json.dumps(stats).encode()).hexdigest()
    return SourceFiles(source, tuple(files), digest, sum(s[1] for s in stats))


def _files_of(path: Path) -> list[str]:
    if not path.is_dir() and not path.is_file():  # opening a named pipe waits for a writer
        raise HLMError(
            f"{path} is not a regular file (a named pipe, socket or device); the corpus is read "
            "more than once: write it to a file and pass that"
        )
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise HLMError(f"{path} holds no .txt/.jsonl/.json/.parquet files; pass text files")
        return files
    if path.suffix not in SUFFIXES:
        raise HLMError(f"cannot read {path}: use a .txt, .jsonl, .json or .parquet file")
    return [str(path)]


def _check_file(path: str) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF)
    except OSError as err:
        raise HLMError(f"cannot read {path}: {err.strerror or err}") from None
    if not path.endswith(".parquet") and b"\x00" in head:
        raise HLMError(f"{path} looks binary (it holds NUL bytes), not text; remove it")


# ----------------------------------------------------------------------------- hub datasets


def _check_hub_reachable(source: str) -> None:
    """Fail in seconds, not after the hub client's retries, when the hub cannot be reached."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise HLMError(
            f"no file or folder {source} here or in the data folder {data_dir_said()}, and the "
            "hub cannot be reached (HF_HUB_OFFLINE is set) where it is not staged in the cache; "
            f"point {DATA_ENV} at the folder that holds {source}, or pass a local path"
        )
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=HUB_TIMEOUT_S).close()
    except OSError as err:
        raise HLMError(
            f"no file or folder {source} here or in the data folder {data_dir_said()}, and the "
            f"hub ({url.hostname}) cannot be reached within {HUB_TIMEOUT_S:.0f} s ({err}); "
            f"point {DATA_ENV} at the folder that holds {source}, or pass a local path"
        ) from None


def stage_hub(source: str, text_field: str, *, docs_per_file: int = 100_000) -> list[str]:
    """Stream a hub dataset once into JSON-lines files in the cache; returns their paths."""
    specs = hub_specs(source, text_field)
    files: list[str] = []
    for hub in specs:
        tag = hashlib.sha256(json.dumps(asdict(hub)).encode()).hexdigest()[:16]
        folder = cache_dir("hub", f"{hub.name.replace('/', '--')}-{tag}")
        done = folder / "DONE"
        if not done.exists():
            _check_hub_reachable(source)
            _stream_to_jsonl(hub, folder, docs_per_file)
            done.write_text("ok\n")
        files += sorted(str(p) for p in folder.glob("part-*.jsonl"))
    return files


def _stream_to_jsonl(hub: HubDataset, folder: Path, docs_per_file: int) -> None:
    def flush(rows: list[str], part: int) -> None:
        with open(folder / f"part-{part:05d}.jsonl", "w") as out:
            out.writelines(json.dumps({"text": text}) + "\n" for text in rows)

    try:
        stream = load_hub(hub.name, hub.name, hub.config, hub.split, streaming=True)
        part, rows = 0, []
        for row in stream:
            if hub.text_field not in row:
                raise HLMError(f"hub dataset {hub.name} has no {hub.text_field!r} field")
            rows.append(row[hub.text_field])
            if len(rows) == docs_per_file:
                flush(rows, part)
                part, rows = part + 1, []
        if rows:
            flush(rows, part)
    except HLMError:
        raise
    except Exception as err:
        raise HLMError(f"hub dataset {hub.name} could not be read: {err}".splitlines()[0]) from err


# ----------------------------------------------------------------------------- pieces


def _txt_unit(path: str) -> str:
    with open(path, "rb") as f:
        head = f.read(_SNIFF)
    return "paragraph" if _BLANK.search(head) else "line"


def _cuts(path: str, size: int, piece_bytes: int, pattern: re.Pattern) -> list[int]:
    """Byte offsets where pieces start: just after the first document boundary (a blank line,
    or a newline) at or after each multiple of `piece_bytes` from the previous cut."""
    cuts = [0]
    with open(path, "rb") as f:
        pos = piece_bytes
        while pos < size:
            f.seek(pos)
            window = f.read(1 << 16)
            match = pattern.search(window)
            if match is None:  # no boundary in this window (a huge document): look further
                if not window:
                    break
                pos += len(window) - 64
                continue
            cut = pos + match.end()
            if cut >= size:
                break
            cuts.append(cut)
            pos = cut + piece_bytes
    return cuts


def make_pieces(sources: list[SourceFiles], *, piece_bytes: int) -> list[Piece]:
    """All files of all sources, in order, cut into pieces of about `piece_bytes`."""
    pieces: list[Piece] = []
    for src in sources:
        for path in src.files:
            if path.endswith(".parquet"):
                import pyarrow.parquet as pq

                try:
                    groups = pq.ParquetFile(path).num_row_groups
                except Exception as err:
                    raise HLMError(f"cannot read parquet file {path}: {err}") from None
                for g in range(groups):
                    pieces.append(Piece(len(pieces), path, "parquet", g, g + 1))
                continue
            size = os.path.getsize(path)
            unit = "jsonl" if path.endswith((".jsonl", ".json")) else _txt_unit(path)
            pattern = _BLANK if unit == "paragraph" else re.compile(rb"\n")
            cuts = _cuts(path, size, piece_bytes, pattern) + [size]
            for start, stop in zip(cuts, cuts[1:], strict=False):
                pieces.append(Piece(len(pieces), path, unit, start, stop))
    return pieces


# ----------------------------------------------------------------------------- documents


def _decode(raw: bytes, piece: Piece, invalid_utf8: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if invalid_utf8 == "replace":
            return raw.decode("utf-8", errors="replace")
        raise HLMError(
            f"{piece.path} is not valid UTF-8 (byte {piece.start + err.start}); fix the file or "
            "set data.invalid_utf8=replace"
        ) from None


def read_documents(piece: Piece, *, text_field: str, invalid_utf8: str) -> list[str]:
    """The piece's non-empty, stripped documents in file order."""
    if piece.unit == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(piece.path).read_row_group(piece.start)
        if text_field not in table.column_names:
            raise HLMError(f"{piece.path} has no {text_field!r} column; set data.text_field")
        texts = table.column(text_field).to_pylist()
        return [t.strip() for t in texts if t and t.strip()]
    try:
        with open(piece.path, "rb") as f:
            f.seek(piece.start)
            raw = f.read(piece.stop - piece.start)
    except OSError as err:
        raise HLMError(f"cannot read {piece.path}: {err.strerror or err}") from None
    text = _decode(raw, piece, invalid_utf8)
    if piece.unit == "jsonl":
        return _json_lines(text, piece, text_field)
    parts = _BLANK_STR.split(text) if piece.unit == "paragraph" else text.split("\n")
    return [p.strip() for p in parts if p.strip()]


def _json_lines(text: str, piece: Piece, text_field: str) -> list[str]:
    docs = []
    for n, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise HLMError(
                f"{piece.path}: line {n + 1} of the piece at byte {piece.start} is not JSON"
            ) from None
        if not isinstance(row, dict) or text_field not in row:
            raise HLMError(f"{piece.path} has rows without a {text_field!r} field; set text_field")
        value = row[text_field]
        if isinstance(value, str) and value.strip():
            docs.append(value.strip())
    return docs
