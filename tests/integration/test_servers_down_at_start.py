"""A server the command needs is down, or hangs, when `forgeline` starts: one sentence naming
its URL and what to do, exit 2 before any work, nothing written."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.helpers import VENV_BIN, free_port, user_env

pytestmark = pytest.mark.integration


@pytest.fixture
def hanging_server() -> Iterator[str]:
    """A port that takes connections and never answers."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def forgeline_run(workdir: Path, *args: str,
                  env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([str(VENV_BIN / "forgeline"), "run", "--config", "debug.yaml", *args], cwd=workdir,
                          env=user_env(workdir) | (env or {}), capture_output=True, text=True, timeout=300)
    return done, time.monotonic() - started


def test_a_tracking_server_that_is_down_is_named_with_what_to_do(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done, took = forgeline_run(tmp_path, "--set", f"registry.tracking_uri={url}")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"forgeline: the MLflow tracking server at {url} does not answer (no connection): start it (`mlflow "
        "server`), or point registry.tracking_uri at one that runs; with neither set, runs go to the local "
        "store sqlite:///mlflow.db"]
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "mlflow.db").exists()
    assert took < 60  # before Prefect's temporary API starts (~15 s on its own)


def test_a_tracking_server_that_hangs_is_named_after_five_seconds(tmp_path: Path,
                                                                  hanging_server: str) -> None:
    done, _ = forgeline_run(tmp_path, env={"MLFLOW_TRACKING_URI": hanging_server})
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        f"forgeline: the MLflow tracking server at {hanging_server} does not answer (no answer within 5 s): "
        "start it (`mlflow server`), or point $MLFLOW_TRACKING_URI at one that runs")
    assert not (tmp_path / "artifacts").exists()


def test_a_prefect_api_that_is_down_is_named_with_what_to_do(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/api"
    done, _ = forgeline_run(tmp_path, env={"PREFECT_API_URL": url})
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"forgeline: the Prefect API at {url} does not answer (no connection): start it (`prefect server "
        "start`), or unset PREFECT_API_URL to run on a temporary local API that the command starts and "
        "stops itself"]
    assert not (tmp_path / "artifacts").exists()
