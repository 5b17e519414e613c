"""Shared pytest fixtures: hermetic caches, one local Ray cluster, one MLflow store."""

import os

import pytest


@pytest.fixture(autouse=True)
def _hlm_cache_dir(tmp_path, monkeypatch):
    """Point HLM_CACHE_DIR at a per-test temp folder: tests never touch the user's cache."""
    cache = tmp_path / "hlm_cache"
    monkeypatch.setenv("HLM_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="session", autouse=True)
def mlflow_store(tmp_path_factory):
    """One sqlite MLflow store for the session (a new store takes ~10 s to migrate); no test
    writes to the project's own mlflow.db."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root}/mlflow.db"
    old = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "HLM_MLFLOW_DIR")}
    os.environ["MLFLOW_TRACKING_URI"] = uri
    os.environ["HLM_MLFLOW_DIR"] = str(root)
    yield uri
    for key, value in old.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One local Ray cluster shared by every Ray test (ray.init costs seconds, a trainer more).
    Workers get their own cache folder: they do not see pytest's per-test environment."""
    import ray

    cache = tmp_path_factory.mktemp("ray_worker_cache")
    ray.init(
        num_cpus=2,
        include_dashboard=True,  # Train V2 cleans placement groups through the State API
        runtime_env={"env_vars": {"HLM_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}},
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()
