"""prefect.yaml against a real `prefect server start` and a process worker on 127.0.0.1:
`forgeline deploy` registers the deployments; the pipeline deployment runs end to end, and the
eval stage's deployment, given that run as `upstream_run`, evaluates the data and checkpoint
that run wrote (in directories the eval config does not name), then skips it as cached when run
again. What a person reads in Prefect is checked through its API: forgeline's log lines in the
worker's flow run, the run and task run names and tags, the register and eval artifacts, the
Cached state, the run form's parameter descriptions."""

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


def forgeline_lines(api: str, flow_run_id: str, events: tuple[str, ...], timeout: float = 60) -> list[str]:
    """forgeline's log lines of the flow run, once `events` are among them or `timeout` has passed:
    the run's process sends its last batch of log records as it exits, after its final state."""
    deadline = time.monotonic() + timeout
    while True:
        logs: list[dict] = []
        while batch := httpx.post(f"{api}/logs/filter", timeout=30, json={
                "logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200,
                "offset": len(logs)}).json():
            logs += batch
        lines = [entry["message"] for entry in logs if entry["name"].startswith("forgeline")]
        if all(event in "\n".join(lines) for event in events) or time.monotonic() > deadline:
            return lines
        time.sleep(2)


def stage_task_runs(api: str, flow_run_id: str) -> list[dict]:
    """The stage task runs of a flow run (not the data build's partition work)."""
    task_runs = httpx.post(f"{api}/task_runs/filter", timeout=30,
                           json={"flow_runs": {"id": {"any_": [flow_run_id]}}}).json()
    return [run for run in task_runs if any(tag.startswith("stage:") for tag in run["tags"])]


def artifacts_of(api: str, flow_run_id: str) -> dict[str, dict]:
    found = httpx.post(f"{api}/artifacts/filter", timeout=30,
                       json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}).json()
    return {artifact["key"]: artifact for artifact in found}


def test_deployments_run_the_pipeline_and_a_stage_on_its_outputs(worker: Path, prefect_server: str,
                                                                 tmp_path: Path) -> None:
    api = prefect_server
    scheduled = httpx.get(f"{api}/deployments/name/forgeline-pipeline/scheduled", timeout=30).json()
    assert scheduled["schedules"][0]["schedule"]["cron"] == "0 3 * * *"
    assert scheduled["global_concurrency_limit"]["limit"] == 1
    assert "03:00 UTC" in scheduled["description"]
    # The run form: `config` a string, every parameter described (from the flow's docstring).
    form = scheduled["parameter_openapi_schema"]
    assert form["properties"]["config"]["anyOf"] == [{"type": "string"}, {"type": "null"}]
    assert not form.get("definitions")  # no nested Config model
    assert "section.key=value" in form["properties"]["overrides"]["description"]
    assert "Cached" in form["properties"]["force"]["description"]
    for stage in ("data", "train", "eval", "register"):
        deployment = httpx.get(f"{api}/deployments/name/forgeline-{stage}/rerun-{stage}", timeout=30).json()
        assert "earlier pipeline or stage run" in \
            deployment["parameter_openapi_schema"]["properties"]["upstream_run"]["description"]

    pipeline = run_deployment(api, "forgeline-pipeline/scheduled",
                              {"config": "debug.yaml", "overrides": RUN1})
    log = (tmp_path / "worker.log").read_text()
    assert pipeline["state"]["type"] == "COMPLETED", log[-6000:]
    client = MlflowClient(f"sqlite:///{worker / 'mlflow.db'}")
    earlier = mlflow_run_of(client, pipeline["id"])
    assert earlier.data.tags["forgeline.train.out_dir"] == str(worker / "run1" / "train")

    # forgeline's events, in the flow run a worker started: none reached it before issue #40.
    events = ("stage data runs (no record of an earlier run)", "[rank0] model:", "step 20/20  loss",
              "eval scores:", "registered forgeline-debug version 1",
              "forgeline-debug version 1 is now @champion")
    lines = forgeline_lines(api, pipeline["id"], events)
    for event in events:
        assert event in "\n".join(lines), f"{event!r} not among the flow run's forgeline lines:\n{lines}"
    print(f"forgeline log lines in the scheduled deployment's flow run: {len(lines)}")
    # Names and tags that tell the run apart, its MLflow run among them.
    assert pipeline["name"].startswith("pipeline debug dp1 @"), pipeline["name"]
    assert {"stage:train", "config:debug", "model:forgeline-debug", "layout:dp1",
            f"mlflow:{earlier.info.run_id}"} <= set(pipeline["tags"])
    assert any(tag.startswith("commit:") for tag in pipeline["tags"])
    assert pipeline["state"]["message"].startswith("ran data, train, eval, register; MLflow run "
                                                   f"{earlier.info.run_id}: ")
    assert sorted(run["name"].split(" @")[0] for run in stage_task_runs(api, pipeline["id"])) == [
        "data debug", "eval debug", "register debug", "train debug dp1"]
    # The register artifact: the version, the aliases and the decision, under this run's key.
    artifacts = artifacts_of(api, pipeline["id"])
    register = artifacts[f"forgeline-pipeline-register-{earlier.info.run_id}"]["data"]
    assert "## forgeline-debug version 1: promoted" in register
    assert "@champion -> v1 (no champion before)" in register
    assert f"forgeline-pipeline-eval-{earlier.info.run_id}" in artifacts
    # The MLflow run a click away: a link artifact to its page in the training view.
    link = artifacts[f"forgeline-pipeline-mlflow-{earlier.info.run_id}"]
    assert link["data"].startswith(f"[MLflow run {earlier.info.run_id}](http://127.0.0.1:5000/#/experiments/")
    assert link["data"].endswith(f"/runs/{earlier.info.run_id}?workflowType=machine_learning)")
    assert "mlflow ui --backend-store-uri" in link["description"]  # the store is no server here

    # The eval config names its run's directories, which do not exist: only the reuse of the
    # earlier run's outputs lets it run.
    stage = run_deployment(api, "forgeline-eval/rerun-eval",
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
    assert f"upstream:{earlier.info.run_id}" in stage["tags"]
    assert f"forgeline-eval-eval-{rerun.info.run_id}" in artifacts_of(api, stage["id"])  # not the pipeline's

    # Again: the stage cache skips it, and its task run says so.
    again = run_deployment(api, "forgeline-eval/rerun-eval",
                           {"config": "debug.yaml", "upstream_run": earlier.info.run_id})
    assert again["state"]["type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-6000:]
    assert again["state"]["message"].startswith("cached eval; MLflow run ")
    [cached] = stage_task_runs(api, again["id"])
    assert (cached["state"]["type"], cached["state"]["name"]) == ("COMPLETED", "Cached")
    assert "inputs unchanged and outputs verified" in cached["state"]["message"]
    reused = "inputs unchanged and outputs verified; reusing run"
    assert reused in "\n".join(forgeline_lines(api, again["id"], (reused,)))
