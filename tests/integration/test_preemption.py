"""Preemption with real torchrun ranks: a signal (SIGUSR1 as Slurm's `--signal` sends it, SIGTERM
as a time limit, an eviction or a cancelled flow run does) makes the ranks finish their step, save
it and exit; the retry -- Prefect's, or a rerun -- resumes from that step, and in deterministic
mode ends with weights bit-identical to an uninterrupted run."""

from __future__ import annotations

import csv
import json
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from forgeline.model.checkpoint.manager import committed_checkpoints, read_checkpoint_manifest
from forgeline.model.inference import load_from_checkpoint
from forgeline.tasks.runner import STAGE_TAG
from forgeline.tasks.tracking import CONTINUED_FROM_TAG, CONTINUED_IN_TAG
from forgeline.tasks.train.job import TrainPreempted, TrainResult, train_model
from forgeline.tasks.train.launch import LaunchTimeout
from tests.conftest import REPO_ROOT, debug_config
from tests.integration.helpers import VENV_BIN, user_env
from tests.integration.test_recovery import callbacks

pytestmark = pytest.mark.integration

STEPS = 24
# Periodic saves far apart, so the step a preemption saved is the only checkpoint before the end.
BASE = [f"train.steps={STEPS}", "checkpoint.every_steps=100", "checkpoint.keep_last=10",
        "train.deterministic=true", "train.peak_tflops=1", "parallel.dp_shard=2", "train.max_restarts=0"]


@pytest.fixture(autouse=True)
def fault_callbacks_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # rank processes import tests.faults


@pytest.fixture(scope="module")
def uninterrupted(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("uninterrupted")
    result = train_model(debug_config(root, f"data.out_dir={data_root / 'data'}", *BASE))
    return weights(Path(result.checkpoint))


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_from_checkpoint(checkpoint).state_dict()


def assert_bit_identical(checkpoint: Path, reference: dict[str, torch.Tensor]) -> None:
    resumed = weights(checkpoint)
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[k], reference[k]) for k in resumed), "weights differ"


def signal_launcher(root: Path, step: int, name: str) -> str:
    args = {"step": step, "signal": name, "once": str(root / "signal.fired")}
    return callbacks(("SignalLauncherBefore", args))


def test_signal_to_torchrun_saves_the_step_and_the_next_attempt_resumes_from_it(
        data_root: Path, tmp_path: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    cfg = debug_config(tmp_path, f"data.out_dir={data_root / 'data'}", *BASE,
                       signal_launcher(tmp_path, 9, "SIGUSR1"))
    with pytest.raises(TrainPreempted, match=r"preempted by SIGUSR1 on .*: step 9 was committed"):
        train_model(cfg)
    checkpoints = Path(cfg.train.out_dir) / "checkpoints"
    assert [info.step for info in committed_checkpoints(checkpoints)] == [9]

    resumed: TrainResult = train_model(cfg)  # the retry: the fault fired once
    assert resumed.step == STEPS and resumed.failures == []
    assert [info.step for info in committed_checkpoints(checkpoints)] == [STEPS, 9]
    assert_bit_identical(Path(resumed.checkpoint), uninterrupted)
    assert not (Path(cfg.train.out_dir) / "preempted.json").exists()


@pytest.mark.slow
def test_prefect_retries_a_preempted_train_stage_into_the_same_run(data_root: Path, tmp_path: Path,
                                                                   flow_runs) -> None:
    """SIGUSR1 to torchrun under `forgeline stage train`: the task fails with TrainPreempted, and
    Prefect's retry resumes from the saved step into the same MLflow run, every step logged."""
    cmd = [str(VENV_BIN / "forgeline"), "stage", "train", "--config", "debug.yaml",
           "--set", f"data.out_dir={data_root / 'data'}", *sum((["--set", o] for o in BASE), []),
           "--set", "train.job_retries=1", "--set", signal_launcher(tmp_path, 9, "SIGUSR1")]
    done = subprocess.run(cmd, cwd=tmp_path, env=user_env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "starting at step 9/24" in done.stderr

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("forgeline-debug").experiment_id],
                               filter_string=f"tags.`{STAGE_TAG}` = 'train'")
    assert run.info.status == "FINISHED" and run.data.tags["forgeline.attempts"] == "2"
    assert run.data.tags["forgeline.attempt.1.error"].startswith("TrainPreempted: preempted by SIGUSR1")
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(steps) == list(range(1, STEPS + 1))  # no step lost, none logged twice
    [flow_run] = flow_runs(tmp_path)
    assert flow_run["state"] == "COMPLETED" and flow_run["task_run_counts"]["train"] == 2


