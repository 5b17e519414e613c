"""Where the completions server answers, and starting it: what `hlm serve` and
`hlm bench --only serve` share.

    ports = Ports.plan("127.0.0.1", 8000, replicas=1, direct=True)   # checks the ports are free
    start(make_app(args), ports, guard={"body_timeout_s": 10}, ray={})  # Ray here, Serve, the app
    print(ports.describe())      # which URL is the fast one; ... then serve.shutdown()

Two ways in:
- **Direct ingress** (Ray Serve's throughput settings, `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`): each
  replica answers HTTP itself, on `port`, `port + 1`, ... (one per replica), without the hop
  through Serve's proxy; the proxy still runs, on `proxy_port`, and spreads requests over the
  replicas. Serve reads these settings as its processes start, so only a Ray that starts here
  can have them. They also run the replica's request handling on its own event loop, buffer
  its log lines and write them to files only (not to the console).
- **The proxy** (Ray Serve's default): one port, `port`, for every replica.
Either way the proxy's guard (`hlm_ray.serve.guard`) reads each body first, on every port.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hlm_ray.errors import HLMError, one_line


def direct_ingress_env(port: int, replicas: int) -> dict[str, str]:
    """Ray Serve's throughput settings (read by its controller and replicas as they start):
    each ingress replica also serves HTTP itself on a port of [port, port + replicas), the
    user code runs on the replica's own event loop, and replica logs are buffered to files."""
    return {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + replicas),  # exclusive
        # A released port is otherwise held back for minutes, and a stopping replica kept up
        # for 30 s, for a load balancer in front to notice (there is none here): a replica that
        # replaces a failed one takes its port again as soon as the kernel lets it (Serve binds
        # without SO_REUSEADDR: up to a minute after the old one's connections closed).
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


@dataclass(frozen=True)
class Ports:
    """Where a server answers: `port` is the one clients use (the first replica's own port
    with direct ingress, the proxy's without), `proxy_port` Serve's proxy."""

    host: str
    port: int
    proxy_port: int
    replicas: int
    direct: bool

    @classmethod
    def plan(
        cls, host: str, port: int, *, replicas: int, direct: bool, proxy_port: int | None = None
    ) -> Ports:
        """The layout, each port checked free (one clear error naming the flag otherwise).
        Without direct ingress the proxy listens on `port`; with it, on `proxy_port` (default:
        the port after the replicas')."""
        if proxy_port is not None and not direct:
            raise HLMError("--proxy-port needs direct ingress: without it the proxy is on --port")
        if not direct:
            check_port_free(host, port)
            return cls(host, port, port, replicas, direct=False)
        proxy = port + replicas if proxy_port is None else proxy_port
        if port <= proxy < port + replicas:
            raise HLMError(
                f"--proxy-port={proxy} is one of the replicas' ports {port}-{port + replicas - 1}"
            )
        for p in range(port, port + replicas):
            check_port_free(host, p)
        check_port_free(host, proxy, "--proxy-port")
        return cls(host, port, proxy, replicas, direct=True)

    @property
    def url(self) -> str:
        """The fast URL: where clients send their requests."""
        return f"http://{self.host}:{self.port}"

    @property
    def proxy_url(self) -> str:
        return f"http://{self.host}:{self.proxy_port}"

    def env(self) -> dict[str, str]:
        """What Ray's processes must find in their environment as they start."""
        return direct_ingress_env(self.port, self.replicas) if self.direct else {}

    def describe(self) -> str:
        """Which URL does what, for the startup line."""
        if not self.direct:
            return f"at {self.url}/v1 through Ray Serve's proxy"
        if self.replicas == 1:
            where = f"at {self.url}/v1, answered by the replica itself (direct ingress)"
        else:
            ports = f"{self.port}-{self.port + self.replicas - 1}"
            where = f"at http://{self.host}:{ports}/v1, one port per replica (direct ingress)"
        proxy = f"Serve's proxy, which spreads requests over the replicas, at {self.proxy_url}/v1"
        return f"{where}; {proxy}"


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as err:
            raise HLMError(
                f"cannot listen on {host}:{port} ({err.strerror}); pass another {flag}"
            ) from None


