"""What a run needs from a Ray cluster of several nodes, checked or arranged by the driver before
any worker starts. On one machine every node shares the driver's disk, home folder and
loopback; on a cluster each node has its own, and shares only the run storage, the tracking
server and the Ray head.

    nodes = len(alive_nodes())                         # after `connect()`
    check_tracking(default_tracking_uri(), nodes)      # a server every node reaches, or one line
    where = prepared_location(prepared, storage, nodes)   # what a run's workers open
    cfg = pin_prepared(cfg, {request_key(cfg): where})    # a sweep trial: its corpus's copy

The prepared corpus (tokenizer and token shards) is made once, by the driver or a preparation
task, in that process's cache (`HLM_CACHE_DIR`, by default `~/.cache/hlm_ray` of its node). A
worker on another node would not find it there and would prepare it again in its own cache,
silently, at the cost of the whole preparation, from data it may not even see. So workers are
given the folder to open (`data.prepared`), and on a cluster of several nodes (or with run
storage in an object store) a folder from a private cache is first copied into the run storage,
which every node reaches by definition (`publish_prepared`). A cache the user named with
`HLM_CACHE_DIR` is taken to be shared, as deploy/kuberay's manifests mount it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hlm_ray.errors import HLMError
from hlm_ray.paths import CACHE_ENV

PREPARED_DIR = "_prepared"
"""The run storage's folder of published prepared corpora, beside the runs."""


def alive_nodes() -> list[dict]:
    """The cluster's alive nodes (`ray.nodes()` entries); Ray must be connected."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def machines(nodes: list[dict]) -> int:
    """How many machines `nodes` (`alive_nodes()` entries) run on: nodes of one address share
    its disk, home folder and loopback (several raylets on one host, as tests/test_multinode.py
    starts them), nodes of different addresses share nothing but what is served or mounted."""
    return len({n.get("NodeManagerAddress") for n in nodes}) or 1


def check_tracking(uri: str, num_machines: int) -> None:
    """On several machines, MLflow must be a server they all reach: a sqlite file (the embedded
    store, or the sweep's own server over it on loopback) exists on one machine only, and the
    runs of workers elsewhere would be written to files of their own nodes, never seen again."""
    if num_machines > 1 and not uri.startswith(("http://", "https://", "databricks")):
        raise HLMError(
            f"this Ray cluster has nodes on {num_machines} machines but MLflow's store is {uri}, "
            "which only this machine sees; set MLFLOW_TRACKING_URI to a tracking server every "
            "node reaches (http://HOST:5000; deploy/README.md shows one on PostgreSQL)"
        )


def publish_root(storage: str, num_machines: int) -> str | None:
    """Where prepared folders are published for the workers (`storage`: the run storage, a path
    or URI), or None when the workers open the driver's own: on one machine with local storage,
    or when the user named a shared cache (`HLM_CACHE_DIR`)."""
    if (num_machines <= 1 and "://" not in storage) or os.environ.get(CACHE_ENV):
        return None
    return f"{storage.rstrip('/')}/{PREPARED_DIR}"


def prepared_location(prepared, storage: str, num_machines: int) -> str:
    """The prepared folder the workers open (`prepared`: the driver's, in its cache): that one
    (`publish_root` None), else its copy in the run storage (the storage path, or the run
    folder's parent)."""
    root = publish_root(storage, num_machines)
    if root is None or "://" in prepared.uri:
        return prepared.uri
    return publish_prepared(prepared, root)


def request_key(cfg) -> str:
    """What identifies a config's prepared corpus without reading its sources (a trial on a
    node may not see them): its `PrepareRequest`, as JSON."""
    import json
    from dataclasses import asdict

    from hlm_ray.prepare import PrepareRequest

    return json.dumps(asdict(PrepareRequest.from_config(cfg)), sort_keys=True)


def pin_prepared(cfg, located: dict[str, str]):
    """`cfg` reading the published folder of its corpus (`located`: {`request_key`: folder}),
    when there is one and the config names none itself."""
    from hlm_ray.config import apply_overrides

    where = located.get(request_key(cfg))
    if where is None or cfg.data.prepared:
        return cfg
    return apply_overrides(cfg, {"data.prepared": where})


def publish_prepared(prepared, root: str) -> str:
    """A copy of the finished prepared folder `prepared` under `root` (a path or URI), its
    manifest written last (a reader takes the folder as complete only with it); kept as it is
    when the copy there has the same manifest. Returns the copy's location."""
    from hlm_ray.prepare.store import MANIFEST, Store

    target = f"{root.rstrip('/')}/{Path(prepared.uri).name}"
    store = Store.open(target)
    manifest = json.loads(json.dumps(prepared.manifest))  # as read back (lists, not tuples)
    if store.read_json(MANIFEST) == manifest:
        return target
    store.delete(MANIFEST)
    for path in sorted(Path(prepared.uri).iterdir()):
        if path.name != MANIFEST and not path.name.startswith("."):
            store.upload(path, path.name)
    store.write_json(MANIFEST, prepared.manifest)
    return target
