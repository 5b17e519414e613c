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

A fine-tune's source model (`init.model_dir`) is a folder on the driver's disk too: a run folder
of its node, or a registry model downloaded into its cache. On several machines it is copied into
the run storage as well (`model_location`), unless it already lies there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hlm_ray.errors import HLMError
from hlm_ray.paths import CACHE_ENV

PREPARED_DIR = "_prepared"
"""The run storage's folder of published prepared corpora, beside the runs."""
INPUTS_DIR = "_inputs"
"""The run storage's folder of published input folders (a fine-tune's source model)."""


STARTUP_TIMEOUT = "timed out during startup"
"""What Ray 2.60 says (a bare `Exception`) when its raylet has not registered within 30 s."""


def startup_timeout_message() -> str:
    """Ray's start-up timeout, which only a busy machine causes, in one line: the load, and
    that the same command loses nothing (a run or sweep continues where it stopped)."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"the local Ray cluster did not start: Ray's processes did not register within its 30 s "
        f'("The current node timed out during startup"), twice; the machine is busy (load '
        f"average {load} on {os.cpu_count()} CPUs); nothing was lost: run the same command again "
        "when it is quieter (a run or a sweep continues where it stopped)"
    )


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


def absolute(path_or_uri: str) -> str:
    """A local path made absolute (workers run in other folders); a URI as it is."""
    return path_or_uri if "://" in path_or_uri else str(Path(path_or_uri).resolve())


def worker_paths(cfg, storage: str, num_machines: int, *, prepared) -> dict:
    """The config's inputs as workers elsewhere (another folder, another node) must be given
    them, as overrides: the data sources made absolute, the prepared corpus (`prepared()`: the
    driver's, made when the config names none) and a fine-tune's source model where every
    worker reaches them."""
    sources = [str(Path(s).resolve()) if Path(s).exists() else s for s in cfg.data.sources]
    return {
        "data.sources": sources,
        "data.prepared": absolute(cfg.data.prepared)
        if cfg.data.prepared
        else prepared_location(prepared(), storage, num_machines),
        "init.model_dir": cfg.init.model_dir
        and model_location(cfg.init.model_dir, storage, num_machines),
    }


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
    from hlm_ray.prepare.store import MANIFEST

    target = f"{root.rstrip('/')}/{Path(prepared.uri).name}"
    manifest = json.loads(json.dumps(prepared.manifest))  # as read back (lists, not tuples)
    return _publish(Path(prepared.uri), target, MANIFEST, manifest)


def _publish(folder: Path, target: str, marker: str, stamp: dict) -> str:
    """`folder`'s files (not its hidden ones) copied to `target`, then `stamp` as the file
    `marker`, which says the copy is complete; nothing copied when the marker there is
    `stamp` already. Returns `target`."""
    from hlm_ray.prepare.store import Store

    store = Store.open(target)
    if store.read_json(marker) == stamp:
        return target
    store.delete(marker)
    for path in sorted(folder.iterdir()):
        if path.name != marker and not path.name.startswith("."):
            store.upload(path, path.name)
    store.write_json(marker, stamp)
    return target


def model_location(folder: str, storage: str, num_machines: int) -> str:
    """The model folder the workers start from (`folder`: `init.model_dir` as the driver found
    it): that one on one machine, when it is a URI, or when it lies in a local run storage (which
    every node mounts); else its copy in the run storage (`publish_folder`), which a worker on
    another node reads (through a local copy, for a URI: `local_model_dir`)."""
    if num_machines <= 1 or "://" in folder:
        return folder
    if "://" not in storage and Path(folder).resolve().is_relative_to(Path(storage).resolve()):
        return folder
    return publish_folder(Path(folder), f"{storage.rstrip('/')}/{INPUTS_DIR}")


def publish_folder(folder: Path, root: str) -> str:
    """A copy of `folder` under `root` (a path or URI), named by its name and a digest of its
    files' names, sizes and times, with `fetch.PUBLISHED` (the file list) written last; kept as
    it is when the copy there is complete. Returns the copy's location."""
    import hashlib

    from hlm_ray.prepare.fetch import PUBLISHED

    top = [p for p in sorted(folder.iterdir()) if p.name != PUBLISHED and p.name[:1] != "."]
    files = [f for p in top for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()]
    listing = {str(p.relative_to(folder)): p.stat().st_size for p in files}
    stamp = [(name, size, (folder / name).stat().st_mtime_ns) for name, size in listing.items()]
    digest = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:12]
    name = f"{folder.parent.name}-{folder.name}" if folder.name == "model" else folder.name
    target = f"{root.rstrip('/')}/{name}-{digest}"
    return _publish(folder, target, PUBLISHED, {"source": str(folder), "files": listing})


def local_model_dir(location: str) -> str:
    """The folder a worker loads `init.model_dir` from: a URI (a copy `model_location`
    published in an object store) through this node's copy of it."""
    if "://" not in location:
        return location
    from hlm_ray.prepare.fetch import PUBLISHED, local_copy

    return str(local_copy(location, marker=PUBLISHED, what="published model folder"))
