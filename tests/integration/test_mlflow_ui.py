"""The MLflow UI as a user sees it: two `forgeline run`s against a real `mlflow server` on
127.0.0.1, opened in headless Chromium (Debian's, installed by `make browser`): both runs are in
the experiment's run list and open side by side in the compare view, whose screenshot is saved
as artifacts/screenshots/mlflow-compare.png (ignored by git; CI can keep it)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from mlflow import MlflowClient
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import REPO_ROOT
from tests.integration.helpers import VENV_BIN, free_port, run, serving, user_env

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(VENV_BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
           "--default-artifact-root", str(tmp_path / "mlartifacts"), "--host", "127.0.0.1",
           "--port", str(port), "--workers", "1"]
    with serving(cmd, user_env(tmp_path), tmp_path / "mlflow-server.log", f"{url}/health"):
        yield url


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    assert Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file(), \
        "Debian's chromium and chromium-driver are missing: run `make browser` (root, apt)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,2400"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for_text(driver: webdriver.Chrome, *texts: str, timeout: float = 90) -> str:
    """The page's visible text once it contains all `texts`."""
    WebDriverWait(driver, timeout).until(lambda d: all(t in d.find_element("tag name", "body").text
                                                       for t in texts))
    return driver.find_element("tag name", "body").text


def test_two_pipeline_runs_open_in_the_compare_view(tmp_path: Path, mlflow_server: str,
                                                    browser: webdriver.Chrome) -> None:
    forgeline = [str(VENV_BIN / "forgeline"), "run", "--config", "debug.yaml",
                 "--set", f"registry.tracking_uri={mlflow_server}"]
    first = run(forgeline, tmp_path)
    second = run([*forgeline, "--set", "eval.batch_size=4"], tmp_path)  # reruns eval and register only
    run_ids = [re.search(r"MLflow run: (\w+)", done.stdout).group(1) for done in (first, second)]
    client = MlflowClient(mlflow_server)
    runs = [client.get_run(run_id) for run_id in run_ids]
    names = [r.info.run_name for r in runs]
    experiment = runs[0].info.experiment_id

    browser.get(f"{mlflow_server}/#/experiments/{experiment}/runs")  # the "Training runs" tab
    listing = wait_for_text(browser, *names)
    assert f"forgeline-data ({runs[0].data.tags['forgeline.data.dvc_md5']})" in listing  # the dataset input

    compare = (f"{mlflow_server}/#/compare-runs?runs={quote(json.dumps(run_ids))}"
               f"&experiments={quote(json.dumps([experiment]))}")
    browser.get(compare)
    # Params, metrics and tags side by side (the tables render the rows in view: check early ones).
    text = wait_for_text(browser, *names, "eval.batch_size", "data/documents", "forgeline.data.dvc_md5")
    screenshot = REPO_ROOT / "artifacts" / "screenshots" / "mlflow-compare.png"
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(screenshot)), "no screenshot"
    assert screenshot.stat().st_size > 10_000
    assert "Show diff only" in text and "train.steps" in text
