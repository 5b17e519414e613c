"""What the serving tests share: one tiny decoder registered in MLflow and one Serve application
serving it over real HTTP for the whole session (`tests/conftest.py` registers these fixtures),
so test_serve.py and test_serve_api.py start Serve once between them."""

from __future__ import annotations

import socket

import pytest
import requests

MODEL_NAME = "hlm-test-generator"
API_KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY_TIMEOUT_S = 8.0  # the proxy's guard: a body not received within this is answered 408


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(server: str, body, path: str = "/v1/completions", **kwargs) -> requests.Response:
    kwargs["headers"] = {**AUTH, **kwargs.get("headers", {})}
    if isinstance(body, bytes | str):
        return requests.post(f"{server}{path}", data=body, timeout=60, **kwargs)
    return requests.post(f"{server}{path}", json=body, timeout=60, **kwargs)


@pytest.fixture(scope="session")
def serve_model_dir(tmp_path_factory) -> str:
    """The tiny decoder of `tiny_decoder_dir`, built once for the session's server."""
    from conftest import make_tiny_decoder

    return make_tiny_decoder(tmp_path_factory.mktemp("serve_decoder"))


@pytest.fixture(scope="session")
def serve_model_uri(serve_model_dir) -> str:
    """The tiny decoder registered in the session's MLflow store."""
    from hlm_ray.tracking import register_model

    name, version = register_model(serve_model_dir, MODEL_NAME)
    return f"models:/{name}/{version}"


@pytest.fixture(scope="session")
def serve_app(ray_cluster, serve_model_uri):
    """The application under test at http://127.0.0.1:<port>, serving `models:/...`."""
    from ray import serve

    from hlm_ray.serve.app import make_app
    from hlm_ray.serve.guard import guard_controller_options
    from hlm_ray.serve.schemas import AppArgs

    port = free_port()
    serve.start(
        http_options={"host": "127.0.0.1", "port": port},
        controller_options=guard_controller_options(body_timeout_s=BODY_TIMEOUT_S),
    )
    args = AppArgs(
        model=serve_model_uri,
        max_batch_size=16,
        batch_wait_timeout_s=0.05,
        max_n=3,
        api_key=API_KEY,
        # The tests run through the replica's decode process (`--decode-process`); the
        # overload test's app (test_serve.py) decodes on the replica's thread.
        decode_process=True,
    )
    try:
        serve.run(make_app(args, num_cpus=0.5), name="hlm-test", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
