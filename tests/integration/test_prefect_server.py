"""A stage run against a real `prefect server start` named by PREFECT_API_URL (no temporary
server): the flow run and its task run are recorded by that server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.helpers import VENV_BIN, run, user_env

pytestmark = pytest.mark.integration


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


def test_stage_runs_against_the_server_in_prefect_api_url(tmp_path: Path, prefect_server: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.setenv("PREFECT_API_URL", prefect_server)
    done = run([str(VENV_BIN / "forgeline"), "stage", "data", "--config", "debug.yaml"], workdir)
    assert "Starting temporary server" not in done.stdout + done.stderr
    flow_runs = httpx.post(f"{prefect_server}/flow_runs/filter", json={}, timeout=30).json()
    [flow_run] = flow_runs
    flow = httpx.get(f"{prefect_server}/flows/{flow_run['flow_id']}", timeout=30).json()
    assert flow["name"] == "forgeline-data" and flow_run["state"]["type"] == "COMPLETED"
    task_runs = httpx.post(f"{prefect_server}/task_runs/filter",
                           json={"flow_runs": {"id": {"any_": [flow_run["id"]]}}}, timeout=30).json()
    assert [t["state"]["type"] for t in task_runs] == ["COMPLETED"]
    assert (workdir / "artifacts" / "data" / "manifest.json").is_file()
