"""The cluster box's nodes: each a network namespace on the box's bridge (its own address), a pod
around it (its own mount and PID namespaces: a private /tmp and HOME, a copy-on-write view of
the checkout, the shared volume), and Ray started in it. Also what a fault does to a node (its
link down, one port's answers dropped), how the head sees them (a watch on the GCS), and the
removal of whatever a killed box left behind.

`Nodes` is a part of `box.Box`: its methods use the box's folder, prefix, nodes and processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
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


@dataclass
class Node:
    name: str
    ip: str
    netns: str
    veth: str  # the host end of its link: down = the node cut off
    cpus: int = 0
    pod: int = 0  # the process holding its namespaces (`start_pod`)


class Nodes:
    """The nodes of a `box.Box`: their network, pods and Ray."""

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
        self.kill_ray(name)
        self.start_ray(name)
        if wait:
            self.wait_nodes(nodes)

    def kill_ray(self, name: str) -> list[int]:
        """Every process in node `name`'s pod SIGKILLed (Ray's, and the jobs' drivers on the
        head), the pod itself kept; the head's services, outside its pod, stay. The pids."""
        node = self.nodes[name]
        pids = [pid for pid in self.pod_pids(name) if pid != node.pod]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def pod_pids(self, name: str) -> list[int]:
        """The processes in node `name`'s pod (its PID namespace)."""
        own = _pid_namespace(self.nodes[name].pod)
        return [pid for pid in self.pids(name) if _pid_namespace(pid) == own]

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
        mounts = pod_mounts(node.name, self.root / "hosts", self.shared, Path(self.data_dir),
                            private)  # fmt: skip
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

    def pids(self, name: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.nodes[name].netns],
                             capture_output=True, text=True).stdout  # fmt: skip
        return [int(p) for p in out.split()]

    # ------------------------------------------------------------------ Ray

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

    def wait_head(self) -> None:
        """Until the head's Ray answers (its dashboard, the Job API)."""
        from services import wait_until

        head = f"http://{HEAD_IP}:{PORTS['dashboard']}/"
        wait_until(lambda: self._http_ok("head", head), "the Ray head", self.log("ray-head.log"))

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
        env = {**base_env(), **self.node_env(self.nodes["head"]),
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


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:  # gone meanwhile
        return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def pod_mounts(node: str, hosts: Path, shared: Path, data: Path, private: Path,
               checkout: Path = CHECKOUT, keep: tuple[Path, ...] | None = None) -> list[str]:  # fmt: skip
    """The mounts of node `node`'s pod, in order: its /etc/hosts (`hosts`), the shared volume
    (`shared`, the data folder `data` in it, read-only) at /mnt/shared, the checkout as a
    copy-on-write view (its changes in `private`), the machine's data folder hidden, and a
    private /tmp and ~/.cache. A checkout or interpreter (`keep`: the virtualenv's and the
    Python's prefixes) under /tmp or ~/.cache would be hidden by those: each is first mounted
    aside in the pod's own /mnt, and after them at its own path again, so the box runs from a
    checkout and a virtualenv anywhere but /mnt (`missing` says so)."""
    keep = tuple(Path(p) for p in (keep if keep is not None else (sys.prefix, sys.base_prefix)))
    hidden = [Path("/tmp"), *([cache] if (cache := Path.home() / ".cache").is_dir() else [])]
    kept = [p for p in dict.fromkeys(keep) if any(p.is_relative_to(h) for h in hidden)]
    aside = "/mnt/.pod"
    mounts = [
        "mount --make-rprivate /",
        f"mount --bind {q(hosts)} /etc/hosts",
        f"mount -t tmpfs -o size=64m tmpfs /mnt && mkdir -p {SHARED} {aside}/checkout",
        f"mount --bind {q(shared)} {SHARED}",
        f"mount --bind -o ro {q(data)} {SHARED}/data",
        f"mount -t overlay overlay -o lowerdir={q(checkout)},upperdir={q(private / 'upper')},"
        f"workdir={q(private / 'work')} {aside}/checkout",
        *(f"mkdir -p {aside}/{i} && mount --bind {q(p)} {aside}/{i}" for i, p in enumerate(kept)),
        f"mount -t tmpfs -o size=1m tmpfs {q(data)}",  # the machine's own copy: hidden
        "mount -t tmpfs -o size=6g tmpfs /tmp",
        f"mkdir -p /tmp/home-{node}",
        # A program that reads ~ from passwd finds an empty cache.
        *(f"mount -t tmpfs -o size=1m tmpfs {q(h)}" for h in hidden[1:]),
    ]
    back = [(checkout, f"{aside}/checkout"), *((p, f"{aside}/{i}") for i, p in enumerate(kept))]
    for path, held in sorted(back, key=lambda b: len(b[0].parts)):  # outer folders first
        mounts.append(f"mkdir -p {q(path)} && mount --bind {held} {q(path)}")
    return mounts


def base_env() -> dict[str, str]:
    """What every process the box starts inherits: the project's virtualenv first on PATH."""
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "VIRTUAL_ENV")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


def q(path) -> str:
    return shlex.quote(str(path))
