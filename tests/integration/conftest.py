"""Servers the integration tests start for real on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tests.integration.helpers import free_port, running_prefect_server


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[str]:
    with running_prefect_server(tmp_path) as url:
        yield url


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real S3-compatible server (moto) on 127.0.0.1; the AWS variables that reach it are set
    for this process and the processes it starts."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(key, value)
    try:
        yield endpoint
    finally:
        server.stop()


def make_bucket(name: str) -> None:
    boto3.client("s3").create_bucket(Bucket=name)
