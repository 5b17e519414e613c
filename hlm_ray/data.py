"""Text corpora -> packed token blocks, deterministic batch order, and BERT masking.

    from hlm_ray.data import BlockSampler, mask_tokens, prepare_corpus
    corpus = prepare_corpus(["corpus/en"], tok, seq_len=128, val_fraction=0.05,
                            eos_id=tok.eos_token_id)           # train (N, 128), val (M, 128)
    sampler = BlockSampler(len(corpus.train), global_batch=64, seed=0)
    for micro in sampler.shard(step, rank, world, micro_batch=16):
        input_ids_BL = corpus.train[micro]                     # (16, 128)
        inputs_BL, labels_BL = mask_tokens(input_ids_BL, mask_id=tok.mask_token_id,
                                           special_ids=tok.all_special_ids, vocab_size=len(tok))

Sources are local files/folders (.txt, .jsonl/.json, .parquet), paths inside the shared data
folder ("corpus/en"), or hub datasets ("name" or "name:config", split "train"). Text and JSON
files are read in plain Python; only .parquet files need pyarrow and only hub names need the
`datasets` package (both imported when such a source is read). Tokenized streams are cached under
``cache_dir("tokenized")``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from hlm_ray.errors import HLMError, one_line
from hlm_ray.paths import (
    DATA_ENV,
    HUB_FALLBACKS,
    HubDataset,
    cache_dir,
    data_dir,
    data_dir_said,
    has_shared,
    hub_specs,
    load_hub,
)
from hlm_ray.tokenizer import tokenizer_fingerprint

SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
TOKENIZE_BATCH = 256  # documents per encode_batch call (the tokenizer parallelises over them)

# ----------------------------------------------------------------------------- loading text


@dataclass(frozen=True)
class Texts:
    """One "text" column of non-empty documents, in source order (the part of a `datasets`
    `Dataset` this module uses: `len`, `ds["text"]`, `column_names`, `iter`)."""

    texts: list[str]
    column_names = ["text"]  # noqa: RUF012 - a class constant, as a Dataset's attribute

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, column: str) -> list[str]:
        if column != "text":
            raise KeyError(column)
        return self.texts

    def iter(self, batch_size: int) -> Iterator[dict[str, list[str]]]:
        for start in range(0, len(self.texts), batch_size):
            yield {"text": self.texts[start : start + batch_size]}


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise HLMError(
            f"{path} is not UTF-8 text ({not_utf8(path)}); convert it (e.g. `iconv -f latin1 "
            "-t utf-8`) or remove it from data.sources"
        ) from None


def _txt_rows(text: str, sample_by: str) -> list[str]:
    """A .txt file's rows as the `datasets` text builder cuts them (line breaks kept in a
    document, dropped in a line, a paragraph ends at a blank line)."""
    if sample_by == "document":
        return [text]
    if sample_by == "line":
        return text.splitlines()
    if sample_by == "paragraph":
        return re.split(r"\n\s*\n", text)
    raise HLMError(f"sample_by={sample_by!r}: use document, paragraph or line")


def _json_rows(path: Path, field: str) -> list:
    """A .json file (one array of rows, or JSON lines) or a .jsonl file: each row's `field`."""
    text = _read_utf8(path)
    rows = None
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError:
            rows = None  # JSON lines in a .json file
        if isinstance(rows, dict):
            rows = [rows]
    if rows is None:
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):  # the file's line number
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise HLMError(f"{path}: line {number} is not JSON ({err.msg})") from None
    if any(not isinstance(r, dict) or field not in r for r in rows):
        raise HLMError(f"{path} has rows without a {field!r} column; set text_field")
    return [r[field] for r in rows]


def _parquet_rows(path: Path, field: str) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise HLMError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    table = pq.read_table(path)
    if field not in table.column_names:
        raise HLMError(
            f"{path} has no {field!r} column (columns: {table.column_names}); set text_field"
        )
    return table.column(field).to_pylist()


def _non_empty(values: list) -> list[str]:
    return [v for v in values if isinstance(v, str) and v]


