"""Shared pytest fixtures."""

import pytest


@pytest.fixture(autouse=True)
def _hlm_cache_dir(tmp_path, monkeypatch):
    """Point HLM_CACHE_DIR at a per-test temp folder: tests never touch the user's cache."""
    cache = tmp_path / "hlm_cache"
    monkeypatch.setenv("HLM_CACHE_DIR", str(cache))
    return cache