@contextmanager
def callers_signal_handlers() -> Iterator[None]:
    """Keep the caller's SIGINT and SIGTERM handlers across `ray.init`, which puts Ray's in
    their place: a SIGTERM while Serve was still starting then ended the driver at once and left
    Ray's dashboard and runtime-env agents running, where `hlm serve`'s handler shuts it all
    down. (Handlers belong to the main thread: elsewhere there is nothing to keep.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: not set from Python; nothing to put back
                signal.signal(sig, handler)


def start(
    app: Any, ports: Ports, *, guard: dict[str, Any], ray: dict[str, Any], keep_alive_s: int = 5
) -> dict[str, float]:
    """Start Ray with the `ray.init` options `ray` (here, unless they name an `address`), Serve
    on `ports` with the guard (`guard_controller_options(**guard)`) and idle keep-alive
    connections closed after `keep_alive_s`, and `app` as "hlm" (an application, or a function
    that builds it once Ray runs: Ray Serve LLM's builder reads Ray's runtime context, which
    started a Ray of Ray's defaults when none was running). Returns the seconds of each
    phase: "ray" (`ray.init`), "serve" (Serve's controller and proxy), "replicas" (the
    application's replicas built, their models loaded, until they are healthy).
    Raises HLMError with the last line of Serve's message when the application fails."""
    import ray as ray_
    from ray import serve

    from hlm_ray.serve.guard import guard_controller_options

    elsewhere = ray.get("address") not in (None, "local")  # "local": a new Ray here
    if ports.direct and (elsewhere or ray_.is_initialized()):
        raise HLMError(
            "direct ingress needs a Ray that starts here: on a cluster, start Ray with "
            "RAY_SERVE_THROUGHPUT_OPTIMIZED=1, or pass --no-direct-ingress"
        )
    os.environ.update(ports.env())  # inherited by the Ray processes started below
    phases, started = {}, time.perf_counter()
    if not ray_.is_initialized():  # a caller's own Ray (tests) is used as it is
        options = {"log_to_driver": False, **ray}
        from hlm_ray.local_ray import local_cluster_options, quiet_token_notice, starts_local

        if starts_local(options.get("address")):  # a cluster of this command's own
            # Its dashboard on a port of its own (another Ray on the machine may hold 8265),
            # and Ray's notice that token authentication is on kept off the console.
            options = {**local_cluster_options(), **options}
            quiet_token_notice()
        with callers_signal_handlers():
            ray_.init(**options)
    phases["ray"] = time.perf_counter() - started
    if callable(app):  # built once Ray runs (Ray Serve LLM's builder reads Ray's context)
        app = app()
    serve.start(
        http_options={
            "host": ports.host,
            "port": ports.proxy_port,
            "keep_alive_timeout_s": keep_alive_s,
        },
        # The proxy's guard: bodies read there, under a deadline (hlm_ray.serve.guard); the
        # replicas' own ports (direct ingress) install it too.
        controller_options=guard_controller_options(**guard),
    )
    phases["serve"] = time.perf_counter() - started - phases["ray"]
    try:
        with _existing_serve_quiet():
            serve.run(app, name="hlm", route_prefix="/")
    except RuntimeError as err:
        raise HLMError(f"the application failed to start: {one_line(err, last=True)}") from None
    phases["replicas"] = time.perf_counter() - started - phases["ray"] - phases["serve"]
    return phases


@contextmanager
def _existing_serve_quiet() -> Iterator[None]:
    """`serve.run` starts Serve again, finds the controller `serve.start` just made, and says
    at INFO that "New http_options/controller_options will not be applied": they were, by that
    `serve.start`. That line alone is kept off the console."""
    import logging

    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "Connecting to existing Serve app" not in record.getMessage()

    logger, drop = logging.getLogger("ray.serve"), Drop()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
