"""Job-level retry: when the torchrun job fails for good (no in-job restarts left), Prefect
retries the train task with backoff, and the retry resumes from the latest checkpoint into the
same MLflow run, which records why each attempt failed. A launcher killed outright takes its
ranks with it, and only the retry writes checkpoints."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml
from mlflow import MlflowClient

from forgeline.configs import load_config
from forgeline.model.checkpoint.manager import (
    GENERATION_NAME,
    committed_checkpoints,
    read_checkpoint_manifest,
)
from forgeline.tasks.runner import STAGE_TAG
from tests.conftest import REPO_ROOT
from tests.integration.helpers import VENV_BIN, run, user_env

pytestmark = [pytest.mark.integration, pytest.mark.e2e]


def test_failed_job_is_retried_into_the_same_mlflow_run(data_root: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, flow_runs) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # the ranks import tests.faults
    kill = [{"path": "tests.faults:KillBefore", "args": {"step": 15, "once": str(tmp_path / "kill.fired")}}]
    run([str(VENV_BIN / "forgeline"), "stage", "train", "--config", "debug.yaml",
         "--set", f"data.out_dir={data_root / 'data'}", "--set", "train.max_restarts=0",
         "--set", "train.job_retries=1", "--set", "train.peak_tflops=1",
         "--set", "train.callbacks=" + yaml.safe_dump(kill, default_flow_style=True, width=10**6).strip()],
        tmp_path)

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [train_run] = client.search_runs([client.get_experiment_by_name("forgeline-debug").experiment_id],
                                     filter_string=f"tags.`{STAGE_TAG}` = 'train'")
    tags = train_run.data.tags
    assert train_run.info.status == "FINISHED" and tags["forgeline.attempts"] == "2"
    assert tags["forgeline.attempt.1.error"].startswith("LaunchError")
    steps = {m.step for m in client.get_metric_history(train_run.info.run_id, "loss")}
    assert steps == set(range(1, 21))  # attempt 2 resumed at step 10 and logged into the same run

    [flow_run] = flow_runs(tmp_path)
    assert flow_run["state"] == "COMPLETED" and flow_run["task_run_counts"]["train"] == 2


def launched_torchrun(workdir: Path) -> psutil.Process | None:
    """The torchrun launcher a command in `workdir` started, if it runs."""
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["cwd"] == str(workdir) and "torch.distributed.run" in cmdline:
            return proc
    return None


def exited(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_a_launcher_killed_outright_takes_its_ranks_and_only_the_retry_writes(data_root: Path,
                                                                             tmp_path: Path) -> None:
    """kill -9 of torchrun 'as a scheduler would', mid-run on pp2 x dp2: its four ranks die with
    it (none trains on beside the retry), Prefect's retry resumes, and every checkpoint left
    was committed by the retry's generation."""
    settings = [f"data.out_dir={data_root / 'data'}", "parallel.pp=2", "parallel.dp_shard=2",
                "train.steps=120", "train.max_restarts=0", "train.job_retries=1", "train.peak_tflops=1"]
    cmd = [str(VENV_BIN / "forgeline"), "stage", "train", "--config", "debug.yaml",
           *[arg for setting in settings for arg in ("--set", setting)]]
    stage = subprocess.Popen(cmd, cwd=tmp_path, env=user_env(tmp_path), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    checkpoints = tmp_path / load_config("debug.yaml", settings).train.out_dir / "checkpoints"
    deadline = time.monotonic() + 600
    while not (checkpoints / "step-00000010").is_dir() and time.monotonic() < deadline:
        assert stage.poll() is None, stage.stdout.read()[-4000:]
        time.sleep(0.2)
    launcher = launched_torchrun(tmp_path)
    ranks = launcher.children(recursive=True)
    assert len(ranks) == 4, ranks
    first_generation = (checkpoints / GENERATION_NAME).read_text()
    launcher.send_signal(signal.SIGKILL)
    # At once: orphans of this tiny model trained 50 steps within 4 s of the kill (60-step run).
    deadline = time.monotonic() + 2
    while not all(exited(rank) for rank in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(exited(rank) for rank in ranks), "ranks outlived their killed launcher"

    output, _ = stage.communicate(timeout=900)
    assert stage.returncode == 0, output[-4000:]
    left = committed_checkpoints(checkpoints)
    assert [info.step for info in left] == [120, 110]
    [retry_generation] = {read_checkpoint_manifest(info.path)["generation"] for info in left}
    assert retry_generation != first_generation
    assert not (checkpoints / GENERATION_NAME).exists()  # the retry, done, released the directory
