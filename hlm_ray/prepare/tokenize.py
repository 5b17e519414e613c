"""Tokenizing pieces of the corpus: the `map_batches` function (`TokenizePieces`) and the loop that
runs it in this process or on Ray Data (`tokenized`), in piece order.

    fn_args = {"tokenizer_dir": dir, "request": asdict(request), "eos_id": 0, "dtype": "uint16"}
    for index, {"train": tokens, "val": tokens}, text_bytes in tokenized(pieces, fn_args, workers=4):
        ...

Each piece's documents are split (`split.py`), tokenized in batches of `ENCODE_BATCH` and followed
by EOS. On Ray Data, `workers` tasks at a time, each on one thread (the tasks are the
parallelism), one tokenizer per worker process; a worker's HLMError (bad UTF-8, an unreadable
file) surfaces as that one error.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from hlm_ray.errors import HLMError
from hlm_ray.prepare.request import PrepareRequest
from hlm_ray.prepare.sources import Piece, read_documents
from hlm_ray.prepare.split import SPLITS, split_documents

ENCODE_BATCH = 1024  # documents per encode_batch call


class TokenizePieces:
    """The `map_batches` function: read pieces, split their documents, tokenize, EOS after
    each document. Built once per Ray worker process (or once in process): loads the tokenizer."""

    def __init__(
        self, tokenizer_dir: str, request: dict, eos_id: int, dtype: str, threads: int = 0
    ):
        if threads:  # a Ray task: one thread, the tasks are the parallelism (before any encode)
            import os

            os.environ["RAYON_NUM_THREADS"] = str(threads)
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        self.request = PrepareRequest(**{**request, "sources": tuple(request["sources"])})
        self.eos_id, self.dtype = eos_id, np.dtype(dtype)

    def encode(self, docs: list[str]) -> np.ndarray:
        parts: list[np.ndarray] = []
        eos = np.array([self.eos_id], dtype=self.dtype)
        for start in range(0, len(docs), ENCODE_BATCH):
            chunk = docs[start : start + ENCODE_BATCH]
            for enc in self.tok.encode_batch_fast(chunk, add_special_tokens=False):
                parts.append(np.asarray(enc.ids, dtype=self.dtype))
                parts.append(eos)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    def rows(self, batch: dict) -> dict[str, list]:
        """{index, train, val, bytes} lists for the pieces of `batch` (tokens as raw bytes)."""
        r = self.request
        rows: dict[str, list] = {"index": [], "train": [], "val": [], "bytes": []}
        for i in range(len(batch["index"])):
            piece = Piece(**{k: _plain(batch[k][i]) for k in Piece.__dataclass_fields__})
            docs = read_documents(piece, text_field=r.text_field, invalid_utf8=r.invalid_utf8)
            splits = split_documents(docs, r.split_seed, r.val_fraction)
            rows["index"].append(piece.index)
            rows["bytes"].append(sum(len(d.encode("utf-8")) for d in docs))
            for split in SPLITS:
                rows[split].append(self.encode(splits[split]).tobytes())
        return rows

    def __call__(self, batch: dict):
        """The rows as a pyarrow table (what Ray Data's `map_batches` passes on)."""
        import pyarrow as pa

        cols = {"index": pa.int64(), "train": pa.large_binary(), "val": pa.large_binary()}
        cols["bytes"] = pa.int64()
        return pa.table({k: pa.array(v, cols[k]) for k, v in self.rows(batch).items()})


_loaded: dict[str, TokenizePieces] = {}  # a Ray worker process's tokenizer, by its arguments


def tokenize_pieces(batch: dict, **fn_args):
    """The Ray Data task: `TokenizePieces` over `batch`, built once per worker process (Ray
    runs a process's next task in it: the tokenizer is loaded once, not per piece)."""
    key = json.dumps(fn_args, sort_keys=True)
    if key not in _loaded:
        _loaded.clear()  # one request at a time
        _loaded[key] = TokenizePieces(**fn_args)
    return _loaded[key](batch)


def _plain(value):
    return value.item() if hasattr(value, "item") else value


def _batches(pieces: list[Piece]) -> dict:
    return {k: np.array([getattr(p, k) for p in pieces]) for k in Piece.__dataclass_fields__}


def tokenized(pieces, fn_args: dict, workers: int | None) -> Iterator[tuple[int, dict, int]]:
    """(piece index, {split: tokens}, text bytes) in piece order, in process or on Ray Data."""
    if not pieces:
        return
    if workers is None or workers == 0:
        fn = TokenizePieces(**fn_args)
        for piece in pieces:  # in process: plain lists, no pyarrow
            yield from _rows(fn.rows(_batches([piece])), fn_args["dtype"])
        return
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=workers, log_to_driver=False, include_dashboard=False)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # shards must follow piece order
    ctx.enable_progress_bars = False
    ds = ray.data.from_items([p.to_row() for p in pieces], override_num_blocks=len(pieces))
    # Tasks, not an actor pool: Ray Data's actors get their arguments from the object store
    # and restart from them by default, which Ray reports at every start with an error-level
    # line (its issue 53727); a lost task is retried from its piece. One CPU each.
    ds = ds.map_batches(
        tokenize_pieces,
        fn_kwargs={**fn_args, "threads": 1},
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.TaskPoolStrategy(size=workers),  # `concurrency=` is deprecated
        num_cpus=1,
    )
    failure = None
    try:
        for table in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=4):
            yield from _rows(table.to_pydict(), fn_args["dtype"])
    except Exception as err:
        failure = as_hlm_error(err)
    if failure is not None:  # what Ray's error holds (`ds`, reference cycles) is let go at once:
        del ds  # a kept error kept the pool's CPUs (a 2-worker run then waited forever)
        gc.collect()
        raise failure


def _rows(cols: dict[str, list], dtype: str):
    for i, index in enumerate(cols["index"]):
        splits = {s: np.frombuffer(cols[s][i], dtype=dtype) for s in SPLITS}
        yield index, splits, cols["bytes"][i]


def as_hlm_error(err: BaseException) -> BaseException:
    """A worker's HLMError (bad UTF-8, unreadable file) surfaces as that one clear error."""
    seen = err
    while seen is not None:
        # A RayTaskError first: Ray makes it an instance of its cause's class too (an
        # `HLMError` here), but its text is the task's whole traceback; `.cause` is the
        # worker's own exception, whose text is the one line.
        cause = getattr(seen, "cause", None)
        if isinstance(cause, BaseException) and cause is not seen:
            seen = cause
            continue
        if isinstance(seen, HLMError):
            return HLMError(str(seen))
        seen = seen.__cause__
    text = str(err)
    if "HLMError: " in text:
        return HLMError(text.split("HLMError: ", 1)[1].splitlines()[0])
    return err
