"""What a prepared folder is made from (`PrepareRequest`, its cache key and default folder) and
what a finished one is (`Prepared`).

    request = PrepareRequest.from_config(cfg)   # sources, tokenizer and split settings
    key = request.key(resolve_sources(request.sources))   # settings + source files' fingerprints
    Prepared(uri, manifest).tokenizer()
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from hlm_ray.paths import cache_dir
from hlm_ray.prepare.sources import SourceFiles
from hlm_ray.prepare.store import TOKENIZER_DIR

FORMAT_VERSION = 1
# Request fields that have the same name in the config's tokenizer / data sections.
_SAME_IN_TOKENIZER = ("vocab_size", "min_frequency", "train_sample_bytes")
_SAME_IN_DATA = ("text_field", "val_fraction", "split_seed", "shard_tokens", "invalid_utf8")


@dataclass(frozen=True)
class PrepareRequest:
    """Everything the prepared folder depends on (its cache key, with the sources' files)."""

    sources: tuple[str, ...]
    family: str = "decoder"
    """Model family: which special tokens the tokenizer gets."""
    tokenizer_kind: str = "bpe"
    vocab_size: int = 1024
    tokenizer_path: str | None = None
    min_frequency: int = 2
    train_sample_bytes: int | None = 100_000_000
    text_field: str = "text"
    val_fraction: float = 0.02
    split_seed: int = 0
    shard_tokens: int = 1 << 24
    piece_bytes: int = 8 << 20
    invalid_utf8: str = "refuse"

    @classmethod
    def from_config(cls, cfg) -> PrepareRequest:
        t, d = cfg.tokenizer, cfg.data
        return cls(
            sources=tuple(d.sources),
            family=cfg.model.family,
            tokenizer_kind=t.kind,
            tokenizer_path=t.path,
            **{k: getattr(t, k) for k in _SAME_IN_TOKENIZER},
            **{k: getattr(d, k) for k in _SAME_IN_DATA},
        )

    def key(self, files: list[SourceFiles]) -> str:
        """What the tokens depend on: settings (not where the work is cut) and source files."""
        settings = {k: v for k, v in asdict(self).items() if k not in ("sources", "piece_bytes")}
        if self.tokenizer_kind == "file":
            settings.pop("vocab_size"), settings.pop("min_frequency")
            settings.pop("train_sample_bytes")
        payload = {
            "format": FORMAT_VERSION,
            "settings": settings,
            "sources": [f.fingerprint for f in files],  # files, not how they were named
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Prepared:
    """A finished prepared folder."""

    uri: str
    manifest: dict

    @property
    def path(self) -> Path:
        return Path(self.uri)

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    def tokenizer(self):
        from hlm_ray.tokenizer import load_tokenizer

        return load_tokenizer(self.path / TOKENIZER_DIR)


def default_output(request: PrepareRequest, key: str, root: str | None = None) -> str:
    """The cache folder of a request (or a folder named the same way under `root`)."""
    name = f"{request.tokenizer_kind}{request.vocab_size}-{key[:16]}"
    if request.tokenizer_kind == "file":
        name = f"file-{key[:16]}"
    if root:
        return f"{root.rstrip('/')}/{name}"
    return str(cache_dir("prepared") / name)
