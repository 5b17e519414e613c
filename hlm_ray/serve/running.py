"""What `hlm serve` does around either engine's application: the connection guard's limits
from the flags, Ctrl-C and SIGTERM turned into a clean shutdown, the start-up line, and the
shutdown itself (`hlm_ray.serve.cli` for the in-house engine, `hlm_ray.serve.vllm.launch` for
vLLM).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from typing import Any

from hlm_ray.errors import HLMError


def connection_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The connection guard's limits (`connections.Limits` fields); a bad one names its flag."""
    if not 0 < args.header_timeout_s < float("inf"):
        raise HLMError(f"--header-timeout-s={args.header_timeout_s:g} must be a number > 0")
    if args.max_connections < 1:
        raise HLMError(f"--max-connections={args.max_connections} must be >= 1")
    if args.max_connections_per_client < 0:
        raise HLMError(
            f"--max-connections-per-client={args.max_connections_per_client} must be >= 0 "
            "(0: no per-client limit)"
        )
    return {
        "header_timeout_s": args.header_timeout_s,
        "max_connections": args.max_connections,
        "per_client": args.max_connections_per_client,
    }


def interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM (a container stopping) shut the server down cleanly, even when the
    process was started with SIGINT ignored (a background job)."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)


def startup_line(
    checked: float, phases: dict[str, float], loaded: str = "model and decode process"
) -> str:
    """Where the start-up went: the command's imports and the model check (since the process
    started), then `launch.start`'s phases; `loaded`: what a replica loads."""
    import psutil

    before = checked - time.perf_counter() + time.time() - psutil.Process().create_time()
    total = before + sum(phases.values())
    return (
        f"ready {total:.0f} s after the command started: imports and the model check "
        f"{before:.0f} s, Ray {phases['ray']:.0f} s, Serve's controller and proxy "
        f"{phases['serve']:.0f} s, the replicas ({loaded} loaded) "
        f"{phases['replicas']:.0f} s"
    )


def shut_down(stop) -> None:
    """Run `stop` (Serve's and Ray's shutdown: seconds) with Ctrl-C and SIGTERM held off: a
    second Ctrl-C meanwhile says so instead of breaking the shutdown off with a 35-line
    traceback and Ray half stopped; a third exits at once (status 130, without waiting for
    Ray's processes, which then stop on their own)."""
    presses = 0

    def later(signum, frame):
        nonlocal presses
        presses += 1
        if presses > 1:
            os._exit(130)
        print("still shutting down (Ctrl-C again to exit at once)", file=sys.stderr, flush=True)

    saved = {sig: signal.signal(sig, later) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def shut_down_serve(serve, own: bool) -> None:
    """Stop the application, its replicas answering what they hold (Serve's graceful stop).
    On a Ray of this command's own, Serve's controller and proxy then go with the cluster:
    `serve.shutdown()` asks the controller to stop itself, which it does with `ray.kill`, and
    the task that asked was reported on the console as failed and "will be retried"."""
    if not own:
        serve.shutdown()
        return
    with contextlib.suppress(Exception):  # an application that never deployed
        serve.delete("hlm")


def serve_until_interrupted(
    app: Any,
    ports: Any,
    args: argparse.Namespace,
    *,
    guard: dict[str, Any],
    api_key: str | None,
    banner: str,
    loaded: str = "model and decode process",
) -> int:
    """`hlm serve`'s life, either engine: start `app` on `ports` (`launch.start`, on `--address`
    or a Ray started here), print `banner` and where the start-up went, block until Ctrl-C or
    SIGTERM, then delete the application and stop the Ray started here. `api_key` goes to the
    environment the Ray started here inherits: the guard's /-/ routes need it."""
    import ray
    from ray import serve

    from hlm_ray.local_ray import starts_local
    from hlm_ray.serve.launch import start

    own = not ray.is_initialized() and starts_local(args.address)  # a Ray that starts here
    try:
        # A stop that comes while Serve starts (the app may already answer) shuts down too:
        # `start` keeps these handlers across ray.init, which installs Ray's.
        interrupt_on_signals()
        if api_key:
            from hlm_ray.serve.guard import API_KEY_ENV

            os.environ[API_KEY_ENV] = api_key
        checked = time.perf_counter()
        phases = start(
            app, ports, guard=guard, ray={"address": args.address},
            keep_alive_s=args.keep_alive_timeout_s,
        )  # fmt: skip
        print(banner, flush=True)
        print(startup_line(checked, phases, loaded), flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("shutting down", flush=True)
    finally:
        if ray.is_initialized():
            shut_down(lambda: (shut_down_serve(serve, own), ray.shutdown()))
    return 0
