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
import contextlib
import json
import os
import pwd
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
PREFIX = "hlmbox"
"""The names of a box's namespaces and links start with its prefix (this one by default; a
test's box has its own, so that one left by a killed run does not stop the next)."""
SUBNET = "198.18.0"  # the cluster's network (RFC 2544's benchmarking range: never routed)
CLIENT_SUBNET = "198.18.1"  # the client's link to the head
HEAD_IP = f"{SUBNET}.1"
HEAD_CLIENT_IP = f"{CLIENT_SUBNET}.1"
CLIENT_IP = f"{CLIENT_SUBNET}.2"
WORKERS = {"w1": f"{SUBNET}.11", "w2": f"{SUBNET}.12"}
# Names the nodes resolve (their /etc/hosts), as a Kubernetes Service's name resolves in pods.
HOSTS = {"hlm-head": HEAD_IP, "mlflow": HEAD_IP, "s3": HEAD_IP,
         **{f"hlm-{name}": ip for name, ip in WORKERS.items()}}  # fmt: skip
SHARED = "/mnt/shared"  # the volume's path in every node, as in deploy/kuberay/*.yaml
PORTS = {"gcs": 6379, "dashboard": 8265, "serve": 8000, "s3": 9000, "mlflow": 5000, "pg": 5432}
RUN_BUCKET = "hlm-runs"  # the runs' object storage (s3://hlm-runs/...)
ARTIFACT_BUCKET = "hlm-mlflow"  # MLflow's artifact store
# moto accepts any credentials; a cluster's pods get theirs from a Secret.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "hlm-box",
    "AWS_SECRET_ACCESS_KEY": "hlm-box-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
# How fast the head declares a silent node dead. Each check waits `timeout` for the raylet's
# answer, the next starts `period` later, and `threshold` misses in a row make the node dead:
# Ray's defaults (3 s, 10 s, 5) take about 65 s; the box's, 15 s. A raylet on a busy 2-core
# machine can be slow to answer, above all while it starts: 2 s to answer, five misses in a row,
# and no check in a node's first 30 s keep a slow node from being declared dead by mistake.
HEALTH_ENV = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "5",
    "RAY_health_check_initial_delay_ms": "30000",
}
NODE_CPUS = 2
"""Per worker node: a 2-CPU Train worker fills one (`hlm train --num-workers 2 --cpus-per-worker
2` lands on both, as one worker per machine on a real cluster), and beside a serving replica
(half a CPU) a 1-CPU sweep trial still fits on the node that is left when the other is cut."""
START_TIMEOUT_S = 180.0


def missing() -> str | None:
    """What this machine lacks to run the box, in one line; None when it has everything."""
    if sys.platform != "linux":
        return "the cluster box needs Linux (network and mount namespaces)"
    if os.geteuid() != 0:
        return "the cluster box needs root (it creates network namespaces and mounts)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("mount", "mount")):
        if shutil.which(tool) is None:
            return f"the cluster box needs `{tool}` ({package})"
    if _pg_bin() is None:
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


def _pg_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    if not found and shutil.which("postgres"):
        found = [Path(shutil.which("postgres"))]
    return found[-1].parent if found else None


@dataclass
class Node:
    name: str
    ip: str
    netns: str
    veth: str  # the host end of its link: down = the node cut off
    cpus: int = 0
    pod: int = 0  # the process holding its namespaces (`start_pod`)


