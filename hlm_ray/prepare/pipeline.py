"""Prepare a corpus: the steps, in order, into a resumable folder with a manifest.

    from hlm_ray.prepare import PrepareRequest, prepare
    request = PrepareRequest.from_config(cfg)            # sources, tokenizer, split settings
    prepared = prepare(request)                          # cache folder, reused when it matches
    prepared = prepare(request, "/data/owt2", workers=8) # Ray Data, 8 tokenizing tasks at a time
    tok = prepared.tokenizer()

Steps (each with progress): find the files and cut them into pieces; build the tokenizer
(`corpus_tokenizer.py`); tokenize every piece (`tokenize.py`: in `map_batches` tasks, one
tokenizer per worker process; in process when Ray is not running and `workers` is not given:
the same code); write fixed-size
shards under temporary names, renamed when whole, recording after each one what is committed
(`state.json`), so an interrupted run resumes; write `manifest.json` last. Documents are split
between train and validation by a seeded hash of their text (`split.py`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from hlm_ray.errors import HLMError
from hlm_ray.prepare.corpus_tokenizer import build_tokenizer, check_vocab, check_vocab_size
from hlm_ray.prepare.request import FORMAT_VERSION, Prepared, PrepareRequest, default_output
from hlm_ray.prepare.sources import make_pieces, resolve_sources
from hlm_ray.prepare.split import SPLITS
from hlm_ray.prepare.store import MANIFEST, STATE, TOKENIZER_DIR, ShardWriter, Store
from hlm_ray.prepare.tokenize import tokenized

log = logging.getLogger(__name__)


def _say(progress: bool, message: str) -> None:
    """Progress: on stderr when asked (the `hlm data` command, a terminal), else logged."""
    if progress:
        print(f"[prepare] {message}", file=sys.stderr, flush=True)
    else:
        log.info(message)


def prepare(
    request: PrepareRequest,
    output: str | Path | None = None,
    *,
    workers: int | None = None,
    cache_root: str | None = None,
    allow_smaller_vocab: bool = False,
    progress: bool = True,
    _stop_after_shards: int | None = None,
) -> Prepared:
    """Prepare `request` into `output` (default: the cache, by the request's key) and return it.

    A folder whose manifest has the same key is reused as is; one with an unfinished run of
    the same key is resumed; anything else already there is refused. `workers`: None runs in
    process unless Ray is already running (then on Ray Data with one task per CPU); 0 in
    process; N on Ray Data with N tokenizing tasks at a time."""
    started = time.perf_counter()
    check_vocab_size(request)  # before reading anything
    files = resolve_sources(request.sources, text_field=request.text_field)
    key = request.key(files)
    store = Store.open(
        str(output) if output is not None else default_output(request, key, cache_root)
    )
    with _exclusive(store):  # one preparer per folder; the others wait, then reuse it
        return _prepare_locked(
            request, files, key, store, workers, allow_smaller_vocab, progress, started,
            _stop_after_shards,
        )  # fmt: skip


@contextlib.contextmanager
def _exclusive(store: Store):
    if store.local_path is None:  # object stores have no locks: prepare a folder once
        yield
        return
    lock_path = store.local_path.parent / f".{store.local_path.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _prepare_locked(
    request, files, key, store, workers, allow_smaller_vocab, progress, started, stop_after
) -> Prepared:
    manifest = store.read_json(MANIFEST)
    if manifest is not None:
        if manifest.get("key") != key:
            raise HLMError(
                f"{store.uri} holds a prepared corpus made from other sources or settings; "
                "choose another --output or delete it"
            )
        problem = None
        if store.local_path is not None:  # an object store's copy is checked where it is read
            from hlm_ray.prepare.verify import shard_problem

            problem = shard_problem(store.local_path, manifest)
        if problem is None:
            _say(progress, f"reusing {store.uri} (its manifest matches)")
            return Prepared(store.uri, manifest)
        print(f"warning: {store.uri}: {problem}; preparing it again", file=sys.stderr)
        for name in store.names():
            store.delete(name)
    state = store.read_json(STATE)
    if state is not None and state.get("key") != key:
        raise HLMError(
            f"{store.uri} holds an unfinished preparation of other sources or settings; "
            "choose another --output or delete it"
        )
    leftovers = [n for n in store.names() if not (n.startswith(".") and ".tmp-" in n)]
    if state is None and leftovers:
        raise HLMError(f"{store.uri} is not empty and holds no prepared corpus; choose another")
    fresh = state is None
    try:
        return _run(
            request,
            files,
            key,
            store,
            state,
            workers,
            allow_smaller_vocab,
            progress,
            started,
            stop_after,
        )
    except HLMError:
        if fresh:  # bad input: leave nothing behind that could pass for a preparation
            for name in store.names():
                store.delete(name)
        raise


def _run(
    request, files, key, store, state, workers, allow_smaller_vocab, progress, started, stop_after
):
    store.clean_temporaries()
    total = sum(f.num_bytes for f in files)
    pieces = make_pieces(files, piece_bytes=request.piece_bytes)
    _say(
        progress,
        f"{len(files)} source(s), {sum(len(f.files) for f in files)} file(s), "
        f"{total / 1e6:.1f} MB in {len(pieces)} pieces -> {store.uri}",
    )

    if state is None:
        tok = build_tokenizer(request, pieces, lambda message: _say(progress, message))
        check_vocab(tok, request, allow_smaller_vocab)
        from hlm_ray.tokenizer import save_tokenizer, tokenizer_fingerprint

        with tempfile.TemporaryDirectory() as tmp:
            save_tokenizer(tok, tmp)
            store.delete(TOKENIZER_DIR)
            store.upload_dir(Path(tmp), TOKENIZER_DIR)
        state = {
            "key": key,
            "tokenizer_fingerprint": tokenizer_fingerprint(tok),
            "vocab_size": len(tok),
            "eos_id": tok.eos_token_id,
            "splits": {},
        }
        store.write_json(STATE, state)
    else:
        _say(progress, "resuming an unfinished preparation")
    dtype = "uint16" if state["vocab_size"] <= 65_536 else "uint32"

    writers = {}
    for split in SPLITS:
        saved = state["splits"].get(split, {"shards": [], "cursor": [0, 0]})
        writers[split] = ShardWriter(
            store,
            split,
            np.dtype(dtype),
            request.shard_tokens,
            state["eos_id"],
            shards=saved["shards"],
            cursor=tuple(saved["cursor"]),
        )
    committed = [0]

    def save_state():
        state["splits"] = {s: w.state() for s, w in writers.items()}
        store.write_json(STATE, state)
        committed[0] += 1
        if stop_after is not None and committed[0] >= stop_after:
            raise KeyboardInterrupt("stopped for a test")

    for w in writers.values():
        w.on_flush = save_state
    first = min(w.cursor[0] for w in writers.values())
    tok_dir = store.local_path / TOKENIZER_DIR if store.local_path else None
    with tempfile.TemporaryDirectory() as tmp:
        if tok_dir is None:  # a remote store: the Ray tasks load a local copy
            tok_dir = Path(tmp)
            import pyarrow.fs as pafs

            pafs.copy_files(store.path(TOKENIZER_DIR), tmp, store.fs, pafs.LocalFileSystem())
        fn_args = {
            "tokenizer_dir": str(tok_dir),
            "request": asdict(request),
            "eos_id": state["eos_id"],
            "dtype": dtype,
        }
        tokenize_start = time.perf_counter()
        tokens, text_bytes = _write(pieces[first:], fn_args, workers, writers, total, progress)
        state["timings"] = {
            "tokenize_s": round(time.perf_counter() - tokenize_start, 3),
            "text_bytes": text_bytes,
            "workers": workers,
        }
    for w in writers.values():
        w.finish()
    return _finish(
        request, files, key, store, state, writers, dtype, started, text_bytes, tokens, progress
    )


def _write(pieces, fn_args, workers, writers, total, progress) -> tuple[int, int]:
    from tqdm import tqdm

    if workers is None:
        try:
            import ray
        except ImportError:  # the bare core: tokenize in process
            ray = None
        if ray is not None and ray.is_initialized():
            workers = max(1, int(ray.available_resources().get("CPU", 1)))
    bar = tqdm(
        total=sum(p.stop - p.start for p in pieces if p.unit != "parquet") or None,
        unit="B",
        unit_scale=True,
        desc="[prepare] tokenizing",
        disable=not progress,
        file=sys.stderr,
        mininterval=1.0 if sys.stderr.isatty() else 30.0,
    )
    sizes = {p.index: p.stop - p.start for p in pieces}
    num_tokens = num_bytes = 0
    for index, splits, nbytes in tokenized(pieces, fn_args, workers):
        for split, w in writers.items():
            if index < w.cursor[0]:
                continue
            w.add(splits[split], index, skip=w.cursor[1] if index == w.cursor[0] else 0)
            num_tokens += len(splits[split])
        num_bytes += nbytes
        bar.update(sizes[index] if bar.total else 0)
    bar.close()
    return num_tokens, num_bytes


def _finish(
    request, files, key, store, state, writers, dtype, started, text_bytes, tokens, progress
) -> Prepared:
    splits = {s: w.summary() for s, w in writers.items()}
    if splits["train"]["num_documents"] == 0:
        raise HLMError(f"no text found in {list(request.sources)}: the corpus is empty")
    if splits["val"]["num_documents"] == 0:
        raise HLMError(
            f"no document of {list(request.sources)} fell in the validation split "
            f"(data.val_fraction={request.val_fraction}); add text or raise data.val_fraction"
        )
    checksums = [sh["sha256"] for s in SPLITS for sh in splits[s]["shards"]]
    manifest = {
        "format_version": FORMAT_VERSION,
        "key": key,
        "fingerprint": hashlib.sha256(
            json.dumps([key, state["tokenizer_fingerprint"], checksums]).encode()
        ).hexdigest(),
        "sources": [
            {
                "source": f.source,
                "files": len(f.files),
                "bytes": f.num_bytes,
                "fingerprint": f.fingerprint,
            }
            for f in files
        ],
        "request": asdict(request),
        "tokenizer": {
            "path": TOKENIZER_DIR,
            "fingerprint": state["tokenizer_fingerprint"],
            "vocab_size": state["vocab_size"],
            "eos_id": state["eos_id"],
        },
        "dtype": dtype,
        "shard_tokens": request.shard_tokens,
        "splits": splits,
        "timings": {**state.get("timings", {}), "total_s": round(time.perf_counter() - started, 3)},
    }
    store.write_json(MANIFEST, manifest)
    store.delete(STATE)
    seconds = time.perf_counter() - started
    n_tok = sum(s["num_tokens"] for s in splits.values())
    n_docs = sum(s["num_documents"] for s in splits.values())
    n_shards = sum(len(s["shards"]) for s in splits.values())
    per_token = f", {text_bytes / tokens:.2f} bytes/token" if tokens else ""
    _say(
        progress,
        f"done: {n_docs:,} documents, {n_tok:,} tokens "
        f"(train {splits['train']['num_tokens']:,}, val {splits['val']['num_tokens']:,})"
        f"{per_token}, {n_shards} shards, {seconds:.1f} s, {n_tok / max(seconds, 1e-9):,.0f} "
        f"tokens/s -> {store.uri}",
    )
    return Prepared(store.uri, manifest)


def remove(prepared: str | Path) -> None:
    """Delete a local prepared folder."""
    shutil.rmtree(prepared, ignore_errors=True)
