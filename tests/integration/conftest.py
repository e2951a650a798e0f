"""Servers the integration tests start for real on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tests.integration.helpers import free_port, prefect_flow_runs, running_prefect_server


@pytest.fixture(scope="session")
def session_prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One `prefect server start` for the integration tests of this session (of this pytest-xdist
    worker), as on a team's machine."""
    with running_prefect_server(tmp_path_factory.mktemp("prefect-api")) as url:
        yield url


@pytest.fixture(autouse=True)
def prefect_api(session_prefect_api: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """PREFECT_API_URL names the session's server to the test and every process it starts: a
    `forgeline` command without one starts Prefect's temporary server (and migrates a fresh
    database), ~12 s of CPU each, for some sixty commands a CI run. Tests of the temporary server
    itself use `temporary_prefect_api`; of an API that goes away, their own server."""
    monkeypatch.setenv("PREFECT_API_URL", session_prefect_api)
    return session_prefect_api


@pytest.fixture
def temporary_prefect_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PREFECT_API_URL: each `forgeline` command starts Prefect's temporary API, as on a
    machine with no server (`make run`)."""
    monkeypatch.delenv("PREFECT_API_URL")


@pytest.fixture
def flow_runs() -> Callable[[Path], list[dict]]:
    """`prefect_flow_runs` of the flow runs this test made: the session's server holds others'."""
    since = datetime.now(UTC)
    return lambda workdir: prefect_flow_runs(workdir, since)


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


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict]]]:
    """A webhook receiver on 127.0.0.1: its URL and the JSON bodies posted to it."""
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hook", received
    finally:
        server.shutdown()


def make_bucket(name: str) -> None:
    boto3.client("s3").create_bucket(Bucket=name)
