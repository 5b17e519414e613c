"""An S3 API on loopback for the tests that put run storage, prepared folders or mirrors in an
object store: moto's server (the dev extra's `moto[server]`), a real HTTP S3 endpoint that
pyarrow's `S3FileSystem` talks to as to S3 or MinIO. Mocked is only what AWS itself would be;
the protocol, the client and the failure modes (no folder renames) are the real ones.

    def test_x(s3):            # the fixture: a bucket, its URI prefix, the endpoint in the env
        uri = f"{s3}/runs"      # s3://hlm-test-<n>/runs
"""

from __future__ import annotations

import itertools

import pytest

from hlm_ray.tracking.server import free_port

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1, for the session; skipped without moto."""
    server_mod = pytest.importorskip("moto.server", reason="moto[server] (the dev extra)")
    port = free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch) -> str:
    """A new bucket on the session's S3 server; its `s3://` prefix. The endpoint and the
    credentials are in this process's environment, as a cluster's pods have them."""
    import boto3

    for key, value in {**S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(key, value)
    bucket = f"hlm-test-{next(_buckets)}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}"
