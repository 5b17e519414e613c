"""A cluster in a box: a Ray head and two worker nodes on one Linux machine, each node in its
own network namespace (its own address on a bridge) and its own mount namespace (a private
/tmp, HOME and ~/.cache, its own copy-on-write view of the checkout), sharing only what a
KubeRay cluster's pods share:

- a volume mounted at /mnt/shared in every node (the `hlm-shared` claim of deploy/README.md,
  here one folder), which holds the data folder (`HLM_DATA_DIR=/mnt/shared/data`);
- an S3-compatible object store (moto's server) on the head's network;
- an `mlflow server` on PostgreSQL, its artifacts in the object store, at the head's address;
- the Ray head, with token authentication on.

A client namespace reaches the head alone (its own link to it), as a laptop reaches a cluster
through a port-forward: jobs go in with `ray job submit`, results come out of MLflow.

    python deploy/box/box.py up        # as root; prints the addresses, the token, how to submit
    python deploy/box/box.py client -- ray job submit --address http://198.18.1.1:8265 ...
    python deploy/box/box.py down      # no namespace, mount, link or process left behind
    python deploy/box/scenarios.py     # up, every scenario, down: what they found

Needs Linux, root and iproute2 (`ip`), util-linux (`unshare`), PostgreSQL's server binaries and
the dev extra (moto, psycopg2); `missing()` names what is not there in one line. Nothing the
box starts listens outside its own namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nodes import (
    CHECKOUT,
    CLIENT_IP,
    HEAD_CLIENT_IP,
    HEAD_IP,
    HEALTH_ENV,
    HOSTS,
    NODE_CPUS,
    PORTS,
    PREFIX,
    SHARED,
    WORKERS,
    Node,
    Nodes,
    base_env,
    last_json,
    leftovers,
    links,
    running,
    teardown,
)
from services import ARTIFACT_BUCKET, RUN_BUCKET, S3_ENV, Services, pg_bin

__all__ = [  # what the scenarios and tests take from here
    "ARTIFACT_BUCKET", "CHECKOUT", "CLIENT_IP", "HEAD_CLIENT_IP", "HEAD_IP", "NODE_CPUS",
    "PORTS", "PREFIX", "RUN_BUCKET", "SHARED", "WORKERS", "Box", "Node", "last_json",
    "leftovers", "links", "missing", "running", "teardown",
]  # fmt: skip


def missing() -> str | None:
    """What this machine lacks to run the box, in one line; None when it has everything."""
    if sys.platform != "linux":
        return "the cluster box needs Linux (network and mount namespaces)"
    if os.geteuid() != 0:
        return "the cluster box needs root (it creates network namespaces and mounts)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("mount", "mount")):
        if shutil.which(tool) is None:
            return f"the cluster box needs `{tool}` ({package})"
    for what, path in (("checkout", CHECKOUT), ("Python", Path(sys.prefix))):
        if path.is_relative_to("/mnt"):
            return (
                f"the cluster box mounts its own /mnt in every node, which would hide the {what} "
                f"at {path}: run it from a checkout and virtualenv outside /mnt"
            )
    if pg_bin() is None:
        return "the cluster box needs PostgreSQL's server binaries (initdb, postgres)"
    for module, extra in (("moto", "moto[server]"), ("psycopg2", "psycopg2-binary")):
        try:
            __import__(module)
        except ImportError:
            return f"the cluster box needs {extra} (pip install -e '.[dev]')"
    probe = subprocess.run(
        ["ip", "netns", "add", f"{PREFIX}-probe"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"cannot create a network namespace here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{PREFIX}-probe"], capture_output=True)
    return None


@dataclass
class Box(Nodes, Services):
    """A running box (or one to start): its folder holds the state, the logs, the shared volume
    and each node's private files."""

    root: Path
    prefix: str = PREFIX
    token: str = ""
    nodes: dict[str, Node] = field(default_factory=dict)
    data_dir: str = ""

    # ------------------------------------------------------------------ addresses, env

    @property
    def dashboard(self) -> str:
        """The Job API as the client reaches it."""
        return f"http://{HEAD_CLIENT_IP}:{PORTS['dashboard']}"

    @property
    def mlflow(self) -> str:
        """The tracking server, by its name in the cluster (on the head's address)."""
        return f"http://mlflow:{PORTS['mlflow']}"

    @property
    def client_mlflow(self) -> str:
        return f"http://{HEAD_CLIENT_IP}:{PORTS['mlflow']}"

    @property
    def s3(self) -> str:
        return f"http://s3:{PORTS['s3']}"

    def node_env(self, node: Node) -> dict[str, str]:
        """What every pod of a KubeRay cluster gets from its manifest and Secrets."""
        home = f"/tmp/home-{node.name}"  # inside the node's private /tmp
        return {
            "HOME": home,
            "XDG_CACHE_HOME": f"{home}/.cache",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "MLFLOW_TRACKING_URI": self.mlflow,
            "AWS_ENDPOINT_URL": self.s3,
            "MLFLOW_S3_ENDPOINT_URL": self.s3,
            **S3_ENV,
            "HLM_DATA_DIR": f"{SHARED}/data",
            "OMP_NUM_THREADS": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
            "PYTHONUNBUFFERED": "1",
            **HEALTH_ENV,
        }

    def client_env(self) -> dict[str, str]:
        """The user's shell on the laptop: the token, and where the cluster's services are."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
        env["PATH"] = base_env()["PATH"]  # the project's virtualenv, activated
        env.update(
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=self.token,
            RAY_ADDRESS=self.dashboard,
            MLFLOW_TRACKING_URI=self.client_mlflow,
            MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT="true",
            RAY_USAGE_STATS_ENABLED="0",
        )
        return env

    # ------------------------------------------------------------------ state

    @property
    def state_file(self) -> Path:
        return self.root / "box.json"

    @property
    def shared(self) -> Path:
        """The shared volume as the host sees it (/mnt/shared in the nodes)."""
        return self.root / "shared"

    def save(self) -> None:
        state = asdict(self)
        state["root"] = str(self.root)
        self.state_file.write_text(json.dumps(state, indent=1))

    @classmethod
    def load(cls, root: Path) -> Box:
        state = json.loads((root / "box.json").read_text())
        nodes = {k: Node(**v) for k, v in state.pop("nodes").items()}
        state["root"] = Path(state["root"])
        return cls(**state, nodes=nodes)

    def log(self, name: str) -> Path:
        path = self.root / "logs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def spawn(self, node_name: str, argv: list[str], log: str, env: dict | None = None,
              private: bool = True) -> subprocess.Popen:  # fmt: skip
        """`argv` in the background on the node; `private`: in its pod (the head's services
        share the machine's files, as a managed database would its own)."""
        node = self.nodes[node_name]
        full = self.in_pod(node, argv) if private else [
            "ip", "netns", "exec", node.netns, *argv]  # fmt: skip
        out = self.log(log).open("ab")
        return subprocess.Popen(
            full,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**base_env(), **self.node_env(node), **(env or {})},
            start_new_session=True,
        )

    def run(self, node_name: str, argv: list[str], timeout: float = 120, **kw):
        """`argv` inside the node's pod (its namespaces, its env), to the end."""
        node = self.nodes[node_name]
        env = {**base_env(), **self.node_env(node), **kw.pop("env", {})}
        return subprocess.run(self.in_pod(node, argv), env=env, timeout=timeout,
                              capture_output=True, text=True, **kw)  # fmt: skip

    def client(self, argv: list[str], timeout: float = 900, **kw) -> subprocess.CompletedProcess:
        """`argv` from the client namespace, in the checkout, as the user types it."""
        env = {**self.client_env(), **kw.pop("env", {})}
        return subprocess.run(
            ["ip", "netns", "exec", self.nodes["client"].netns, *argv],
            env=env, cwd=kw.pop("cwd", CHECKOUT), timeout=timeout, capture_output=True,
            text=True, **kw,
        )  # fmt: skip

    def client_background(self, argv: list[str]) -> subprocess.Popen:
        """`argv` from the client namespace, running on; its output through `communicate`."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.nodes["client"].netns, *argv],
            env=self.client_env(), cwd=CHECKOUT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    # ------------------------------------------------------------------ up, down

    def up(self) -> Box:
        from hlm_ray.paths import data_dir

        reason = missing()
        if reason:
            raise SystemExit(f"error: {reason}")
        if leftovers(self.prefix):
            raise SystemExit(
                f"error: a cluster box is already up on this machine (namespaces "
                f"{self.prefix}-*): `python deploy/box/box.py down` first"
            )
        if (self.root / "box.json").exists():  # an earlier box's folder: start from nothing
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        self.data_dir = str(data_dir())
        if not Path(self.data_dir).is_dir():
            raise SystemExit(f"error: the data folder {self.data_dir} is missing (HLM_DATA_DIR)")
        (self.shared / "data").mkdir(parents=True, exist_ok=True)  # the data's mount point
        names = "".join(f"{ip} {name}\n" for name, ip in HOSTS.items())
        (self.root / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
        started = time.perf_counter()
        try:
            self._network()
            for name in ("head", *WORKERS):
                self.start_pod(self.nodes[name])
            self.save()
            # Ray's head and the S3 server start while PostgreSQL is made, then MLflow.
            self.start_ray("head")
            self._object_store()
            self._postgres()
            self._buckets()
            self._mlflow()
            self.wait_head()
            for name in WORKERS:
                self.start_ray(name)
            self.wait_nodes(1 + len(WORKERS))
        except BaseException:
            self.down()
            raise
        print(f"box up in {time.perf_counter() - started:.0f} s: {self.summary()}")
        return self

    def summary(self) -> str:
        workers = ", ".join(f"{n} {self.nodes[n].ip}" for n in WORKERS)
        return (
            f"head {HEAD_IP} (client side {HEAD_CLIENT_IP}), workers {workers}; "
            f"jobs {self.dashboard}, MLflow {self.client_mlflow}, S3 {self.s3}, "
            f"shared volume {self.shared} at {SHARED}"
        )

    def down(self) -> None:
        """Every process in the box's namespaces killed, the namespaces and links removed (their
        mounts go with the last process of each mount namespace)."""
        teardown(self.prefix)


ROOT = "/var/tmp/hlm-box"
"""The box's folder unless `--root` names another."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: `--root` before or after the command (`box.py up --root X` and
    `box.py --root X up` alike); for `client` and `node`, what follows is the command to run,
    after an optional `--`, and a `--root` there is that command's."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = argparse.ArgumentParser(add_help=False)
    root.add_argument("--root", default=argparse.SUPPRESS, help=f"the box's folder ({ROOT})")
    parser.add_argument("--root", default=argparse.SUPPRESS, help=f"the box's folder ({ROOT})")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, says in (("up", "start the box"), ("down", "remove everything the box made"),
                       ("status", "the box's nodes and services")):  # fmt: skip
        commands.add_parser(name, parents=[root], help=says)
    for name, says in (("client", "run a command from the client namespace"),
                       ("node", "run a command on a node: node NAME COMMAND...")):  # fmt: skip
        command = commands.add_parser(name, parents=[root], help=says)
        command.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    args.root = Path(getattr(args, "root", ROOT))
    rest = getattr(args, "rest", [])
    args.rest = rest[1:] if rest[:1] == ["--"] else rest
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    root = args.root
    if args.command == "up":
        Box(root).up()
    elif args.command == "down":
        teardown()
        print("box down")
    elif args.command == "status":
        if not leftovers():
            print("no box is up")
            return 1
        box = Box.load(root)
        print(box.summary())
        for node in box.alive_nodes():
            print(f"  node {node['NodeManagerAddress']}: {node['Resources']}")
    else:
        box = Box.load(root)
        rest = args.rest
        done = box.client(rest) if args.command == "client" else box.run(rest[0], rest[1:])
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr)
        return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