def _load_local(path: Path, text_field: str, sample_by: str) -> list[str]:
    """A file, or every supported file of a folder in sorted order."""
    files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES) if path.is_dir() else [path]
    if not files:
        raise HLMError(
            f"{path} holds no {'/'.join(SUFFIXES)} files; pass a file or a folder with text files"
        )
    texts: list[str] = []
    for p in files:
        if p.suffix == ".txt":  # .txt rows are always "text"; text_field names a column
            texts += _txt_rows(_read_utf8(p), sample_by)
        elif p.suffix in (".jsonl", ".json"):
            texts += _json_rows(p, text_field)
        elif p.suffix == ".parquet":
            texts += _parquet_rows(p, text_field)
        else:
            raise HLMError(f"cannot read {p}: use a .txt, .jsonl, .json or .parquet file")
    return _non_empty(texts)


def not_utf8(path: Path, chunk: int = 1 << 20) -> str | None:
    """Why `path` is not UTF-8 text (a NUL byte, an invalid sequence at some offset), or None."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            nul = block.find(b"\0")
            if nul >= 0:
                return f"a NUL byte at offset {offset + nul}: binary data"
            try:
                decoder.decode(block)
            except UnicodeDecodeError as err:
                return f"byte 0x{block[err.start]:02x} at offset {offset + err.start} is not UTF-8"
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return "it ends inside a UTF-8 sequence"
    return None


def _load_hub(hub: HubDataset) -> list[str]:
    ds = load_hub(hub.name, hub.name, hub.config, hub.split)
    if hub.text_field not in ds.column_names:
        raise HLMError(
            f"{hub.name} has no {hub.text_field!r} column (columns: {ds.column_names}); "
            "set text_field"
        )
    return _non_empty(ds[hub.text_field])


def _looks_like_path(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~")) or Path(source).suffix in SUFFIXES


def _load_source(source: str, text_field: str, sample_by: str) -> list[str]:
    path = Path(source).expanduser()
    if path.exists():
        return _load_local(path, text_field, sample_by)
    if has_shared(source):
        return _load_local(data_dir() / source, text_field, sample_by)
    local = f"{source} (nor {data_dir() / source})"
    if _looks_like_path(source) and source not in HUB_FALLBACKS:
        raise HLMError(f"no file or folder {local}; pass an existing path or a hub dataset name")
    specs = hub_specs(source, text_field)
    names = ", ".join(f"{h.name}:{h.config}" if h.config else h.name for h in specs)
    try:
        return [text for hub in specs for text in _load_hub(hub)]
    except HLMError:
        raise
    except Exception as err:
        raise HLMError(
            f"no file or folder {source} here or in the data folder {data_dir_said()}, and the "
            f"hub dataset {names} could not be loaded ({one_line(err)}); point {DATA_ENV} at "
            f"the folder that holds {source}, or pass a local path"
        ) from err


def load_texts(
    sources: Sequence[str], *, text_field: str = "text", sample_by: str = "document"
) -> Texts:
    """All `sources` concatenated in order as one "text" column (`Texts`), empty rows dropped.

    `sample_by` applies to .txt files: "document" (a file is one row), "paragraph" or "line".
    """
    if isinstance(sources, str | Path):
        sources = [str(sources)]
    texts = [t for source in sources for t in _load_source(str(source), text_field, sample_by)]
    if not texts:
        raise HLMError(f"no text found in {list(sources)}; pass files or folders with text")
    return Texts(texts)


def corpus_fingerprint(dataset: Texts) -> str:
    """sha256 over the length-prefixed UTF-8 texts (content, not file names or dates)."""
    digest = hashlib.sha256()
    for batch in dataset.iter(batch_size=1024):
        for text in batch["text"]:
            raw = text.encode("utf-8")
            digest.update(len(raw).to_bytes(8, "little"))
            digest.update(raw)
    return digest.hexdigest()


# ----------------------------------------------------------------------------- tokenizing


def _tokenize(dataset: Texts, tokenizer: PreTrainedTokenizerFast, eos_id: int):
    """Flat int32 stream: doc0 tokens, eos, doc1 tokens, eos, ..."""
    # The backend tokenizer adds no special tokens here and never warns about model_max_length
    # (a corpus document is far longer than any model context; packing cuts it later).
    backend = tokenizer.backend_tokenizer
    eos = np.array([eos_id], dtype=np.int32)
    pieces: list[np.ndarray] = []
    for batch in dataset.iter(batch_size=TOKENIZE_BATCH):
        for enc in backend.encode_batch_fast(batch["text"], add_special_tokens=False):
            pieces.append(np.asarray(enc.ids, dtype=np.int32))
            pieces.append(eos)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def tokenize_corpus(
    dataset: Texts, tokenizer: PreTrainedTokenizerFast, *, eos_id: int
) -> np.ndarray:
    """One int32 token stream with `eos_id` after every document, cached on disk."""
    if not 0 <= eos_id < len(tokenizer):
        raise HLMError(
            f"eos_id={eos_id} is not a token id of this {len(tokenizer)}-token "
            "tokenizer; pass tokenizer.eos_token_id"
        )
    key = hashlib.sha256(
        f"{corpus_fingerprint(dataset)}|{tokenizer_fingerprint(tokenizer)}|{eos_id}".encode()
    ).hexdigest()
    path = cache_dir("tokenized") / f"{key[:32]}.npy"
    if path.exists():
        return np.load(path)
    stream = _tokenize(dataset, tokenizer, eos_id)
    # Write then rename: a concurrent reader never sees a half-written file.
    tmp = path.with_name(f".{path.stem}.{os.getpid()}-{uuid.uuid4().hex[:8]}.npy")
    np.save(tmp, stream)
    os.replace(tmp, path)
    return stream


def pack_blocks(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """(N, seq_len) consecutive blocks of `stream`; the incomplete tail is dropped."""
    if seq_len <= 0:
        raise HLMError(f"seq_len={seq_len} must be positive")
    num_blocks = len(stream) // seq_len
    if num_blocks == 0:
        raise HLMError(
            f"the corpus has {len(stream)} tokens but one block of seq_len={seq_len} "
            f"needs {seq_len}; add text or lower seq_len"
        )
    return stream[: num_blocks * seq_len].reshape(num_blocks, seq_len)


def split_blocks(blocks: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): every k-th block (k = round(1 / val_fraction)) is held out for validation.

    Spreading validation over the corpus keeps it representative of every document.
    """
    if not 0 < val_fraction < 1:
        raise HLMError(f"val_fraction={val_fraction} must be between 0 and 1 (e.g. 0.05)")
    k = max(1, round(1 / val_fraction))
    is_val = np.zeros(len(blocks), dtype=bool)
    is_val[k - 1 :: k] = True
    if not is_val.any():
        is_val[-1] = True  # fewer than k blocks: still hold one out
    if is_val.all():
        raise HLMError(
            f"{len(blocks)} blocks leave no training data with val_fraction="
            f"{val_fraction}; add text, lower seq_len or val_fraction"
        )
    return blocks[~is_val], blocks[is_val]