@dataclass
class Box:
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
        env["PATH"] = _base_env()["PATH"]  # the project's virtualenv, activated
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

    # ------------------------------------------------------------------ network

    def _network(self) -> None:
        p, bridge = self.prefix, f"{self.prefix}-br"
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        self.nodes["head"] = Node("head", HEAD_IP, f"{p}-head", f"{p}-head")
        for name, ip in WORKERS.items():
            self.nodes[name] = Node(name, ip, f"{p}-{name}", f"{p}-{name}", NODE_CPUS)
        for node in self.nodes.values():
            _ip("netns", "add", node.netns)
            _ip("link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns",
                node.netns)  # fmt: skip
            _ip("link", "set", node.veth, "master", bridge, "up")
            self._address(node.netns, "eth0", f"{node.ip}/24")
        # The client: a link to the head alone (the head does not forward).
        self.nodes["client"] = Node("client", CLIENT_IP, f"{p}-client", f"{p}-cl")
        _ip("netns", "add", f"{p}-client")
        _ip("link", "add", f"{p}-cl", "netns", f"{p}-client", "type", "veth",
            "peer", "name", "client0", "netns", f"{p}-head")  # fmt: skip
        self._address(f"{p}-client", f"{p}-cl", f"{CLIENT_IP}/24")
        self._address(f"{p}-head", "client0", f"{HEAD_CLIENT_IP}/24")

    @staticmethod
    def _address(netns: str, dev: str, cidr: str) -> None:
        _ip("-n", netns, "addr", "add", cidr, "dev", dev)
        _ip("-n", netns, "link", "set", dev, "up")
        _ip("-n", netns, "link", "set", "lo", "up")

    def cut(self, name: str) -> None:
        """The node's link down: alive but unreachable, every packet to and from it lost."""
        _ip("link", "set", self.nodes[name].veth, "down")

    def mend(self, name: str) -> None:
        """The node's link up again. Its Ray processes learn on reconnecting that the head
        declared the node dead, and end; `rejoin` starts it as a new node."""
        _ip("link", "set", self.nodes[name].veth, "up")

    def rejoin(self, name: str, nodes: int, wait: bool = True) -> None:
        """Ray started again on node `name` (whatever is left of the old one killed; its pod,
        with its disk, stays): the cluster is back to `nodes` alive nodes (`wait` False: the
        caller waits, with `wait_nodes`, once it has done something else meanwhile)."""
        node = self.nodes[name]
        for pid in self.pids(name):
            if pid != node.pod:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.start_ray(name)
        if wait:
            self.wait_nodes(nodes)

    def drop_port_to(self, name: str, port: int) -> list[str]:
        """The head's answers from `port` to node `name` are dropped (its SYN-ACKs and data
        included): from that node the service hangs as behind a dead link; the rest of the
        cluster reaches it. Returns the rule, for `restore`."""
        rule = ["to", self.nodes[name].ip, "ipproto", "tcp", "sport", str(port), "blackhole"]
        _ip("-n", self.nodes["head"].netns, "rule", "add", *rule)
        return rule

    def restore(self, rule: list[str]) -> None:
        _ip("-n", self.nodes["head"].netns, "rule", "del", *rule)

    # ------------------------------------------------------------------ processes

    def start_pod(self, node: Node) -> None:
        """The node's sandbox, as a pod's: a process that holds its network namespace and a mount
        namespace of its own, where /tmp (so Ray's session folder, and HOME) is private, the
        checkout is a copy-on-write view (what a node writes there stays on it), the machine's
        data folder is hidden, /etc/hosts names the cluster's services, and the shared volume
        (with the data in it) is at /mnt/shared. Everything on the node runs inside it
        (`in_pod`); it ends, and its mounts with it, when its processes are killed."""
        private = self.root / "nodes" / node.name
        for sub in ("upper", "work"):
            (private / sub).mkdir(parents=True, exist_ok=True)
        data = Path(self.data_dir)
        mounts = [
            "mount --make-rprivate /",
            f"mount --bind {q(self.root / 'hosts')} /etc/hosts",
            f"mount -t tmpfs -o size=64m tmpfs /mnt && mkdir -p {SHARED}",
            f"mount --bind {q(self.shared)} {SHARED}",
            f"mount --bind -o ro {q(data)} {SHARED}/data",
            f"mount -t tmpfs -o size=1m tmpfs {q(data)}",  # the machine's own copy: hidden
            f"mount -t overlay overlay -o lowerdir={q(CHECKOUT)},upperdir={q(private / 'upper')},"
            f"workdir={q(private / 'work')} {q(CHECKOUT)}",
            "mount -t tmpfs -o size=6g tmpfs /tmp",
            f"mkdir -p /tmp/home-{node.name}",
        ]
        if Path.home().joinpath(".cache").is_dir():  # a program that reads ~ from passwd
            mounts.append(f"mount -t tmpfs -o size=1m tmpfs {q(Path.home() / '.cache')}")
        script = " && ".join([*mounts, "echo ready", "exec sleep infinity"])
        # Its own PID namespace too (a fresh /proc): Ray finds "other clusters" by scanning
        # processes, and a node must see only its own.
        pod = subprocess.Popen(
            ["ip", "netns", "exec", node.netns, "unshare", "--mount", "--pid", "--fork",
             "--mount-proc", "--", "sh", "-c", script],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        line = pod.stdout.readline().decode().strip()
        if line != "ready":
            raise RuntimeError(f"node {node.name}: its namespace could not be set up: {line}")
        # The pod's first process (the one inside the namespaces) is unshare's child.
        children = Path(f"/proc/{pod.pid}/task/{pod.pid}/children").read_text().split()
        node.pod = int(children[0])

    def in_pod(self, node: Node, argv: list[str]) -> list[str]:
        """`argv` inside the node's namespaces, in the checkout (as `kubectl exec` into a pod)."""
        script = f"cd {q(CHECKOUT)} && exec {shlex.join(argv)}"
        return ["nsenter", "-t", str(node.pod), "-m", "-n", "-p", "--", "sh", "-c", script]

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
            env={**_base_env(), **self.node_env(node), **(env or {})},
            start_new_session=True,
        )

    def run(self, node_name: str, argv: list[str], timeout: float = 120, **kw):
        """`argv` inside the node's pod (its namespaces, its env), to the end."""
        node = self.nodes[node_name]
        env = {**_base_env(), **self.node_env(node), **kw.pop("env", {})}
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

    def pids(self, name: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.nodes[name].netns],
                             capture_output=True, text=True).stdout  # fmt: skip
        return [int(p) for p in out.split()]

    # ------------------------------------------------------------------ services

    def _postgres(self) -> None:
        pgbin = _pg_bin()
        name, user = _unprivileged()
        folder = self.root / "pg"
        folder.mkdir()
        os.chown(folder, user["user"], user["group"])
        # The database's user must get through the box's folder (mkdtemp makes it 0700).
        self.root.chmod(self.root.stat().st_mode | 0o711)
        done = subprocess.run([pgbin / "initdb", "-D", folder / "data", "-U", "mlflow",
                               "--auth=trust", "-E", "UTF8", "--no-sync"], cwd=folder,
                              capture_output=True, text=True, **user)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr.strip()[-500:]}")
        # runuser after `ip netns exec`: entering the namespace needs root.
        self.spawn("head", ["runuser", "-u", name, "--", str(pgbin / "postgres"),
                            "-D", str(folder / "data"), "-h", "127.0.0.1",
                            "-p", str(PORTS["pg"]), "-k", str(folder), "-c", "fsync=off"],
                   "postgres.log", private=False)  # fmt: skip
        address = ["-h", "127.0.0.1", "-p", str(PORTS["pg"]), "-U", "mlflow"]
        ns = ["ip", "netns", "exec", self.nodes["head"].netns]
        _wait(lambda: subprocess.run([*ns, pgbin / "pg_isready", *address, "-d", "postgres"],
                                     capture_output=True).returncode == 0,
              "PostgreSQL", self.log("postgres.log"))  # fmt: skip
        subprocess.run([*ns, pgbin / "createdb", *address, "mlflow"], check=True,
                       capture_output=True)  # fmt: skip

    def _object_store(self) -> None:
        moto = Path(sys.executable).with_name("moto_server")
        self.spawn("head", [str(moto), "-H", "0.0.0.0", "-p", str(PORTS["s3"])], "s3.log",
                   private=False)  # fmt: skip

    def _buckets(self) -> None:
        """Once the S3 server answers: the runs' and MLflow's buckets."""
        _wait(lambda: self._http_ok("head", f"http://{HEAD_IP}:{PORTS['s3']}/"), "the S3 server",
              self.log("s3.log"))  # fmt: skip
        script = (
            f"import boto3; s3 = boto3.client('s3', endpoint_url={self.s3!r})\n"
            f"for b in ({RUN_BUCKET!r}, {ARTIFACT_BUCKET!r}): s3.create_bucket(Bucket=b)"
        )
        done = self.run("head", [sys.executable, "-c", script])
        if done.returncode != 0:
            raise RuntimeError(f"could not create the buckets: {done.stderr[-500:]}")

    def _mlflow(self) -> None:
        argv = [sys.executable, "-m", "mlflow", "server",
                "--backend-store-uri",
                f"postgresql+psycopg2://mlflow@127.0.0.1:{PORTS['pg']}/mlflow",
                "--artifacts-destination", f"s3://{ARTIFACT_BUCKET}/artifacts",
                "--host", "0.0.0.0", "--port", str(PORTS["mlflow"]), "--workers", "1",
                # MLflow answers 403 to a Host header outside this list (its guard against DNS
                # rebinding; by default loopback and RFC 1918 addresses): the name the nodes
                # use, and the address the client reaches it at.
                "--allowed-hosts", f"mlflow:{PORTS['mlflow']},{HEAD_CLIENT_IP}:{PORTS['mlflow']},"
                "localhost:*,127.0.0.1:*"]  # fmt: skip
        local_s3 = f"http://127.0.0.1:{PORTS['s3']}"  # the server shares the head's network
        env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_S3_ENDPOINT_URL": local_s3,
               "AWS_ENDPOINT_URL": local_s3}  # fmt: skip
        self.spawn("head", argv, "mlflow.log", env=env, private=False)
        _wait(lambda: self._http_ok("head", f"http://{HEAD_IP}:{PORTS['mlflow']}/health"),
              "the MLflow server", self.log("mlflow.log"))  # fmt: skip

    def _http_ok(self, node: str, url: str) -> bool:
        probe = f"import urllib.request as u; u.urlopen({url!r}, timeout=2)"
        ns = ["ip", "netns", "exec", self.nodes[node].netns, sys.executable, "-c", probe]
        return subprocess.run(ns, capture_output=True).returncode == 0

    def start_ray(self, name: str) -> subprocess.Popen:
        """`ray start --block` on the node (the head first)."""
        ray = str(Path(sys.executable).with_name("ray"))
        node = self.nodes[name]
        common = ["--node-ip-address", node.ip, "--num-cpus", str(node.cpus), "--block",
                  "--disable-usage-stats"]  # fmt: skip
        if name == "head":
            argv = [ray, "start", "--head", "--port", str(PORTS["gcs"]),
                    "--dashboard-host", "0.0.0.0", *common]  # fmt: skip
        else:
            argv = [ray, "start", "--address", f"{HEAD_IP}:{PORTS['gcs']}", *common]
        return self.spawn(name, argv, f"ray-{name}.log")

    def alive_nodes(self) -> list[dict]:
        """The cluster's alive nodes, as the Job API's client sees them (via the head)."""
        script = (
            "import json, ray; ray.init(log_to_driver=False); "
            "print(json.dumps([n for n in ray.nodes() if n['Alive']]))"
        )
        done = self.run("head", [sys.executable, "-c", script], timeout=90,
                        env={"RAY_ADDRESS": f"{HEAD_IP}:{PORTS['gcs']}"})  # fmt: skip
        if done.returncode != 0:
            return []
        try:
            return last_json(done.stdout, list)
        except AssertionError:  # no list printed: none known alive
            return []

    def watch_nodes(self, *, count: int | None = None, gone: str | None = None,
                    timeout_s: float = START_TIMEOUT_S) -> NodeWatch:  # fmt: skip
        """A process on the head that connects once and asks the GCS every 0.2 s, until
        `count` nodes are alive or no alive node has the address `gone`: the moment it sees it,
        to a fifth of a second (a process per poll takes seconds to connect on 2 cores)."""
        want = json.dumps({"count": count, "gone": gone})
        argv = [sys.executable, "-c", WATCH_NODES, want, str(timeout_s)]
        env = {**_base_env(), **self.node_env(self.nodes["head"]),
               "RAY_ADDRESS": f"{HEAD_IP}:{PORTS['gcs']}"}  # fmt: skip
        proc = subprocess.Popen(self.in_pod(self.nodes["head"], argv), env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        return NodeWatch(proc, timeout_s)

    def wait_nodes(self, count: int, timeout_s: float = START_TIMEOUT_S) -> float:
        """Until `count` nodes are alive; the time.time() it saw them."""
        seen = self.watch_nodes(count=count, timeout_s=timeout_s).result()
        if seen["alive"] != count:
            raise RuntimeError(
                f"{seen['alive']} of {count} Ray nodes alive after {timeout_s:.0f} s; "
                f"see {self.root / 'logs'}"
            )
        return seen["at"]

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
            _wait(lambda: self._http_ok("head", f"http://{HEAD_IP}:{PORTS['dashboard']}/"),
                  "the Ray head", self.log("ray-head.log"))  # fmt: skip
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


WATCH_NODES = """
import json, sys, time
import ray
want, timeout_s = json.loads(sys.argv[1]), float(sys.argv[2])
ray.init(log_to_driver=False)
print("watching", flush=True)
deadline = time.monotonic() + timeout_s
while True:
    alive = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    done = len(alive) == want["count"] if want["count"] is not None else want["gone"] not in alive
    if done or time.monotonic() > deadline:
        print(json.dumps({"at": time.time(), "alive": len(alive), "addresses": alive}))
        break
    time.sleep(0.2)
"""


class NodeWatch:
    """`Box.watch_nodes`' process: `ready()` once it is connected (start it before the event it
    times), `result()` what it saw: {"at": time.time(), "alive": n, "addresses": [...]}."""

    def __init__(self, proc: subprocess.Popen, timeout_s: float):
        self.proc, self.timeout_s = proc, timeout_s

    def ready(self) -> NodeWatch:
        line = self.proc.stdout.readline().strip()
        if line != "watching":
            self.proc.kill()
            raise RuntimeError(
                f"the node watch could not connect: {self.proc.stderr.read()[-1500:]}"
            )
        return self

    def result(self) -> dict:
        out, err = self.proc.communicate(timeout=self.timeout_s + 120)
        if self.proc.returncode != 0:
            raise RuntimeError(f"the node watch failed: {err[-1500:]}")
        return last_json(out, dict)


def teardown(prefix: str = PREFIX) -> None:
    """Remove whatever a box left on this machine (by the names it uses)."""
    killed: set[int] = set()
    for netns in leftovers(prefix):
        for _ in range(3):
            out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
            pids = [int(p) for p in out.stdout.split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.update(pids)
            time.sleep(0.5)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
    for name in links(prefix):
        subprocess.run(["ip", "link", "del", name], capture_output=True)
    # A killed process leaves its namespaces (and `ip netns pids`) first and exits a little
    # later (its memory unmapped, its files closed): wait for that, so that `down` returning
    # means nothing of the box runs.
    deadline = time.monotonic() + 30
    while any(running(pid) for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.2)


def last_json(text: str, kind: type = object):
    """The last line of `text` that is JSON of type `kind` (Ray or a library may print after
    it); AssertionError when there is none."""
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, kind):
            return value
    raise AssertionError(f"no JSON line in: {text[-1000:]!r}")


def running(pid: int) -> bool:
    """Whether process `pid` runs (exists, and is not a zombie waiting for its parent to read
    its exit status: it holds no namespace, mount or memory any more)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def own_names(prefix: str = PREFIX) -> set[str]:
    """The names a box with this prefix gives its network namespaces and host links, and only
    those: another namespace that merely starts with the prefix (another test's, a user's) is
    not the box's to remove."""
    return {f"{prefix}-{name}" for name in ("head", *WORKERS, "client", "probe", "br")}


def leftovers(prefix: str = PREFIX) -> list[str]:
    """The network namespaces of a box with this prefix that are still there."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [n for n in (line.split()[0] for line in out.splitlines()) if n in own_names(prefix)]


def links(prefix: str = PREFIX) -> list[str]:
    """The links of a box with this prefix that are still there."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]
    return [n for n in names if n in own_names(prefix)]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _unprivileged() -> tuple[str, dict]:
    """The user PostgreSQL runs as (it refuses root): its name, and Popen's arguments."""
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return name, {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    raise SystemExit("error: no unprivileged user (postgres, nobody) to run PostgreSQL as")


def _base_env() -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "VIRTUAL_ENV")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


def _wait(ready, what: str, log: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no log)"
            raise RuntimeError(f"{what} did not start within {timeout_s:.0f} s: {tail}")
        time.sleep(0.5)


def q(path) -> str:
    return shlex.quote(str(path))


def _urlopen_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "client", "node"])
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    parser.add_argument("--root", default="/var/tmp/hlm-box", help="the box's folder")
    args = parser.parse_args(argv)
    root = Path(args.root)
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
        rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        done = box.client(rest) if args.command == "client" else box.run(rest[0], rest[1:])
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr)
        return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
