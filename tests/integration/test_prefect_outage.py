"""The Prefect API killed mid-flow: `forgeline stage train` on pp2 x dp2 against a real `prefect
server start`, the server SIGKILLed while the ranks train. The training goes on and commits its
last checkpoint, the command ends soon after with exit 0 and a one-paragraph warning (no
traceback), and the flow run stays Running in the server's database; restarted on the same port
and database, `forgeline sync` reports the flow run and its task run Completed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from forgeline.configs import load_config
from forgeline.model.checkpoint.manager import committed_checkpoints
from tests.integration.helpers import VENV_BIN, free_port, run, serving, user_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 120
# What the command may take to end once training has ended with the API gone: the report
# artifact, the final state report and the exit's drain of Prefect's log and event queues, each
# bounded by configs/environment.py's client retries (~7 s on a refused connection).
END_WITHIN_S = 60


@contextmanager
def prefect_server(root: Path, port: int, log_name: str) -> Iterator[subprocess.Popen]:
    """`prefect server start` on 127.0.0.1:`port` with its database in `root`/.prefect: the same
    database each time it is started for the same `root`."""
    cmd = [str(VENV_BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port),
           "--no-ui", "--analytics-off"]
    with serving(cmd, user_env(root), root / log_name, f"http://127.0.0.1:{port}/api/health") as server:
        yield server


def read_lines(stream, lines: list[tuple[float, str]]) -> None:
    for line in stream:
        lines.append((time.monotonic(), line))


def test_train_finishes_without_the_prefect_api_and_sync_reports_it(data_root: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    overrides = [f"data.out_dir={data_root / 'data'}", "parallel.pp=2", "parallel.dp_shard=2",
                 f"train.steps={STEPS}", "train.peak_tflops=1"]
    cmd = [str(VENV_BIN / "forgeline"), "stage", "train", "--config", "debug.yaml",
           *[arg for override in overrides for arg in ("--set", override)]]
    env = user_env(workdir) | {"PREFECT_API_URL": api, "OMP_NUM_THREADS": "1"}
    train_dir = workdir / load_config("debug.yaml", overrides).train.out_dir  # the run's directory
    checkpoints = train_dir / "checkpoints"
    lines: list[tuple[float, str]] = []

    with prefect_server(tmp_path, port, "prefect-server-1.log") as server:
        stage = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
        reader = threading.Thread(target=read_lines, args=(stage.stdout, lines), daemon=True)
        reader.start()
        deadline = time.monotonic() + 600
        while not any(re.search(r"step \d+/", line) for _, line in lines):  # training is under way
            assert stage.poll() is None, "".join(line for _, line in lines)[-6000:]
            assert time.monotonic() < deadline, "no training progress in 600 s"
            time.sleep(0.2)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
        killed_at = time.monotonic()

    final = checkpoints / f"step-{STEPS:08d}"
    trained_at = None
    while stage.poll() is None:
        if trained_at is None and final.is_dir():
            trained_at = time.monotonic()
        assert time.monotonic() < killed_at + 600, "the command did not end"
        time.sleep(0.2)
    ended_at = time.monotonic()
    reader.join(timeout=10)
    output = "".join(line for _, line in lines)
    (tmp_path / "stage.log").write_text("".join(f"{at - killed_at:8.1f} {line}" for at, line in lines))
    trained_at = trained_at or ended_at
    print(f"training ended {trained_at - killed_at:.1f} s after the API was killed; the command ended "
          f"{ended_at - trained_at:.1f} s after training")

    assert stage.returncode == 0, output[-6000:]
    assert ended_at - trained_at < END_WITHIN_S, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    assert "forgeline: warning: train finished: its outputs and stage record are written" in output
    assert "`forgeline sync`" in output
    assert [info.step for info in committed_checkpoints(checkpoints)][0] == STEPS
    assert (train_dir / "train.json").is_file()
    [record] = (workdir / ".forgeline" / "pending").glob("*.json")
    flow_run_id = record.stem

    with prefect_server(tmp_path, port, "prefect-server-2.log"):
        flow_run = httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=30).json()
        assert flow_run["state"]["type"] == "RUNNING"  # what the server knew when it was killed

        done = run([str(VENV_BIN / "forgeline"), "sync"], workdir, env={"PREFECT_API_URL": api})
        assert f"flow run {flow_run_id} (forgeline-train" in done.stdout
        assert "task run train set COMPLETED; flow run set COMPLETED" in done.stdout
        assert not (workdir / ".forgeline").exists()

        flow_run = httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=30).json()
        assert flow_run["state"]["type"] == "COMPLETED"
        task_runs = httpx.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run_id]}}},
                               timeout=30).json()
        assert [(t["name"].split(" ")[0], t["state"]["type"]) for t in task_runs] == [("train", "COMPLETED")]

        again = run([str(VENV_BIN / "forgeline"), "sync"], workdir, env={"PREFECT_API_URL": api})
        assert "none pending" in again.stdout
