"""The document-level split: a document goes to validation when a seeded hash of its text falls
below `val_fraction`, so it lies wholly in one split, duplicates share a split, and the split does
not depend on how the work is cut.

    split_documents(docs, seed=0, val_fraction=0.02)   # {"train": [...], "val": [...]}
"""

from __future__ import annotations

import hashlib

SPLITS = ("train", "val")


def is_validation(doc: str, seed: int, val_fraction: float) -> bool:
    """A seeded hash of the document's text, as a number in [0, 1), below `val_fraction`."""
    digest = hashlib.blake2b(doc.encode("utf-8"), digest_size=8, salt=seed.to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little") / 2**64 < val_fraction


def split_documents(docs: list[str], seed: int, val_fraction: float) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"train": [], "val": []}
    for doc in docs:
        out["val" if is_validation(doc, seed, val_fraction) else "train"].append(doc)
    return out