@dataclass(frozen=True)
class PackedCorpus:
    """Token blocks ready for training: `train` (N, L) and `val` (M, L), int64."""

    train: torch.Tensor
    val: torch.Tensor
    num_tokens: int  # tokens in the stream that was packed (after max_tokens)


def prepare_corpus(
    sources: Sequence[str],
    tokenizer: PreTrainedTokenizerFast,
    *,
    seq_len: int,
    val_fraction: float,
    eos_id: int,
    max_tokens: int | None = None,
    text_field: str = "text",
) -> PackedCorpus:
    """Load, tokenize (cached), truncate to `max_tokens`, pack and split `sources`."""
    stream = tokenize_corpus(load_texts(sources, text_field=text_field), tokenizer, eos_id=eos_id)
    if max_tokens is not None:
        stream = stream[:max_tokens]
    train, val = split_blocks(pack_blocks(stream, seq_len), val_fraction)
    return PackedCorpus(train=_as_long(train), val=_as_long(val), num_tokens=len(stream))


def _as_long(blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.int64))


# ----------------------------------------------------------------------------- batch order


class BlockSampler:
    """Which blocks each step trains on: a pure function of (seed, step).

    The order is the endless concatenation of per-epoch permutations, so resuming at step s
    needs only s; any world size that divides the global batch sees the same global batches.
    """

    def __init__(self, num_blocks: int, global_batch: int, seed: int):
        if num_blocks <= 0 or global_batch <= 0:
            raise HLMError(
                f"BlockSampler needs blocks and a batch, got num_blocks={num_blocks}, "
                f"global_batch={global_batch}"
            )
        self.num_blocks = num_blocks
        self.global_batch = global_batch
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 4:  # a step spans few epochs; keep memory bounded
                self._perms.clear()
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.num_blocks, generator=gen)
        return self._perms[epoch]

    def indices(self, step: int) -> torch.Tensor:
        """(global_batch,) block ids at positions [step*G, (step+1)*G) of the endless order."""
        start, stop = step * self.global_batch, (step + 1) * self.global_batch
        parts, pos = [], start
        while pos < stop:
            epoch, offset = divmod(pos, self.num_blocks)
            take = min(self.num_blocks - offset, stop - pos)
            parts.append(self._permutation(epoch)[offset : offset + take])
            pos += take
        return torch.cat(parts)

    def shard(self, step: int, rank: int, world: int, micro_batch: int) -> list[torch.Tensor]:
        """This worker's contiguous slice of `indices(step)` (the `rank`-th of `world` equal
        slices), as micro-batches of `micro_batch` rows. Contiguous slices make W workers see
        exactly the micro-batches one process sees with W accumulation steps, so runs compare
        across world sizes (the CWT negatives are the micro-batch's own rows)."""
        return list(self.indices(step).view(world, -1)[rank].split(micro_batch))

    def epoch(self, step: int) -> float:
        """Passes over the training blocks completed before `step`."""
        return step * self.global_batch / self.num_blocks


