"""A tracking server outage never costs a training run: a real `mlflow server` killed with SIGKILL
while a pp2 x dp2 train stage runs. The ranks train on, their metrics wait in the tracking spool
(model/spool.py), and reach the run exactly once -- when the server is back during the run, or
with `forgeline sync` after a run that ended while it was down."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from forgeline.configs import load_config
from forgeline.model.spool import unsent
from forgeline.tasks.runner import STAGE_TAG
from tests.conftest import REPO_ROOT
from tests.integration.helpers import VENV_BIN, free_port, run, serving, user_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 160


@contextmanager
def mlflow_server(root: Path, port: int) -> Iterator[subprocess.Popen]:
    """`mlflow server` on 127.0.0.1:`port`, its runs and artifacts under `root` (kept across
    restarts)."""
    cmd = [str(VENV_BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
           str(root / "artifacts"), "--workers", "1"]
    with serving(cmd, user_env(root), root / f"mlflow-{time.monotonic_ns()}.log",
                 f"http://127.0.0.1:{port}/health") as server:
        yield server


def kill(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=30)


def start_train(workdir: Path, data_root: Path, port: int, callbacks: list[dict]) -> subprocess.Popen:
    settings = [f"data.out_dir={data_root / 'data'}", "parallel.pp=2", "parallel.dp_shard=2",
                f"train.steps={STEPS}", "train.max_restarts=0", "train.job_retries=0", "train.peak_tflops=1",
                f"registry.tracking_uri=http://127.0.0.1:{port}",
                "train.callbacks=" + yaml.safe_dump(callbacks, default_flow_style=True, width=10**6).strip()]
    cmd = [str(VENV_BIN / "forgeline"), "stage", "train", "--config", "debug.yaml"]
    cmd += [arg for setting in settings for arg in ("--set", setting)]
    env = user_env(workdir) | {"PYTHONPATH": str(REPO_ROOT)}  # the ranks import tests.faults
    return subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def read_until(stage: subprocess.Popen, pattern: str, seen: list[str]) -> None:
    """Lines of the stage's output into `seen` up to the first that matches `pattern`."""
    for line in stage.stdout:
        seen.append(line)
        if re.search(pattern, line):
            return
    raise AssertionError(f"the stage ended before {pattern!r}:\n{''.join(seen)[-6000:]}")


def train_run(port: int):
    client = MlflowClient(f"http://127.0.0.1:{port}")
    [found] = client.search_runs([client.get_experiment_by_name("forgeline-debug").experiment_id],
                                 filter_string=f"tags.`{STAGE_TAG}` = 'train'")
    return client, found


def assert_every_step_once(port: int) -> None:
    client, found = train_run(port)
    history = client.get_metric_history(found.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))  # each step, exactly once
    assert found.info.status == "FINISHED"
    assert found.data.tags["forgeline.attempts"] == "1"
    assert found.data.metrics["train/worker_failures"] == 0  # no in-job restart either


def test_server_killed_mid_run_and_back_before_it_ends(data_root: Path, tmp_path: Path) -> None:
    """The ranks wait for the test's cues, so that each phase happens in order whatever the
    machine's speed: after step 10 until the server is killed, after step 30 until rank 0 has
    found it down (steps 31-60 then train with it down), after step 60 until it is back."""
    port, server_root = free_port(), tmp_path / "server"
    server_root.mkdir()
    cues = {step: tmp_path / name for step, name in ((11, "killed"), (31, "found-down"), (61, "back"))}
    waits = [{"path": "tests.faults:WaitBefore", "args": {"step": step, "until": str(cue)}}
             for step, cue in cues.items()]
    with mlflow_server(server_root, port) as server:
        stage = start_train(tmp_path, data_root, port, waits)
        seen: list[str] = []
        read_until(stage, rf"step 10/{STEPS}", seen)
        kill(server)
    cues[11].touch()
    read_until(stage, r"\[rank0\].*tracking store .* does not answer", seen)
    cues[31].touch()
    read_until(stage, rf"step 60/{STEPS}.*\(tracking store down: \d+ write\(s\) pending\)", seen)
    with mlflow_server(server_root, port):
        cues[61].touch()
        read_until(stage, r"answers again", seen)
        output, _ = stage.communicate(timeout=600)
        assert stage.returncode == 0, "".join(seen)[-3000:] + output[-6000:]
        assert_every_step_once(port)
    assert not unsent(tmp_path / "artifacts" / "tracking-spool")


def test_server_that_never_comes_back_costs_nothing_and_sync_sends_it_all(data_root: Path,
                                                                         tmp_path: Path) -> None:
    port, server_root = free_port(), tmp_path / "server"
    server_root.mkdir()
    with mlflow_server(server_root, port) as server:
        stage = start_train(tmp_path, data_root, port, [])
        seen: list[str] = []
        read_until(stage, rf"step 10/{STEPS}", seen)
        kill(server)
    output, _ = stage.communicate(timeout=600)
    assert stage.returncode == 0, "".join(seen)[-3000:] + output[-6000:]
    spool = tmp_path / "artifacts" / "tracking-spool"
    pending = sum(unsent(spool).values())
    train_dir = load_config("debug.yaml", [f"train.steps={STEPS}"]).train.out_dir  # the run's directory
    assert pending > 0 and (tmp_path / train_dir / "train.json").is_file()

    with mlflow_server(server_root, port):
        synced = run([str(VENV_BIN / "forgeline"), "sync"], tmp_path)
        assert f"sent {pending}" in synced.stdout, synced.stdout
        assert_every_step_once(port)
    assert not unsent(spool)
