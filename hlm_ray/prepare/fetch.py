"""A folder in an object store, read through a copy on this node's disk.

    folder = local_copy("s3://hlm-runs/runs/_prepared/bpe1024-0123abcd")   # a local Path
    model = local_copy("s3://hlm-runs/runs/_inputs/tiny-model-0123abcd", marker=PUBLISHED,
                       what="published model folder")

Training reads token shards by memory map, which needs a file on a local (or mounted) disk. A
folder given by URI (`data.prepared=s3://...`, the copy a driver published in the run storage
for a cluster's workers, or a fine-tune's source model published there: `hlm_ray.cluster`) is
copied once per node into the cache (`fetched/`), its marker file (a prepared folder's manifest,
a published folder's `PUBLISHED`) last, and copied again only when the remote marker changes.
Workers of one node wait for each other's copy (a file lock).
"""

from __future__ import annotations

import fcntl
import hashlib
from pathlib import Path

from hlm_ray.errors import HLMError
from hlm_ray.prepare.store import MANIFEST, Store

PUBLISHED = "hlm-published.json"
"""The marker of a folder `cluster.publish_folder` copied into the run storage: its file list,
written after the files (the folder is complete only with it)."""


def local_copy(uri: str, *, marker: str = MANIFEST, what: str = "prepared corpus") -> Path:
    """This node's copy of the folder at `uri`, complete when `marker` (written last there) is."""
    from hlm_ray.paths import cache_dir

    store = Store.open(uri)
    stamp = store.read_json(marker)
    if stamp is None:
        hint = f"run `hlm data prepare --output {uri}` first" if marker == MANIFEST else (
            "it was never completely published; run the command again"
        )  # fmt: skip
        raise HLMError(f"{uri} is not a {what}: no {marker}; {hint}")
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    digest = hashlib.sha256(uri.encode()).hexdigest()[:12]
    kind = "prepared" if marker == MANIFEST else "inputs"
    target = cache_dir(kind, "fetched") / f"{name}-{digest}"
    local = Store.open(target)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if local.read_json(marker) == stamp:
            return target
        local.delete(marker)  # incomplete until the marker is back
        for entry in store.names():
            if entry != marker and not entry.startswith("."):
                store.download(entry, target / entry)
        local.write_json(marker, stamp)
    return target
