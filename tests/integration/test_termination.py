"""SIGTERM to `forgeline run` (a Kubernetes eviction, `timeout`, systemd stopping it): the run
stops in order -- the ranks save the step they are in, the temporary Prefect API server and any
local Dask cluster are stopped -- and nothing of it is left running; a rerun resumes training
from the step saved."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from forgeline.configs import load_config
from forgeline.model.checkpoint.manager import committed_checkpoints
from tests.conftest import REPO_ROOT
from tests.integration.helpers import VENV_BIN, user_env
from tests.integration.test_preemption import logged_step
from tests.integration.test_recovery import callbacks
from tests.processes import carrying, describe, still_there, stop

# Without a server, as `make run`: the command's temporary Prefect API is among what a stop ends.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("temporary_prefect_api")]

STEPS = 24
# No periodic save before the end: the step the ranks saved when stopped is the only checkpoint.
TRAIN = [f"train.steps={STEPS}", "checkpoint.every_steps=100", "train.peak_tflops=1"]
RUN_ENV = "FORGELINE_TEST_RUN"  # marks the processes of one `forgeline run`, whoever their parent


def forgeline(verb: list[str], *overrides: str) -> list[str]:
    return [str(VENV_BIN / "forgeline"), *verb, "--config", "debug.yaml",
            *sum((["--set", override] for override in overrides), [])]


def forgeline_run(*overrides: str) -> list[str]:
    return forgeline(["run"], *TRAIN, *overrides)


def assert_nothing_left(run: str) -> None:
    left = still_there(lambda: carrying(RUN_ENV, run), grace_s=10)
    assert not left, "left running after `forgeline` exited on SIGTERM:\n" + "\n".join(
        describe(process) for process in left)


def test_sigterm_stops_every_process_of_the_run_and_the_rerun_resumes(tmp_path: Path) -> None:
    run = uuid.uuid4().hex
    env = user_env(tmp_path) | {RUN_ENV: run, "PYTHONPATH": str(REPO_ROOT)}  # the ranks import tests.faults
    cue = tmp_path / "signalled"
    # Rank 0 waits before step 6 until the test has signalled: the step the ranks are in is known.
    wait = callbacks(("WaitBefore", {"step": 6, "until": str(cue)}))
    log = tmp_path / "run.log"  # a file: a pipe nobody reads while the test waits would fill up
    cli = subprocess.Popen(forgeline_run(wait), cwd=tmp_path, env=env, stdout=log.open("w"),
                           stderr=subprocess.STDOUT)
    try:
        spool = tmp_path / "artifacts" / "tracking-spool"
        deadline = time.monotonic() + 600
        while not logged_step(spool, 5):  # train.log_every: rank 0 spools step 5, then waits
            assert cli.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, "training did not reach step 5:\n" + log.read_text()[-6000:]
            time.sleep(0.5)
        running = [describe(process) for process in carrying(RUN_ENV, run)]
        assert any("uvicorn" in line for line in running), running  # Prefect's temporary server
        assert any("forgeline.model.training.worker" in line for line in running), running  # a rank

        cli.send_signal(signal.SIGTERM)
        cue.touch()
        cli.wait(timeout=300)
        assert_nothing_left(run)
        assert cli.returncode == 128 + signal.SIGTERM, log.read_text()[-6000:]
        assert "forgeline: stopped by SIGTERM" in log.read_text()
        assert "Crash detected" not in log.read_text()  # Prefect's, once a run around the work: no crash
    finally:
        if cli.poll() is None:
            cli.kill()
        stop(carrying(RUN_ENV, run))  # old code: the server it left behind

    checkpoints = tmp_path / load_config("debug.yaml", TRAIN).train.out_dir / "checkpoints"
    assert [info.step for info in committed_checkpoints(checkpoints)] == [6]
    rerun = subprocess.run(forgeline_run(), cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-6000:]
    assert "stage data: inputs unchanged and outputs verified" in rerun.stderr
    assert f"starting at step 6/{STEPS}" in rerun.stderr
    assert "Registered model: forgeline-debug version 1" in rerun.stdout
    assert not still_there(lambda: carrying(RUN_ENV, run), grace_s=10)


def test_sigterm_during_the_data_build_stops_its_dask_workers(tmp_path: Path) -> None:
    """The data stage's local Dask cluster (tasks/data/executor.py) is closed, its workers with it."""
    run = uuid.uuid4().hex
    log = tmp_path / "stage.log"
    cli = subprocess.Popen(forgeline(["stage", "data"], "data.executor=dask", "data.num_workers=2"),
                           cwd=tmp_path, env=user_env(tmp_path) | {RUN_ENV: run}, stdout=log.open("w"),
                           stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not any("spawn_main" in describe(process) for process in carrying(RUN_ENV, run)):
            assert cli.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, "no Dask worker started:\n" + log.read_text()[-6000:]
            time.sleep(0.2)
        cli.send_signal(signal.SIGTERM)
        cli.wait(timeout=120)
        assert_nothing_left(run)
        assert cli.returncode == 128 + signal.SIGTERM, log.read_text()[-6000:]
        assert " documents -> " not in log.read_text()  # stopped mid-build, not after it
    finally:
        if cli.poll() is None:
            cli.kill()
        stop(carrying(RUN_ENV, run))


def test_ctrl_c_ends_in_one_sentence_like_sigterm(tmp_path: Path) -> None:
    """SIGINT to the terminal's process group mid-train, as Ctrl-C sends it: no traceback from
    forgeline or torchrun on the console (the stage's log file keeps them), exit 130."""
    run = uuid.uuid4().hex
    env = user_env(tmp_path) | {RUN_ENV: run, "PYTHONPATH": str(REPO_ROOT)}  # the ranks import tests.faults
    cue = tmp_path / "signalled"
    wait = callbacks(("WaitBefore", {"step": 6, "until": str(cue)}))
    err = tmp_path / "stderr.log"
    cli = subprocess.Popen(forgeline_run(wait), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                           stderr=err.open("w"), start_new_session=True)  # a terminal's own group
    try:
        deadline = time.monotonic() + 600
        while not logged_step(tmp_path / "artifacts" / "tracking-spool", 5):
            assert cli.poll() is None, err.read_text()[-6000:]
            assert time.monotonic() < deadline, "training did not reach step 5:\n" + err.read_text()[-6000:]
            time.sleep(0.5)
        os.killpg(cli.pid, signal.SIGINT)
        cue.touch()
        cli.wait(timeout=300)
        assert_nothing_left(run)
    finally:
        if cli.poll() is None:
            cli.kill()
        stop(carrying(RUN_ENV, run))
    console = err.read_text()
    assert cli.returncode == 128 + signal.SIGINT, console[-6000:]
    assert "Traceback" not in console and "SignalException" not in console, console[-6000:]
    assert "Crash detected" not in console, console[-6000:]
    last_line = console.strip().splitlines()[-1]
    assert last_line.startswith("forgeline: stopped by SIGINT: the work was stopped"), console[-6000:]
