"""Servers the integration tests start for real on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest
from moto.server import ThreadedMotoServer

from tests.integration.helpers import VENV_BIN, user_env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = open(tmp_path / "prefect-server.log", "w")
    server = subprocess.Popen(
        [str(VENV_BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port),
         "--no-ui", "--analytics-off"],
        env=user_env(tmp_path), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert server.poll() is None, (tmp_path / "prefect-server.log").read_text()
        assert time.monotonic() < deadline, "prefect server did not become healthy"
        time.sleep(1)
    try:
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()


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
