"""Prepare several configs' corpora at once, as Ray tasks across the cluster (sweeps).

    prepared = prepare_many([cfg_v1024, cfg_v4096, cfg_v16384])   # one task per distinct request

Each task prepares in its own process into the cache (HLM_CACHE_DIR: shared between nodes on a
cluster), where the trials' `ensure_prepared(cfg)` then finds the folder. Without Ray running
the requests are prepared one after another in this process.
"""

from __future__ import annotations

import sys
import time

from hlm_ray.errors import HLMError
from hlm_ray.prepare.pipeline import prepare
from hlm_ray.prepare.request import Prepared, PrepareRequest


def _prepare_one(request: PrepareRequest, publish: str | None = None) -> Prepared:
    prepared = prepare(request, workers=0, allow_smaller_vocab=True, progress=False)
    if publish is None:
        return prepared
    from hlm_ray.cluster import publish_prepared

    return Prepared(publish_prepared(prepared, publish), prepared.manifest)


def prepare_many(cfgs: list, progress: bool = True, publish: str | None = None) -> list[Prepared]:
    """One `Prepared` per config, in order; each distinct request is prepared once. With
    `publish` (a run storage every node reaches), each task then copies its folder there, out
    of the cache of whichever node ran it (`cluster.publish_prepared`), and returns the copy."""
    requests = [PrepareRequest.from_config(c) for c in cfgs]
    distinct = list(dict.fromkeys(requests))
    started = time.perf_counter()
    import ray

    if ray.is_initialized():
        task = ray.remote(num_cpus=1, max_retries=0)(_prepare_one)
        try:
            done = ray.get([task.remote(r, publish) for r in distinct])
        except ray.exceptions.RayTaskError as err:
            from hlm_ray.prepare.tokenize import as_hlm_error

            raise as_hlm_error(err) from err
    else:
        done = [_prepare_one(r, publish) for r in distinct]
    by_request = dict(zip(distinct, done, strict=True))
    if progress:
        for r in distinct:
            p = by_request[r]
            print(
                f"prepared {r.tokenizer_kind} {p.manifest['tokenizer']['vocab_size']} tokens: "
                f"{p.uri} (fingerprint {p.fingerprint[:12]})",
                file=sys.stderr,
            )
        print(
            f"prepared {len(distinct)} corpora in parallel in {time.perf_counter() - started:.1f} s",
            file=sys.stderr,
        )
    if not done:
        raise HLMError("nothing to prepare")
    return [by_request[r] for r in requests]
