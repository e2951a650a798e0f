"""Job-level retry: when the torchrun job fails for good (no in-job restarts left), Prefect
retries the train task with backoff, and the retry resumes from the latest checkpoint into the
same MLflow run, which records why each attempt failed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from forgeline.tasks.runner import STAGE_TAG
from tests.conftest import REPO_ROOT
from tests.integration.helpers import VENV_BIN, prefect_flow_runs, run

pytestmark = [pytest.mark.integration, pytest.mark.e2e]


def test_failed_job_is_retried_into_the_same_mlflow_run(data_root: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
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

    [flow_run] = prefect_flow_runs(tmp_path)
    assert flow_run["state"] == "COMPLETED" and flow_run["task_run_counts"]["train"] == 2
