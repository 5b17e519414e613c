"""A local Ray cluster of this process's own, living beside other Rays of the machine: whether
`ray.init` would start one, its options, and its console. What `hlm train`, the sweeps and
`hlm serve` share when they start Ray themselves.

    if starts_local(os.environ.get("RAY_ADDRESS")):   # nothing named, nothing `ray start`ed
        quiet_token_notice()
        ray.init(**local_cluster_options())
"""

from __future__ import annotations

from typing import Any

TOKEN_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"


def quiet_token_notice() -> None:
    """Ray 2.60 turns token authentication on for a cluster `ray.init` starts and says so, a
    WARNING on every run that asks nothing of the user: kept off the console (the setting
    itself stays Ray's). Not by setting RAY_AUTH_MODE=token instead: read after Ray is
    imported, it left this process without the token its new cluster then asked for."""
    import logging

    logging.getLogger(TOKEN_NOTICE_LOGGER).setLevel(logging.ERROR)


def starts_local(address: str | None) -> bool:
    """Whether `ray.init(address)` starts a new local cluster (nothing to join)."""
    if address == "local":
        return True
    if address:
        return False
    from ray._private.services import get_ray_address_from_environment

    return get_ray_address_from_environment(None, None) is None


def local_cluster_options() -> dict[str, Any]:
    """`ray.init` options for a local cluster of this process that lives beside others on the
    machine (another run or sweep started at the same time, each with its own cluster).

    Ray Train's placement-group cleaner asks the State API about its controller without an
    address; with two local clusters, Ray's lookup finds both GCS processes and fails every few
    seconds ("Found multiple active Ray instances", a traceback each time). The cluster's
    dashboard (the State API server) gets a port chosen here, and its processes are told where
    it is (`RAY_API_SERVER_ADDRESS`, which that lookup reads first)."""
    from hlm_ray.tracking.server import free_port

    port = free_port()  # Ray's dashboard takes it a moment later
    return {
        "include_dashboard": True,  # Train V2 cleans placement groups through the State API
        "dashboard_host": "127.0.0.1",
        "dashboard_port": port,
        "runtime_env": {"env_vars": {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"}},
    }