@pytest.mark.slow
def test_sigterm_to_the_stage_saves_the_step_the_ranks_are_in(data_root: Path, tmp_path: Path,
                                                             uninterrupted: dict[str, torch.Tensor]) -> None:
    """SIGTERM to `forgeline stage train` itself (a Kubernetes eviction of its pod, a cancelled
    flow run): it passes the signal to the job, whose ranks save the step they are in within the
    grace period; a rerun resumes from there and ends bit-identical -- in the MLflow run the
    stopped one began: one run, its loss logged at every step, under the rerun's parent and
    linked with the parent it was stopped under."""
    cue = tmp_path / "signalled"
    wait = callbacks(("WaitBefore", {"step": 16, "until": str(cue)}))
    cmd = [str(VENV_BIN / "forgeline"), "stage", "train", "--config", "debug.yaml",
           "--set", f"data.out_dir={data_root / 'data'}", *sum((["--set", o] for o in BASE), [])]
    log = tmp_path / "stage.log"  # a file: a pipe nobody reads while the test waits would fill up
    stage = subprocess.Popen([*cmd, "--set", wait], cwd=tmp_path, env=user_env(tmp_path),
                             stdout=subprocess.DEVNULL, stderr=log.open("w"))
    spool = tmp_path / "artifacts" / "tracking-spool"
    deadline = time.monotonic() + 300
    # Rank 0 spools its metrics every train.log_every (5) steps: once step 15's are there, it waits
    # for the cue before step 16.
    while not logged_step(spool, 15) and time.monotonic() < deadline:
        assert stage.poll() is None, log.read_text()[-6000:]
        time.sleep(0.2)
    signalled = time.monotonic()
    stage.send_signal(signal.SIGTERM)
    cue.touch()
    stage.wait(timeout=200)
    assert stage.returncode != 0 and time.monotonic() - signalled < 60, log.read_text()[-6000:]
    [checkpoints] = tmp_path.glob("artifacts/**/checkpoints")  # train.out_dir's, wherever it is
    [saved] = committed_checkpoints(checkpoints)
    assert saved.step == 16 and read_checkpoint_manifest(saved.path)["loss"] > 0
    record = json.loads((checkpoints.parent / "preempted.json").read_text())
    assert record["signal"] == "SIGTERM" and record["step"] == 16

    rerun = subprocess.run(cmd, cwd=tmp_path, env=user_env(tmp_path), capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-6000:]
    assert "starting at step 16/24" in rerun.stderr
    assert_bit_identical(checkpoints / f"step-{STEPS:08d}", uninterrupted)

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("forgeline-debug").experiment_id
    [run] = client.search_runs([experiment], filter_string=f"tags.`{STAGE_TAG}` = 'train'")
    assert run.info.status == "FINISHED" and run.data.tags["forgeline.attempts"] == "2"
    steps = {m.step for m in client.get_metric_history(run.info.run_id, "loss")}
    assert steps == set(range(1, STEPS + 1))  # steps 1-16 from the stopped attempt, 17-24 resumed
    parents = client.search_runs([experiment], filter_string="attributes.run_name LIKE 'stage train%'",
                                 order_by=["attributes.start_time ASC"])
    stopped_under, resumed_under = (parent.info.run_id for parent in parents)
    assert run.data.tags["mlflow.parentRunId"] == resumed_under
    assert run.data.tags[CONTINUED_FROM_TAG] == stopped_under
    assert client.get_run(stopped_under).data.tags[CONTINUED_IN_TAG] == run.info.run_id
    with (checkpoints.parent / "loss.csv").open() as curve:  # loss.png's numbers
        assert [int(row["step"]) for row in csv.DictReader(curve)] == list(range(1, STEPS + 1))


def logged_step(spool: Path, step: int) -> bool:
    """Whether rank 0 has spooled the loss of `step` (model/spool.py: metrics as [key, value,
    timestamp, step])."""
    loss = re.compile(rf'\["loss", [^\]]*, {step}\]')
    return any(loss.search(path.read_text()) for path in spool.glob("*/rank0-*.jsonl"))


@pytest.mark.slow
def test_a_job_past_train_timeout_s_saves_its_step_and_says_the_limit_stopped_it(data_root: Path,
                                                                                 tmp_path: Path) -> None:
    """train.timeout_s stops the job as a preemption does -- the ranks get SIGTERM and save the step
    they are in -- and the error says the limit stopped it, with the step that was saved (it read
    as a preemption by SIGTERM before, the limit unnamed)."""
    cfg = debug_config(tmp_path, f"data.out_dir={data_root / 'data'}", *BASE, "train.timeout_s=45",
                       callbacks(("SlowSteps", {"seconds": 3})))  # 24 steps: 72 s and more
    with pytest.raises(LaunchTimeout, match=r"timed out after 45s") as raised:
        train_model(cfg)
    [saved] = committed_checkpoints(Path(cfg.train.out_dir) / "checkpoints")
    assert 0 < saved.step < STEPS
    saved_step = f"preempted by SIGTERM on {socket.gethostname()}: step {saved.step} was committed"
    assert saved_step in str(raised.value)
