"""Data preparation, its own stage: sources -> tokenizer + token shards + manifest, on Ray Data.

    hlm data prepare --preset tiny-decoder --set data.sources=[DIR] --output OUT
    hlm train --preset tiny-decoder --objective headless --local --set data.prepared=OUT

    from hlm_ray.prepare import ensure_prepared, open_prepared, prepare, PrepareRequest
    prepared = ensure_prepared(cfg)     # data.prepared, or the cache folder for data.sources
    train = TokenBlocks.open(prepared, "train", seq_len=cfg.data.seq_len)

See `pipeline` (the steps of preparing), `request` (what a folder is made from, its key),
`sources` (files, pieces, documents), `split` (train / validation by document),
`corpus_tokenizer` (the BPE and its checks), `tokenize` (pieces to tokens, in process or on Ray
Data), `store` (atomic files, shards) and `reader` (memory-mapped blocks).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hlm_ray.prepare.request import Prepared

# Imported when first used (PEP 562): `hlm data --help`, built with every `hlm` command's parser,
# would otherwise import torch and Ray Data through the pipeline.
_LAZY = {
    "training_sample": "corpus_tokenizer",
    "prepare": "pipeline",
    "TokenBlocks": "reader",
    "open_prepared": "reader",
    "FORMAT_VERSION": "request",
    "Prepared": "request",
    "PrepareRequest": "request",
    "is_validation": "split",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def ensure_prepared(
    cfg, *, progress: bool | None = None, allow_smaller_vocab: bool = False
) -> Prepared:
    """`data.prepared` when set; else the cache's prepared folder for the config's sources and
    tokenizer settings (prepared now when missing or unfinished). Progress goes to stderr when
    it is a terminal (None) or `progress`, else to the log."""
    if progress is None:
        import sys

        progress = sys.stderr.isatty()
    from hlm_ray.prepare.pipeline import prepare
    from hlm_ray.prepare.reader import open_prepared
    from hlm_ray.prepare.request import PrepareRequest

    if cfg.data.prepared:
        return open_prepared(cfg.data.prepared)
    # In process: this runs inside drivers and Ray workers alike, where Ray Data tasks could wait
    # for CPUs the trainer holds. Large corpora are prepared by `hlm data prepare` on Ray Data.
    return prepare(
        PrepareRequest.from_config(cfg),
        workers=0,
        progress=progress,
        allow_smaller_vocab=allow_smaller_vocab,
    )


__all__ = [
    "FORMAT_VERSION",
    "PrepareRequest",
    "Prepared",
    "TokenBlocks",
    "ensure_prepared",
    "is_validation",
    "open_prepared",
    "prepare",
    "training_sample",
]