# ----------------------------------------------------------------------------- masking


def mask_tokens(
    input_ids_BL: torch.Tensor,
    *,
    mask_id: int,
    special_ids: Sequence[int],
    vocab_size: int,
    probability: float = 0.15,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: returns (inputs_BL, labels_BL); `input_ids_BL` is left unchanged.

    Each non-special position is selected with `probability`; selected ones become `mask_id`
    (80%), a random non-special token (10%) or stay (10%). Labels are the ORIGINAL tokens at
    selected positions and -100 elsewhere; at least one position per batch is selected.
    """
    device = input_ids_BL.device
    rand_device = generator.device if generator is not None else device
    # Draws happen on the generator's device, then move: a CPU generator works for GPU inputs.

    def rand() -> torch.Tensor:
        return torch.rand(input_ids_BL.shape, generator=generator, device=rand_device).to(device)

    excluded = torch.tensor(sorted({*special_ids, mask_id}), dtype=input_ids_BL.dtype)
    maskable_BL = ~torch.isin(input_ids_BL, excluded.to(device))
    if not maskable_BL.any():
        raise HLMError("a batch holds only special tokens; nothing can be masked")
    selected_BL = (rand() < probability) & maskable_BL
    if not selected_BL.any():  # never return an empty loss
        candidates = maskable_BL.flatten().nonzero().squeeze(1)
        pick = torch.randint(len(candidates), (1,), generator=generator, device=rand_device)
        selected_BL.view(-1)[candidates[pick.to(device)]] = True
    action_BL = rand()
    to_mask_BL = selected_BL & (action_BL < 0.8)
    to_random_BL = selected_BL & (action_BL >= 0.8) & (action_BL < 0.9)
    inputs_BL = input_ids_BL.clone()
    inputs_BL[to_mask_BL] = mask_id
    allowed = _non_special_ids(vocab_size, excluded)
    draw = torch.randint(len(allowed), input_ids_BL.shape, generator=generator, device=rand_device)
    inputs_BL[to_random_BL] = allowed.to(device)[draw.to(device)][to_random_BL]
    labels_BL = torch.where(selected_BL, input_ids_BL, torch.full_like(input_ids_BL, -100))
    return inputs_BL, labels_BL


def _non_special_ids(vocab_size: int, excluded: torch.Tensor) -> torch.Tensor:
    ids = torch.arange(vocab_size, dtype=excluded.dtype)
    allowed = ids[~torch.isin(ids, excluded)]
    if len(allowed) == 0:
        raise HLMError(f"vocab_size={vocab_size} has no non-special token to sample")
    return allowed
