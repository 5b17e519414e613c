"""The address a Ray Train worker's process group listens on: the one Ray knows its node by.

    trainer = TorchTrainer(..., torch_config=torch_config())

Gloo (the CPU backend) binds each worker to the address its host's *name* resolves to. Where
that name resolves to loopback (Debian and Ubuntu map it to 127.0.1.1 in /etc/hosts) or to
nothing (it falls back to 127.0.0.1), every worker tells the others to reach it at a loopback
address, and a group spread over two machines never forms: "Gloo connectFullMesh failed ...
SO_ERROR: Connection refused, remote=[127.0.0.1]:PORT" after a timeout, then the same at each
restart. Ray already knows the address other nodes reach this one at (the node IP it joined the
cluster with), so before the group forms each worker is pointed at the interface that holds it
(`GLOO_SOCKET_IFNAME`), unless the user set that variable. NCCL chooses its own interfaces.
"""

from __future__ import annotations

import os
import socket

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


def interface_of(ip: str, interfaces: dict[str, list]) -> str | None:
    """The name of the interface that holds IPv4 address `ip` (`interfaces`: psutil's
    `net_if_addrs()`), or None."""
    for name, addresses in interfaces.items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addresses):
            return name
    return None


def bind_gloo_to_node_address() -> str | None:
    """In a Ray worker, before its process group forms: `GLOO_SOCKET_IFNAME` set to the
    interface of Ray's node address (kept as it is when already set). Returns the interface."""
    if os.environ.get(GLOO_IFNAME):
        return os.environ[GLOO_IFNAME]
    import psutil
    import ray.util

    name = interface_of(ray.util.get_node_ip_address(), psutil.net_if_addrs())
    if name is not None:
        os.environ[GLOO_IFNAME] = name
    return name


def torch_config():
    """Ray Train's `TorchConfig` whose backend binds each worker's gloo to its node address
    (`bind_gloo_to_node_address`) before it sets up the process group."""
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend

    class _NodeAddressBackend(_TorchBackend):
        def on_start(self, worker_group, backend_config):
            worker_group.execute(bind_gloo_to_node_address)
            super().on_start(worker_group, backend_config)

    class NodeAddressTorchConfig(TorchConfig):
        @property
        def backend_cls(self):
            return _NodeAddressBackend

    return NodeAddressTorchConfig()
