"""`hlm serve`: the completions server from the command line (what `serve run deploy/serve.yaml`
does from a config file).

    hlm serve --model models:/hlm-tiny-generator/1                 # http://127.0.0.1:8000/v1
    hlm serve --model runs/tiny-gen --port 8001 --replicas 2 --max-batch-size 32
    python -m hlm_ray.serve.cli --model runs/tiny-gen              # the same, without the hlm CLI

It blocks like `serve run`: Ctrl-C shuts the application and the local Ray instance down. With
`RAY_ADDRESS` set (or `--address`) it deploys onto that cluster instead of starting one.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from typing import Any

from hlm_ray.errors import HLMError


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
    p.add_argument("--name", help="id to serve the model under (default: NAME/VERSION or run name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--replicas", type=int, default=1, help="replicas of the model (default 1)")
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica (default 1)")
    p.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per replica (default 0)")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto (default auto)")
    p.add_argument(
        "--max-batch-size", type=int, default=16, help="rows decoded together (default 16)"
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
        help="serve a headless decoder that was never fine-tuned, with its raw Eᵀ head",
    )
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
        "--keep-alive-timeout-s",
        type=int,
        default=5,
        help="idle keep-alive connections are closed after this (default 5)",
    )
    p.add_argument(
        "--decode-process",
        action="store_true",
        help="decode in a child process of each replica: HTTP and decoding stop sharing one "
        "Python lock (faster with small models and many clients)",
    )
    p.add_argument(
        "--direct-port",
        type=int,
        help="also answer on this port (and the next ones, one per replica) straight from the "
        "replicas, without the proxy hop (Ray Serve's direct ingress, set with "
        "RAY_SERVE_THROUGHPUT_OPTIMIZED=1; replica logs then go to files only); local Ray only",
    )
    p.add_argument("--address", help="Ray cluster to deploy onto (default: $RAY_ADDRESS or local)")


def direct_ingress_env(port: int, replicas: int) -> dict[str, str]:
    """Ray Serve's throughput settings (read by its controller and replicas as they start):
    each ingress replica also serves HTTP itself on a port of [port, port + replicas), the
    user code runs on the replica's own event loop, and replica logs are buffered to files."""
    return {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + replicas),  # exclusive
    }


def run(args: argparse.Namespace) -> int:
    """Deploy, print where, block until Ctrl-C, shut down. Bad options raise HLMError before
    Ray starts."""
    from pydantic import ValidationError

    from hlm_ray.serve.app import make_app, model_name
    from hlm_ray.serve.guard import guard_controller_options
    from hlm_ray.serve.schemas import AppArgs

    try:
        app_args = AppArgs(
            model=args.model,
            name=args.name,
            device=args.device,
            allow_raw_head=args.allow_raw_head,
            max_batch_size=args.max_batch_size,
            request_timeout_s=args.request_timeout_s,
            api_key=args.api_key or None,
            body_timeout_s=args.body_timeout_s,
            decode_process=args.decode_process,
        )
    except ValidationError as err:
        first = err.errors()[0]
        raise HLMError(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None
    if args.replicas < 1:
        raise HLMError(f"--replicas={args.replicas} must be >= 1")
    app = make_app(
        app_args,
        num_replicas=args.replicas,
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus or None,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
    )
    local = not (args.address or os.environ.get("RAY_ADDRESS"))
    if local:  # a local Ray starts the proxy
        _check_port_free(args.host, args.port)
    if args.direct_port is not None:
        if not local:
            raise HLMError(
                "--direct-port needs a Ray that starts here: on a cluster, start it with "
                "RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (deploy/README.md)"
            )
        for port in range(args.direct_port, args.direct_port + args.replicas):
            _check_port_free(args.host, port, "--direct-port")
        os.environ.update(direct_ingress_env(args.direct_port, args.replicas))

    import ray
    from ray import serve

    ray.init(address=args.address, log_to_driver=False)
    try:
        serve.start(
            http_options={
                "host": args.host,
                "port": args.port,
                "keep_alive_timeout_s": args.keep_alive_timeout_s,
            },
            # The proxy's guard: bodies read there, under a deadline (hlm_ray.serve.guard).
            controller_options=guard_controller_options(
                body_timeout_s=args.body_timeout_s, max_body_bytes=app_args.max_body_bytes
            ),
        )
        try:
            serve.run(app, name="hlm", route_prefix="/")
        except RuntimeError as err:
            raise HLMError(f"the application failed to start: {_last_line(err)}") from None
        _interrupt_on_signals()
        if args.direct_port is not None:
            last = args.direct_port + args.replicas - 1
            ports = str(args.direct_port) + (f"-{last}" if last > args.direct_port else "")
            print(f"replicas answer directly at http://{args.host}:{ports}/v1", flush=True)
        print(
            f"serving {model_name(app_args)} at http://{args.host}:{args.port}/v1 "
            "(POST /v1/completions, /v1/chat/completions, GET /v1/models, GET /healthz), "
            f"{'API key required' if app_args.api_key else 'no API key'}; Ctrl-C to stop",
            flush=True,
        )
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            print("shutting down", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM (a container stopping) shut the server down cleanly, even when the
    process was started with SIGINT ignored (a background job)."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)


def _check_port_free(host: str, port: int, flag: str = "--port") -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as err:
            raise HLMError(
                f"cannot listen on {host}:{port} ({err.strerror}); pass another {flag}"
            ) from None


def _last_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlm_ray.serve.cli")
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except HLMError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
