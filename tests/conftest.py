"""Shared pytest fixtures: hermetic caches, one local Ray cluster, one MLflow store and one
server over it, one torch thread for modules of tiny matrices, a tiny decoder folder; and how
`make test` splits the suite over two pytest-xdist workers."""

import os
import threading

import pytest
import torch
from tqdm import tqdm

# Progress bars in tests write under a lock of their process only, and start no monitor thread:
# `make mutants` forks mutmut's workers from a process that ran the tests, and tqdm's default
# lock holds a multiprocessing semaphore that the forks share; a worker killed while holding it
# (a mutant's timeout) left every later worker waiting for it forever, each then "timed out".
tqdm.set_lock(threading.RLock())
tqdm.monitor_interval = 0

XDIST_GROUP = "ray"
OWN_CLUSTERS_GROUP = "own-clusters"
# Modules whose tests start Ray clusters of their own, apart from the session's (several raylets
# on loopback, or the namespaced cluster box): their own group, so that pytest-xdist runs them on
# the other worker while the Ray group's long chain runs; one group, so never two at once.
# On 2 cores that took `make test` from 2,162 s to 1,897 s of pytest.
OWN_CLUSTER_MODULES = ("test_multinode.py", "test_cluster_box.py")

# The Ray group's modules that run several trials at once or start local clusters: last, so that
# they run once the other worker's quick tests are done (they are the slowest beside them, and a
# cluster starting on two busy cores can time out). Whole modules move, so module-scoped
# fixtures are still set up once. (The two of `OWN_CLUSTER_MODULES` keep their order in their
# own group.)
LAST_MODULES = ("test_headline.py", "test_multinode.py", "test_sweeps_together.py",
                "test_walkthrough.py", "test_cluster_box.py")  # fmt: skip


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    """`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`). The
    tests that start Ray (the shared `ray_cluster`, or one of their own: marked `ray`) run on
    one worker, one at a time as before: two at once on 2 cores starved Ray's start-up ("The
    current node timed out during startup"). So do the tests that log to the session's MLflow
    server, which is then started once. The tests of `OWN_CLUSTER_MODULES` form a second group,
    which the other worker takes (xdist hands out the biggest groups first) before all the
    rest."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if item.path.name in OWN_CLUSTER_MODULES:
            item.add_marker(pytest.mark.xdist_group(OWN_CLUSTERS_GROUP))
        elif fixtures & {"ray_cluster", "mlflow_server"} or item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group(XDIST_GROUP))
    rank = {name: i + 1 for i, name in enumerate(LAST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, 0))  # stable: the rest keep their order


def pytest_collection_finish(session):
    """pytest-xdist groups by a suffix on the node id, which it cannot add under some pytest
    versions (pytest 9 with xdist 3.8); then the groups are silently ignored. Say so instead."""
    if not session.config.getoption("loadgroup", False):  # not an xdist worker with loadgroup
        return
    suffixes = (f"@{XDIST_GROUP}", f"@{OWN_CLUSTERS_GROUP}")
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group")
            and not i.nodeid.endswith(suffixes)]  # fmt: skip
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist did not group {len(lost)} Ray test(s) (e.g. {lost[0]}): this pytest "
            "and pytest-xdist do not work together; install the dev extras' pytest (<9)"
        )


@pytest.fixture(autouse=True)
def _leave_a_core_to_ray(request, monkeypatch):
    """On two xdist workers, a test outside the Ray group runs its torch (and its subprocesses')
    on one thread: the other core stays with the Ray tests, the suite's critical path."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or request.node.get_closest_marker("xdist_group"):
        yield
        return
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _hlm_cache_dir(tmp_path, monkeypatch, _plan_rates):
    """Point HLM_CACHE_DIR at a per-test temp folder: tests never touch the user's cache. The
    step times CPU plans measure are kept for the session (each dry run would time its shapes
    again), in a file of its own (HLM_PLAN_RATES)."""
    cache = tmp_path / "hlm_cache"
    monkeypatch.setenv("HLM_CACHE_DIR", str(cache))
    monkeypatch.setenv("HLM_PLAN_RATES", str(_plan_rates))
    return cache


@pytest.fixture(scope="session")
def _plan_rates(tmp_path_factory):
    return tmp_path_factory.mktemp("plan") / "plan_rates.json"


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
def mlflow_server(tmp_path_factory, mlflow_store):
    """One local MLflow server over the session's sqlite store, what a sweep starts for itself
    on a sqlite store (10-45 s each): a sweep test points MLFLOW_TRACKING_URI at it, with
    `tracking.server.QUIET_LINKS` (set only while it does: the server sets them in this process
    for as long as it runs)."""
    from hlm_ray.tracking.server import QUIET_LINKS, tracking_server

    log = tmp_path_factory.mktemp("mlflow_server") / "server.log"
    with tracking_server(log) as uri:
        assert uri.startswith("http://127.0.0.1:")
        for key in QUIET_LINKS:
            os.environ.pop(key, None)
        yield uri


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One local Ray cluster shared by every Ray test (ray.init costs seconds, a trainer more).
    Workers get their own cache folder: they do not see pytest's per-test environment."""
    import ray

    from hlm_ray.train.launch import local_cluster_options

    cache = tmp_path_factory.mktemp("ray_worker_cache")
    # Its own dashboard port, which its processes' State API calls use: Train V2 cleans the
    # placement groups of a trial ASHA stopped through it, also beside other clusters.
    options = local_cluster_options()
    options["runtime_env"]["env_vars"].update(HLM_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
    ray.init(
        # A new local cluster even where another Ray runs on this machine (ray.init() would join
        # the one named in /tmp/ray/ray_current_cluster, e.g. left by a multi-node test).
        address="local",
        num_cpus=2,
        log_to_driver=False,
        **options,
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices on busy cores: one torch thread is many times faster than two. A module
    asks for it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tiny_decoder_dir(tmp_path_factory) -> str:
    """A tiny vanilla decoder folder (`make_tiny_decoder`)."""
    return make_tiny_decoder(tmp_path_factory.mktemp("tiny_decoder"))


def make_tiny_decoder(root) -> str:
    """A tiny vanilla decoder folder under `root` (the serving benchmark's: trained 2 steps,
    then random weights of std 0.15 so that its greedy text varies)."""
    from hlm_ray.bench.serve import tiny_model

    return tiny_model(root)


# The serving tests' session fixtures (one Serve application for test_serve*.py).
# An S3 API on loopback (moto's server) for run storage in an object store.
from s3_common import s3, s3_endpoint  # noqa: E402, F401
from serve_common import serve_app, serve_model_dir, serve_model_uri  # noqa: E402, F401
