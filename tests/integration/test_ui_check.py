"""Prefect's UI as a person reads it (`make ui-check`; marked `ui`, so neither `make test` nor
`make test-slow` runs it): a stage run against `prefect server start` on 127.0.0.1, its flow run
page opened in headless Chromium (Debian's, `make browser`) shows forgeline's events in the logs,
and a stage deployment's run form documents its parameters. Screenshots are saved under
artifacts/screenshots/ (ignored by git) for a person to look at."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from selenium import webdriver

from tests.conftest import REPO_ROOT
from tests.integration.helpers import VENV_BIN, run, running_prefect_server
from tests.integration.test_mlflow_ui import browser, wait_for_text  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow, pytest.mark.ui]

SCREENSHOTS = REPO_ROOT / "artifacts" / "screenshots"


def screenshot(driver: webdriver.Chrome, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(SCREENSHOTS / name)), name
    assert (SCREENSHOTS / name).stat().st_size > 10_000


def test_a_flow_run_page_shows_forgelines_events_and_the_run_form_documents_its_parameters(
        tmp_path: Path, browser: webdriver.Chrome) -> None:  # noqa: F811
    workdir = tmp_path / "work"
    workdir.mkdir()
    with running_prefect_server(tmp_path, ui=True) as api:
        env = {"PREFECT_API_URL": api}
        run([str(VENV_BIN / "forgeline"), "stage", "data", "--config", "debug.yaml"], workdir, env=env)
        run([str(VENV_BIN / "forgeline"), "deploy", "--prefect-file", str(REPO_ROOT / "prefect.yaml"),
             "--workdir", str(workdir), "--pool", "forgeline-ui"], workdir, env=env)
        ui = api.removesuffix("/api")
        flow_runs = httpx.post(f"{api}/flow_runs/filter", json={}, timeout=30).json()
        [flow_run] = [found for found in flow_runs
                      if "stage:data" in found["tags"] and not found["parent_task_run_id"]]
        browser.get(f"{ui}/runs/flow-run/{flow_run['id']}")
        # Its name and tags, its state, and forgeline's events among Prefect's own lines: the stage's
        # decision with its reason, the snapshot it took.
        wait_for_text(browser, flow_run["name"], "stage:data", "Completed",
                      "stage data runs (no record of an earlier run)", "forgeline.tasks.data.snapshot")
        screenshot(browser, "prefect-flow-run.png")

        deployment = httpx.get(f"{api}/deployments/name/forgeline-eval/rerun-eval", timeout=30).json()
        browser.get(f"{ui}/deployments/deployment/{deployment['id']}/run")
        described = deployment["parameter_openapi_schema"]["properties"]["upstream_run"]["description"]
        wait_for_text(browser, "upstream_run", described.split(".")[0])
        screenshot(browser, "prefect-run-form.png")
