"""A stage run against a real `prefect server start` named by PREFECT_API_URL (no temporary
server): the flow run, its stage task run and the data build's partition work (Prefect task runs
on the local Dask cluster) are recorded by that server, and forgeline's events are among the flow
run's logs there (a worker's flow run: tests/integration/test_deployments.py)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from forgeline.configs import load_config
from tests.integration.helpers import VENV_BIN, run

pytestmark = pytest.mark.integration


def test_stage_runs_against_the_server_in_prefect_api_url(tmp_path: Path, prefect_server: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.setenv("PREFECT_API_URL", prefect_server)
    done = run([str(VENV_BIN / "forgeline"), "stage", "data", "--config", "debug.yaml"], workdir)
    assert "Starting temporary server" not in done.stdout + done.stderr
    # It ends in sentences, as `forgeline run` does: what it made, where, its MLflow run (a repr before).
    made, ended = done.stdout.splitlines()[-2:]
    assert re.fullmatch(r"data: 775 documents, [\d,]+ training tokens in [\d,]+ rows, [\d,]+ validation "
                        r"rows; in \S+", made), made
    assert re.fullmatch(r"ran data; MLflow run \w+: http://\S+ .*", ended), ended
    flow_runs = httpx.post(f"{prefect_server}/flow_runs/filter", json={}, timeout=30).json()
    [flow_run] = flow_runs
    flow = httpx.get(f"{prefect_server}/flows/{flow_run['flow_id']}", timeout=30).json()
    assert flow["name"] == "forgeline-data" and flow_run["state"]["type"] == "COMPLETED"
    task_runs = httpx.post(f"{prefect_server}/task_runs/filter",
                           json={"flow_runs": {"id": {"any_": [flow_run["id"]]}}}, timeout=30).json()
    assert {t["state"]["type"] for t in task_runs} == {"COMPLETED"}
    names = [t["name"] for t in task_runs]
    partition_work = [name for name in names if re.fullmatch(r"data-[a-z-]+-\d+", name)]
    assert len(names) - len(partition_work) == 1  # the stage's own task run
    assert {"data-clean-0", "data-exact-dedup-0", "data-near-dedup-0", "data-tokenize-train-0",
            "data-shards-train-0"} <= set(names), names
    assert (workdir / load_config("debug.yaml").data.out_dir / "manifest.json").is_file()
    assert flow_run["name"].startswith("stage data debug @") and "stage:data" in flow_run["tags"]
    logs = httpx.post(f"{prefect_server}/logs/filter", timeout=30, json={
        "logs": {"flow_run_id": {"any_": [flow_run["id"]]}}, "limit": 200}).json()
    forgeline = "\n".join(entry["message"] for entry in logs if entry["name"].startswith("forgeline"))
    for event in ("stage data runs (no record of an earlier run)",
                  "documents read, cleaned and deduplicated"):
        assert event in forgeline, forgeline
