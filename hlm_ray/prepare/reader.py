"""Training reads a prepared folder by memory map: blocks of seq_len tokens, as int64 rows.

    from hlm_ray.prepare import open_prepared
    prepared = open_prepared("/data/owt2")              # checks the manifest and the shards
    train = TokenBlocks.open(prepared, "train", seq_len=128, max_tokens=None)
    rows_BL = train[torch.tensor([5, 1, 9])]             # (3, 128) int64, copied from the map

A split's stream is its shards end to end; block i is tokens [i*L, (i+1)*L) of it (the tail that
fills no block is dropped): the same blocks `pack_blocks` cuts from the stream in memory. Only
the rows a batch asks for are read; nothing holds a copy of the corpus.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hlm_ray.errors import HLMError
from hlm_ray.prepare.request import FORMAT_VERSION, Prepared
from hlm_ray.prepare.store import MANIFEST


def open_prepared(folder: str | Path) -> Prepared:
    """A finished prepared folder (local, on a shared filesystem, or a URI such as s3://...,
    read through a copy on this node: `fetch.local_copy`), checked."""
    if "://" in str(folder):
        from hlm_ray.prepare.fetch import local_copy

        folder = local_copy(str(folder))
    folder = Path(str(folder)).expanduser()
    path = folder / MANIFEST
    if not folder.exists():
        import socket

        raise HLMError(
            f"prepared folder {folder} does not exist on this node ({socket.gethostname()}): on "
            "a cluster it must be on storage every node mounts (set HLM_CACHE_DIR to a shared "
            "folder, or give a shared or s3:// --storage-path)"
        )
    if not path.is_file():
        hint = (
            " (an unfinished preparation: run `hlm data prepare` again to finish it)"
            if (folder / "state.json").exists()
            else ""
        )
        raise HLMError(
            f"{folder} is not a prepared corpus: no {MANIFEST}{hint}; "
            "run `hlm data prepare --output` first"
        )
    import json

    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise HLMError(
            f"{folder} has format version {manifest.get('format_version')}; this "
            f"hlm_ray reads version {FORMAT_VERSION}: prepare it again"
        )
    from hlm_ray.prepare.verify import check_shards

    check_shards(folder, manifest)  # sizes always, contents once per file and machine
    return Prepared(str(folder.resolve()), manifest)


@dataclass
class TokenBlocks:
    """(N, seq_len) blocks of one split, read on demand from memory-mapped shards."""

    maps: list[np.memmap]
    starts: np.ndarray  # (S + 1,) first token of each shard in the split's stream
    seq_len: int
    num_blocks: int

    @classmethod
    def open(
        cls, prepared: Prepared, split: str, *, seq_len: int, max_tokens: int | None = None
    ) -> TokenBlocks:
        info = prepared.manifest["splits"][split]
        dtype = np.dtype(prepared.manifest["dtype"])
        maps = [
            np.memmap(prepared.path / s["name"], dtype=dtype, mode="r", shape=(s["num_tokens"],))
            for s in info["shards"]
        ]
        starts = np.concatenate([[0], np.cumsum([len(m) for m in maps])]).astype(np.int64)
        total = int(starts[-1]) if max_tokens is None else min(int(starts[-1]), max_tokens)
        if total < seq_len:
            raise HLMError(
                f"the {split} split of {prepared.path} has {total} tokens but one block of "
                f"data.seq_len={seq_len} needs {seq_len}; add text or lower seq_len"
                + (" or raise data.val_fraction" if split == "val" else "")
            )
        return cls(maps, starts, seq_len, total // seq_len)

    def __len__(self) -> int:
        return self.num_blocks

    def row(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"block {i} of {self.num_blocks}")
        start, stop = i * self.seq_len, (i + 1) * self.seq_len
        s = int(np.searchsorted(self.starts, start, side="right")) - 1
        lo = start - self.starts[s]
        if stop <= self.starts[s + 1]:  # the common case: the block lies in one shard
            return self.maps[s][lo : lo + self.seq_len]
        parts, pos = [], start
        while pos < stop:
            s = int(np.searchsorted(self.starts, pos, side="right")) - 1
            take = min(stop, int(self.starts[s + 1])) - pos
            parts.append(self.maps[s][pos - self.starts[s] : pos - self.starts[s] + take])
            pos += take
        return np.concatenate(parts)

    def __getitem__(self, idx) -> torch.Tensor:
        """Rows `idx` (a tensor, list or slice of block ids) as an int64 (B, seq_len) tensor."""
        if isinstance(idx, slice):
            idx = range(*idx.indices(self.num_blocks))
        elif isinstance(idx, int):
            return torch.from_numpy(self.row(idx).astype(np.int64))
        ids = idx.tolist() if hasattr(idx, "tolist") else list(idx)
        out = np.empty((len(ids), self.seq_len), dtype=np.int64)
        for j, i in enumerate(ids):
            out[j] = self.row(int(i))
        return torch.from_numpy(out)

    def read_all(self) -> np.ndarray:
        """Every token of the split (tests and small tools only: this copies the split)."""
        return np.concatenate([np.asarray(m) for m in self.maps]) if self.maps else np.zeros(0)
