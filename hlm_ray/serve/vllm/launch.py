"""`hlm serve --engine vllm`: the vLLM application on a Ray started here (or `--address`),
through Serve's proxy and its guard, until Ctrl-C; what `hlm_ray.serve.cli.run` hands over to.

The proxy, not the replicas, answers HTTP (no direct ingress: the ingress replica's own port
would skip the proxy's guard, which reads and bounds every body). Bad flags and bad models are
refused in one line before Ray starts, as for the in-house engine.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os

from hlm_ray.errors import HLMError


def vllm_args(args: argparse.Namespace):
    """`VllmArgs` from the command line; a bad value names its flag."""
    from pydantic import ValidationError

    from hlm_ray.serve.vllm.app import VllmArgs

    given = {
        "model": args.model,
        "name": args.name,
        "readout": args.readout,
        "allow_raw_head": args.allow_raw_head,
        "dtype": args.dtype or "auto",
        "num_cpus": args.num_cpus or 1.0,
        "num_gpus": args.num_gpus,
        "max_model_len": args.max_model_len,
        "kv_cache_gib": args.kv_cache_gib or 1.0,
        "enforce_eager": args.enforce_eager,
        "api_key": args.api_key or None,
    }
    try:
        return VllmArgs(**given)
    except ValidationError as err:
        first = err.errors()[0]
        raise HLMError(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None


def run(args: argparse.Namespace) -> int:
    """Deploy the vLLM application, print where, block until Ctrl-C, shut down."""
    from hlm_ray.serve import running
    from hlm_ray.serve.launch import Ports

    config = vllm_args(args)
    limits = running.connection_limits(args)
    from hlm_ray.serve.vllm.app import check_model, make_app, model_name

    check_model(config)  # a wrong model is refused before Ray starts
    cluster = args.address or os.environ.get("RAY_ADDRESS")
    if cluster == "local":
        cluster = None
    ports = (
        Ports(args.host, args.port, args.port, args.replicas, direct=False)
        if cluster
        else Ports.plan(args.host, args.port, replicas=args.replicas, direct=False)
    )

    def app():  # once Ray runs: Ray Serve LLM's builder would start one of Ray's defaults
        with _quiet("ray.serve.ray.llm"):  # its deployment options, pretty-printed at INFO
            return make_app(
                config,
                num_replicas=args.replicas,
                max_ongoing_requests=args.max_ongoing_requests,
                max_queued_requests=args.max_queued_requests,
                niceness=args.niceness,
            )

    key = "API key required" if args.api_key else "no API key"
    routes = "POST /v1/completions, /v1/chat/completions, GET /v1/models"
    banner = (
        f"serving {model_name(config)} on vLLM (Ray Serve LLM) {ports.describe()}; {key}; "
        f"{routes}; Ctrl-C to stop"
    )
    guard = {"body_timeout_s": args.body_timeout_s, **limits}
    # The key also reaches the proxy's /-/ routes; the ingress has it in VllmArgs.
    return running.serve_until_interrupted(
        app, ports, args, guard=guard, api_key=args.api_key, banner=banner,
        loaded="vLLM engine",
    )  # fmt: skip


@contextlib.contextmanager
def _quiet(prefix: str):
    """The loggers named `prefix...` at WARNING while the block runs (Ray Serve LLM gives each
    of its modules a logger of its own, at INFO, that does not propagate)."""
    import ray.serve.llm  # noqa: F401  (its modules' loggers exist once it is imported)

    names = [n for n in logging.root.manager.loggerDict if n.startswith(prefix)]
    loggers = [logging.getLogger(n) for n in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
