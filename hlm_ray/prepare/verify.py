"""A prepared folder's shards checked against its manifest before anything trains on them.

    problem = shard_problem(folder, manifest)   # "train-00000.bin has 100 bytes, ..." or None
    check_shards(folder, manifest)              # HLMError naming the shard and what to do

The manifest holds each shard's token count and sha256 (`store.ShardWriter`). A shard changed
after it was prepared (a bad copy, a disk error, a tool writing into it) was trained on without
a word, and the run was tagged with the clean data's fingerprint; one cut short was an mmap
error, one with ids past the vocabulary a 70-line `IndexError`.

What it costs: the sizes are checked on every open (a `stat` per shard). The contents are read
once per file and machine: one pass computes the sha256 and the largest token id, and the
verdict is kept in the cache (`cache_dir("prepared", "checked")`, one small file per shard),
keyed by the file's path, size, inode and modification and change times; any write to the file
changes them, so the next open reads it again. A change that keeps all of them (the disk
flipping bits under an unchanged inode) is not seen after the first check.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from hlm_ray.errors import HLMError

CHUNK = 16 << 20  # bytes read at a time: one hash update and one max over them
_seen: dict[tuple, dict] = {}  # this process's verdicts, by file identity


def check_shards(folder: str | Path, manifest: dict) -> None:
    """Raise `HLMError` when a shard of the prepared `folder` does not match `manifest`."""
    problem = shard_problem(folder, manifest)
    if problem is not None:
        raise HLMError(
            f"prepared shard {Path(folder) / problem}; prepare the folder again: "
            f"`hlm data prepare --output {folder}` with the preset and --set it was made with "
            "remakes a folder whose shards do not match its manifest"
        )


def shard_problem(folder: str | Path, manifest: dict) -> str | None:
    """What is wrong with the first shard that does not match the manifest ("<name> <what>"),
    or None when every shard has its size, checksum and token ids in the vocabulary."""
    folder = Path(folder)
    dtype = np.dtype(manifest["dtype"])
    vocab = int(manifest["tokenizer"]["vocab_size"])
    shards = [s for split in manifest["splits"].values() for s in split["shards"]]
    for shard in shards:  # sizes first: a stat each, and a truncated file fails fast
        path = folder / shard["name"]
        if path.is_dir():
            return f"{shard['name']} is a folder, not a shard file"
        if not path.is_file():
            return f"{shard['name']} is missing"
        size, want = path.stat().st_size, shard["num_tokens"] * dtype.itemsize
        if size != want:
            how = "cut short" if size < want else "longer: written to or replaced since"
            return (
                f"{shard['name']} has {size:,} bytes, the manifest says {want:,} "
                f"({shard['num_tokens']:,} tokens of {dtype.name}): {how}"
            )
        if not shard.get("sha256"):  # its content could change unseen under the fingerprint
            return (
                f"{shard['name']}: the manifest records no sha256 for it, so its content "
                "cannot be checked (an edited manifest)"
            )
    for shard in shards:
        seen = _read_once(folder / shard["name"], dtype)
        wrong = []
        if shard["sha256"] != seen["sha256"]:
            wrong.append("its content does not match the manifest's sha256 (changed after it "
                         "was prepared)")  # fmt: skip
        if seen["max_id"] >= vocab:
            wrong.append(f"it holds token id {seen['max_id']}, outside the vocabulary of {vocab}")
        if wrong:
            return f"{shard['name']}: " + "; ".join(wrong)
    return None


def _identity(path: Path) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def _read_once(path: Path, dtype: np.dtype) -> dict:
    """{"sha256", "max_id"} of a shard: this process's or the cache's verdict for the file as
    it is now, else read (under a lock, so that the workers of one node read it once)."""
    key = _identity(path)
    if key in _seen:
        return _seen[key]
    from hlm_ray.paths import cache_dir

    record = cache_dir("prepared", "checked") / hashlib.sha256(key[0].encode()).hexdigest()[:24]
    with open(f"{record}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            cached = json.loads(Path(f"{record}.json").read_text())
        except (OSError, ValueError):
            cached = {}
        if cached.get("identity") != list(key):
            cached = {"identity": list(key), **_scan(path, dtype)}
            tmp = Path(f"{record}.json.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(cached))
            os.replace(tmp, f"{record}.json")
    _seen[key] = {"sha256": cached["sha256"], "max_id": cached["max_id"]}
    return _seen[key]


def _scan(path: Path, dtype: np.dtype) -> dict:
    """One read of the file: its sha256 and its largest token id."""
    digest, top = hashlib.sha256(), -1
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            usable = len(chunk) - len(chunk) % dtype.itemsize  # CHUNK is a multiple: all of it
            if usable:
                top = max(top, int(np.frombuffer(chunk[:usable], dtype=dtype).max()))
    return {"sha256": digest.hexdigest(), "max_id": top}
