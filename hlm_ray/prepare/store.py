"""A prepared folder (local, or on any pyarrow filesystem): atomic files, shard writers, the
manifest.

    store = Store.open("/data/prepared/x")          # or "s3://bucket/x", "file:///..." (pyarrow)
    writer = ShardWriter(store, "train", np.uint16, shard_tokens=1 << 24, eos_id=0)
    writer.add(tokens, piece=3)                      # whole shards are written as they fill
    store.write_json("manifest.json", {...})         # temp name, then rename

Layout:  manifest.json   tokenizer/   train-00000.bin ...   val-00000.bin ...
         state.json (only while a preparation is unfinished: what is committed, for resume)
Shards are raw little-endian token ids (the manifest's dtype), one EOS after each document.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hlm_ray.errors import HLMError

MANIFEST = "manifest.json"
STATE = "state.json"
TOKENIZER_DIR = "tokenizer"


class Store:
    """A local (or mounted) folder, in plain Python; `Store.open` of a URI gives the pyarrow
    filesystem version (`RemoteStore`), so pyarrow is needed only for remote folders."""

    def __init__(self, root: str, uri: str):
        self.root, self.uri = root.rstrip("/"), uri

    @classmethod
    def open(cls, uri: str | Path) -> Store:
        uri = str(uri)
        if "://" in uri:
            return RemoteStore.open_uri(uri)
        root = str(Path(uri).expanduser().resolve())
        Path(root).mkdir(parents=True, exist_ok=True)
        return cls(root, root)

    @property
    def local_path(self) -> Path | None:
        return Path(self.root)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def exists(self, name: str) -> bool:
        return os.path.lexists(self.path(name))

    def names(self) -> list[str]:
        return sorted(os.listdir(self.root)) if os.path.isdir(self.root) else []

    def read_json(self, name: str) -> dict | None:
        if not self.exists(name):
            return None
        return json.loads(Path(self.path(name)).read_bytes().decode())

    def write_bytes(self, name: str, data: bytes | memoryview) -> None:
        """Write under a temporary name, then rename: a reader never sees half a file."""
        tmp = self.path(f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.path(name))

    def write_json(self, name: str, data: dict) -> None:
        self.write_bytes(name, (json.dumps(data, indent=1) + "\n").encode())

    def delete(self, name: str) -> None:
        path = self.path(name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)

    def clean_temporaries(self) -> None:
        for name in self.names():
            if name.startswith(".") and ".tmp-" in name:
                self.delete(name)

    def upload_dir(self, local: Path, name: str) -> None:
        """Copy a local folder in under `name` (via a temporary name, then renamed)."""
        tmp = f".{name}.tmp-{uuid.uuid4().hex[:8]}"
        shutil.copytree(local, self.path(tmp))
        self.delete(name)
        os.replace(self.path(tmp), self.path(name))

    def upload(self, local: Path, name: str) -> None:
        """A local file or folder copied in under `name`, replacing what was there."""
        if Path(local).is_dir():
            self.upload_dir(Path(local), name)
        else:
            self.write_bytes(name, Path(local).read_bytes())

    def download(self, name: str, local: Path) -> bool:
        """File or folder `name` copied to `local` (replacing it, never leaving half a copy
        there); False when there is no `name`."""
        if not self.exists(name):
            return False
        local = Path(local)
        tmp = local.with_name(f".{local.name}.tmp-{uuid.uuid4().hex[:8]}")
        local.parent.mkdir(parents=True, exist_ok=True)
        self._copy_out(name, tmp)
        if local.is_dir() and not local.is_symlink():
            shutil.rmtree(local)
        os.replace(tmp, local)
        return True

    def _copy_out(self, name: str, local: Path) -> None:
        if os.path.isdir(self.path(name)):
            shutil.copytree(self.path(name), local)
        else:
            shutil.copyfile(self.path(name), local)


class RemoteStore(Store):
    """A folder on a pyarrow filesystem ("s3://bucket/x", "file:///..."): pyarrow is imported
    here, when such a URI is opened."""

    def __init__(self, fs, root: str, uri: str):
        super().__init__(root, uri)
        self.fs = fs

    @classmethod
    def open_uri(cls, uri: str) -> RemoteStore:
        try:
            import pyarrow.fs as pafs
        except ImportError:
            raise HLMError(
                f"{uri} is a remote folder: it needs pyarrow (pip install pyarrow)"
            ) from None
        try:
            fs, root = pafs.FileSystem.from_uri(uri)
        except Exception as err:
            raise HLMError(f"cannot open {uri}: {err}".splitlines()[0]) from None
        fs.create_dir(root, recursive=True)
        return cls(fs, root, uri)

    @property
    def local_path(self) -> Path | None:
        import pyarrow.fs as pafs

        return Path(self.root) if isinstance(self.fs, pafs.LocalFileSystem) else None

    def exists(self, name: str) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self.path(name)).type != pafs.FileType.NotFound

    def names(self) -> list[str]:
        import pyarrow.fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        return sorted(Path(i.path).name for i in infos)

    def read_json(self, name: str) -> dict | None:
        if not self.exists(name):
            return None
        with self.fs.open_input_stream(self.path(name)) as f:
            return json.loads(f.read().decode())

    def write_bytes(self, name: str, data: bytes | memoryview) -> None:
        tmp = self.path(f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, self.path(name))

    def delete(self, name: str) -> None:
        import pyarrow.fs as pafs

        info = self.fs.get_file_info(self.path(name))
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self.path(name))
        elif info.type == pafs.FileType.File:
            self.fs.delete_file(self.path(name))

    def upload_dir(self, local: Path, name: str) -> None:
        """Copy a local folder in under `name`. An object store cannot rename a folder (S3 has
        no folders: pyarrow's move of one fails with NO_SUCH_KEY), so the files go straight to
        their place, each one whole (an object appears only when completely written); what
        marks the folder complete is a file written after it (a prepared folder's manifest, a
        checkpoint's own manifest)."""
        import pyarrow.fs as pafs

        self.delete(name)
        self.fs.create_dir(self.path(name), recursive=True)
        pafs.copy_files(str(local), self.path(name), pafs.LocalFileSystem(), self.fs)

    def _copy_out(self, name: str, local: Path) -> None:
        import pyarrow.fs as pafs

        if self.fs.get_file_info(self.path(name)).type == pafs.FileType.Directory:
            local.mkdir(parents=True)
        pafs.copy_files(self.path(name), str(local), self.fs, pafs.LocalFileSystem())


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


@dataclass
class ShardWriter:
    """Fixed-size shards of one split, written whole; the last one may be shorter.

    `cursor` = (piece, tokens of that piece's output already in committed shards): where a
    resumed run starts again."""

    store: Store
    split: str
    dtype: np.dtype
    shard_tokens: int
    eos_id: int
    shards: list[dict] = field(default_factory=list)
    cursor: tuple[int, int] = (0, 0)
    on_flush: object = None
    """Called after each shard is committed (the preparation saves its resume state)."""
    _parts: list[np.ndarray] = field(default_factory=list)
    _buffered: int = 0
    _piece: int = 0
    _piece_offset: int = 0

    def add(self, tokens: np.ndarray, piece: int, skip: int = 0) -> None:
        """Append a piece's tokens of this split (minus the first `skip`, already written)."""
        self._piece, self._piece_offset = piece, skip
        tokens = tokens[skip:]
        while len(tokens):
            take = min(self.shard_tokens - self._buffered, len(tokens))
            self._parts.append(tokens[:take])
            self._buffered += take
            self._piece_offset += take
            tokens = tokens[take:]
            if self._buffered == self.shard_tokens:
                self._flush()

    def _flush(self) -> None:
        data = np.concatenate(self._parts).astype(self.dtype, copy=False)
        raw = data.tobytes()
        name = shard_name(self.split, len(self.shards))
        self.store.write_bytes(name, raw)
        self.shards.append(
            {
                "name": name,
                "num_tokens": len(data),
                "num_documents": int(np.count_nonzero(data == self.eos_id)),
                "sha256": hashlib.sha256(raw).hexdigest(),
            }
        )
        self.cursor = (self._piece, self._piece_offset)
        self._parts, self._buffered = [], 0
        if self.on_flush is not None:
            self.on_flush()

    def finish(self) -> None:
        if self._buffered:
            self._flush()

    def state(self) -> dict:
        return {"shards": self.shards, "cursor": list(self.cursor)}

    def summary(self) -> dict:
        return {
            "num_tokens": sum(s["num_tokens"] for s in self.shards),
            "num_documents": sum(s["num_documents"] for s in self.shards),
            "shards": self.shards,
        }
