"""prefect.yaml against a real `prefect server start` and a process worker on 127.0.0.1:
`forgeline deploy` registers the deployments; the pipeline deployment runs end to end, and the
eval stage's deployment, given that run as `upstream_run`, evaluates the data and checkpoint
that run wrote (in directories the eval config does not name)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient

from forgeline.configs import load_config
from tests.conftest import REPO_ROOT
from tests.integration.helpers import VENV_BIN, run, serving, user_env

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

POOL = "forgeline-test"
RUN1 = [f"{section}.out_dir=run1/{name}" for section, name in
        (("data", "data"), ("train", "train"), ("eval", "eval"), ("registry", "register"))]


@pytest.fixture
def worker(tmp_path: Path, prefect_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The deployments registered and a process worker polling their pool; yields the workdir."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.setenv("PREFECT_API_URL", prefect_server)
    run([str(VENV_BIN / "forgeline"), "deploy", "--prefect-file", str(REPO_ROOT / "prefect.yaml"),
         "--workdir", str(workdir), "--pool", POOL], workdir)
    with serving([str(VENV_BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "process"],
                 user_env(workdir), tmp_path / "worker.log"):
        yield workdir


def run_deployment(api: str, name: str, parameters: dict, timeout: float = 900) -> dict:
    """Create a flow run of deployment `name` and wait until it ends; returns the flow run."""
    deployment = httpx.get(f"{api}/deployments/name/{name}", timeout=30).json()
    flow_run = httpx.post(f"{api}/deployments/{deployment['id']}/create_flow_run",
                          json={"parameters": parameters}, timeout=30).json()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        flow_run = httpx.get(f"{api}/flow_runs/{flow_run['id']}", timeout=30).json()
        if flow_run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return flow_run
        time.sleep(2)
    raise AssertionError(f"flow run of {name} did not end in {timeout} s: {flow_run['state']}")


def mlflow_run_of(client: MlflowClient, flow_run_id: str):
    [found] = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.`mlflow.parentRunId` IS NULL")
    return found


def test_deployments_run_the_pipeline_and_a_stage_on_its_outputs(worker: Path, prefect_server: str,
                                                                 tmp_path: Path) -> None:
    api = prefect_server
    scheduled = httpx.get(f"{api}/deployments/name/forgeline-pipeline/scheduled", timeout=30).json()
    assert scheduled["schedules"][0]["schedule"]["cron"] == "0 3 * * *"
    assert scheduled["global_concurrency_limit"]["limit"] == 1
    stage_names = {"forgeline-data", "forgeline-train", "forgeline-eval", "forgeline-register"}
    for flow in stage_names:
        assert httpx.get(f"{api}/deployments/name/{flow}/manual", timeout=30).status_code == 200

    pipeline = run_deployment(api, "forgeline-pipeline/scheduled",
                              {"config": "debug.yaml", "overrides": RUN1})
    log = (tmp_path / "worker.log").read_text()
    assert pipeline["state"]["type"] == "COMPLETED", log[-6000:]
    client = MlflowClient(f"sqlite:///{worker / 'mlflow.db'}")
    earlier = mlflow_run_of(client, pipeline["id"])
    assert earlier.data.tags["forgeline.train.out_dir"] == str(worker / "run1" / "train")

    # The eval config names its run's directories, which do not exist: only the reuse of the
    # earlier run's outputs lets it run.
    stage = run_deployment(api, "forgeline-eval/manual",
                           {"config": "debug.yaml", "upstream_run": earlier.info.run_id})
    assert stage["state"]["type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-6000:]
    default = load_config("debug.yaml")
    assert not (worker / default.train.out_dir).exists()
    rerun = mlflow_run_of(client, stage["id"])
    assert rerun.data.tags["forgeline.upstream_run"] == earlier.info.run_id
    for up in ("data", "train"):
        assert rerun.data.params[f"{up}.out_dir"] == earlier.data.tags[f"forgeline.{up}.out_dir"]
    stamp = json.loads((worker / f"{default.eval.out_dir}.stage.json").read_text())
    # The checkpoint of the earlier run, under the train directory that run recorded.
    checkpoint = Path(stamp["result"]["checkpoint"])
    assert checkpoint.parent == worker / "run1" / "train" / "checkpoints" and checkpoint.is_dir()
    # Upstream outputs by their path as the config names them (as in dvc.yaml) and their md5.
    train_dir = earlier.data.tags["forgeline.train.out_dir"]
    assert stamp["inputs"]["upstream"][train_dir] == earlier.data.tags["forgeline.train.outputs_md5"]
    assert "eval/overall" in rerun.data.metrics
