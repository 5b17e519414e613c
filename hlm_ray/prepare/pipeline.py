"""Prepare a corpus: tokenizer, token shards, document-level split, manifest. Then read it.

    from hlm_ray.prepare import PrepareRequest, prepare
    request = PrepareRequest.from_config(cfg)            # sources, tokenizer, split settings
    prepared = prepare(request)                          # cache folder, reused when it matches
    prepared = prepare(request, "/data/owt2", workers=8) # Ray Data, 8 tokenizer actors
    tok = prepared.tokenizer()

Steps (each with progress): find the files and cut them into pieces; train the BPE on a seeded
sample of *training* documents (`tokenizer.train_sample_bytes`), or load a tokenizer file;
tokenize every piece (in `map_batches`, one tokenizer per actor; in process when Ray is not
running and `workers` is not given: the same code); write fixed-size shards under temporary
names, renamed when whole, recording after each one what is committed (`state.json`), so an
interrupted run resumes; write `manifest.json` last. A document goes to validation when a
seeded hash of its text falls below `data.val_fraction`: a document lies wholly in one split,
duplicates share a split, and the split does not depend on how the work is cut.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hlm_ray.errors import HLMError
from hlm_ray.paths import cache_dir
from hlm_ray.prepare.sources import Piece, SourceFiles, make_pieces, read_documents, resolve_sources
from hlm_ray.prepare.store import MANIFEST, STATE, TOKENIZER_DIR, ShardWriter, Store

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
SPLITS = ("train", "val")
ENCODE_BATCH = 1024  # documents per encode_batch call


@dataclass(frozen=True)
class PrepareRequest:
    """Everything the prepared folder depends on (its cache key, with the sources' files)."""

    sources: tuple[str, ...]
    family: str = "decoder"
    """Model family: which special tokens the tokenizer gets."""
    tokenizer_kind: str = "bpe"
    vocab_size: int = 1024
    tokenizer_path: str | None = None
    min_frequency: int = 2
    train_sample_bytes: int | None = 100_000_000
    text_field: str = "text"
    val_fraction: float = 0.02
    split_seed: int = 0
    shard_tokens: int = 1 << 24
    piece_bytes: int = 8 << 20
    invalid_utf8: str = "refuse"

    @classmethod
    def from_config(cls, cfg) -> PrepareRequest:
        t, d = cfg.tokenizer, cfg.data
        return cls(
            sources=tuple(d.sources),
            family=cfg.model.family,
            tokenizer_kind=t.kind,
            vocab_size=t.vocab_size,
            tokenizer_path=t.path,
            min_frequency=t.min_frequency,
            train_sample_bytes=t.train_sample_bytes,
            text_field=d.text_field,
            val_fraction=d.val_fraction,
            split_seed=d.split_seed,
            shard_tokens=d.shard_tokens,
            invalid_utf8=d.invalid_utf8,
        )

    def key(self, files: list[SourceFiles]) -> str:
        """What the tokens depend on: settings (not where the work is cut) and source files."""
        settings = {k: v for k, v in asdict(self).items() if k not in ("sources", "piece_bytes")}
        if self.tokenizer_kind == "file":
            settings.pop("vocab_size"), settings.pop("min_frequency")
            settings.pop("train_sample_bytes")
        payload = {
            "format": FORMAT_VERSION,
            "settings": settings,
            "sources": [f.fingerprint for f in files],  # files, not how they were named
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Prepared:
    """A finished prepared folder."""

    uri: str
    manifest: dict

    @property
    def path(self) -> Path:
        return Path(self.uri)

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    def tokenizer(self):
        from hlm_ray.tokenizer import load_tokenizer

        return load_tokenizer(self.path / TOKENIZER_DIR)


def _say(progress: bool, message: str) -> None:
    """Progress: on stderr when asked (the `hlm data` command, a terminal), else logged."""
    if progress:
        print(f"[prepare] {message}", file=sys.stderr, flush=True)
    else:
        log.info(message)


# ----------------------------------------------------------------------------- the split


def is_validation(doc: str, seed: int, val_fraction: float) -> bool:
    """A seeded hash of the document's text, as a number in [0, 1), below `val_fraction`."""
    digest = hashlib.blake2b(doc.encode("utf-8"), digest_size=8, salt=seed.to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little") / 2**64 < val_fraction


def split_documents(docs: list[str], seed: int, val_fraction: float) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"train": [], "val": []}
    for doc in docs:
        out["val" if is_validation(doc, seed, val_fraction) else "train"].append(doc)
    return out


# ----------------------------------------------------------------------------- tokenizing


class TokenizePieces:
    """The `map_batches` function: read pieces, split their documents, tokenize, EOS after
    each document. Built once per Ray Data actor (or once in process): loads the tokenizer."""

    def __init__(
        self, tokenizer_dir: str, request: dict, eos_id: int, dtype: str, threads: int = 0
    ):
        if threads:  # an actor: one thread, the actors are the parallelism (before any encode)
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


def _plain(value):
    return value.item() if hasattr(value, "item") else value


def _batches(pieces: list[Piece]) -> dict:
    return {k: np.array([getattr(p, k) for p in pieces]) for k in Piece.__dataclass_fields__}


def _tokenized(pieces, fn_args: dict, workers: int | None) -> Iterator[tuple[int, dict, int]]:
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
    ds = ds.map_batches(
        TokenizePieces,
        fn_constructor_kwargs={**fn_args, "threads": 1},
        batch_size=1,
        batch_format="numpy",
        concurrency=workers,
        num_cpus=1,
    )
    failure = None
    try:
        for table in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=4):
            yield from _rows(table.to_pydict(), fn_args["dtype"])
    except Exception as err:
        failure = as_hlm_error(err)
    if failure is not None:  # actors' handles sit in Ray's error, `ds` and reference cycles: a
        del ds  # kept error kept the actors and their CPUs (a 2-worker run then waited forever)
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
        if isinstance(seen, HLMError):
            return HLMError(str(seen))
        cause = getattr(seen, "cause", None)
        seen = cause if isinstance(cause, BaseException) else seen.__cause__
    text = str(err)
    if "HLMError: " in text:
        return HLMError(text.split("HLMError: ", 1)[1].splitlines()[0])
    return err


# ----------------------------------------------------------------------------- the tokenizer


def training_sample(pieces: list[Piece], request: PrepareRequest) -> list[str]:
    """Training documents (never validation ones) from pieces in a seeded order, up to
    `train_sample_bytes` UTF-8 bytes (all of them when None)."""
    order = list(range(len(pieces)))
    random.Random(request.split_seed).shuffle(order)
    budget, texts = request.train_sample_bytes, []
    for i in order:
        docs = read_documents(
            pieces[i], text_field=request.text_field, invalid_utf8=request.invalid_utf8
        )
        for doc in split_documents(docs, request.split_seed, request.val_fraction)["train"]:
            texts.append(doc)
            if budget is not None:
                budget -= len(doc.encode("utf-8"))
                if budget <= 0:
                    return texts
    return texts


def _build_tokenizer(request: PrepareRequest, pieces: list[Piece], progress: bool):
    from hlm_ray.tokenizer import load_tokenizer, special_tokens_for, train_bpe

    specials = special_tokens_for(request.family)
    if request.tokenizer_kind == "file":
        return load_tokenizer(request.tokenizer_path, special_tokens=specials)
    start = time.perf_counter()
    texts = training_sample(pieces, request)
    if not texts:
        raise HLMError(f"no text found in {list(request.sources)}: the corpus is empty")
    size = sum(len(t.encode("utf-8")) for t in texts)
    _say(
        progress,
        f"sampled {len(texts):,} training documents ({size / 1e6:.1f} MB) "
        f"in {time.perf_counter() - start:.1f} s; training a {request.vocab_size}-token BPE",
    )
    start = time.perf_counter()
    tok = load_tokenizer(
        train_bpe(texts, request.vocab_size, specials, min_frequency=request.min_frequency)
    )
    _say(progress, f"trained the BPE in {time.perf_counter() - start:.1f} s")
    return tok


def _check_vocab(tok, request: PrepareRequest, allow_smaller_vocab: bool) -> None:
    if (
        request.tokenizer_kind == "bpe"
        and len(tok) < request.vocab_size
        and not allow_smaller_vocab
    ):
        raise HLMError(
            f"the corpus is too small for tokenizer.vocab_size={request.vocab_size}: BPE "
            f"training stopped at {len(tok)} tokens; add text, raise "
            "tokenizer.train_sample_bytes, or lower tokenizer.vocab_size"
        )


# ----------------------------------------------------------------------------- preparing


def default_output(request: PrepareRequest, key: str, root: str | None = None) -> str:
    name = f"{request.tokenizer_kind}{request.vocab_size}-{key[:16]}"
    if request.tokenizer_kind == "file":
        name = f"file-{key[:16]}"
    if root:
        return f"{root.rstrip('/')}/{name}"
    return str(cache_dir("prepared") / name)


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
    process unless Ray is already running (then on Ray Data with one actor per CPU); 0 in
    process; N on Ray Data with N tokenizer actors."""
    started = time.perf_counter()
    if request.tokenizer_kind == "bpe":  # before reading anything
        from hlm_ray.tokenizer import BYTE_ALPHABET, special_tokens_for

        minimum = BYTE_ALPHABET + len(special_tokens_for(request.family))
        if request.vocab_size < minimum:
            raise HLMError(
                f"tokenizer.vocab_size={request.vocab_size} is below the {BYTE_ALPHABET} "
                f"byte-level + {minimum - BYTE_ALPHABET} special tokens; use at least {minimum}"
            )
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
        _say(progress, f"reusing {store.uri} (its manifest matches)")
        return Prepared(store.uri, manifest)
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
        tok = _build_tokenizer(request, pieces, progress)
        _check_vocab(tok, request, allow_smaller_vocab)
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
        if tok_dir is None:  # a remote store: the actors load a local copy
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
    for index, splits, nbytes in _tokenized(pieces, fn_args, workers):
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
