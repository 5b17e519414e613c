"""A prepared folder in an object store, read through a copy on this node's disk.

    folder = local_copy("s3://hlm-runs/runs/_prepared/bpe1024-0123abcd")   # a local Path

Training reads token shards by memory map, which needs a file on a local (or mounted) disk. A
folder given by URI (`data.prepared=s3://...`, or the copy a driver published in the run
storage for a cluster's workers: `hlm_ray.cluster`) is copied once per node into the cache
(`fetched/` beside the prepared folders), its manifest last, and copied again only when the
remote manifest changes. Workers of one node wait for each other's copy (a file lock).
"""

from __future__ import annotations

import fcntl
import hashlib
from pathlib import Path

from hlm_ray.errors import HLMError
from hlm_ray.prepare.store import MANIFEST, Store


def local_copy(uri: str) -> Path:
    from hlm_ray.paths import cache_dir

    store = Store.open(uri)
    manifest = store.read_json(MANIFEST)
    if manifest is None:
        raise HLMError(
            f"{uri} is not a prepared corpus: no {MANIFEST}; run `hlm data prepare --output "
            f"{uri}` first"
        )
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    digest = hashlib.sha256(uri.encode()).hexdigest()[:12]
    target = cache_dir("prepared", "fetched") / f"{name}-{digest}"
    local = Store.open(target)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if local.read_json(MANIFEST) == manifest:
            return target
        local.delete(MANIFEST)  # incomplete until the manifest is back
        for entry in store.names():
            if entry != MANIFEST and not entry.startswith("."):
                store.download(entry, target / entry)
        local.write_json(MANIFEST, manifest)
    return target
