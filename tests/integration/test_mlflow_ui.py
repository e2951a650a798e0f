"""The MLflow UI as a user sees it: two `forgeline run`s against a real `mlflow server` on
127.0.0.1, opened in headless Chromium (Debian's, installed by `make browser`): the experiment
opens on its runs, named by what ran; the two open side by side in the compare view, which shows
what changed and plots each run's overall score with its standard error. Its screenshot is saved as
artifacts/screenshots/mlflow-compare.png (ignored by git; CI can keep it)."""

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
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from forgeline.tasks.tracking import EXPERIMENT_KIND_TAG, TRAINING_KIND
from tests.conftest import REPO_ROOT
from tests.integration.helpers import VENV_BIN, free_port, run, serving, user_env

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ASSISTANT_CLOSE = "mlflow.assistant.chat_panel.close"


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


def show_diff_only(driver: webdriver.Chrome, table: str) -> None:
    """Flip the compare view's "Show diff only" switch of `table` (Parameters, Metrics, Tags)."""
    driver.find_element("css selector", f"button[aria-label='{table} - Show diff only']").click()


def plot_metrics(driver: webdriver.Chrome, *keys: str) -> None:
    """Put `keys` on the compare view's parallel coordinates plot in place of the metric it
    starts with, as a user would: remove that one, type each key into the selector, Enter."""
    selector = driver.find_element("xpath", "//*[normalize-space(text())='Metrics:']"
                                            "/following::div[contains(@class, 'select-selector')][1]")
    selector.find_element("css selector", "[class*='selection-item-remove']").click()
    for key in keys:
        selector.click()  # opens the list of metrics
        box = selector.find_element("css selector", "input")
        box.send_keys(key)
        WebDriverWait(driver, 10).until(lambda d, key=key: d.find_elements(
            "xpath", f"//div[contains(@class, 'select-item-option-content') and text()='{key}']"))
        box.send_keys(Keys.ENTER)
    selector.find_element("css selector", "input").send_keys(Keys.ESCAPE)


def test_two_pipeline_runs_open_in_the_compare_view(tmp_path: Path, mlflow_server: str,
                                                    browser: webdriver.Chrome, flow_runs) -> None:
    forgeline = [str(VENV_BIN / "forgeline"), "run", "--config", "debug.yaml",
                 "--set", f"registry.tracking_uri={mlflow_server}"]
    first = run(forgeline, tmp_path)
    # Another seed: train, eval and register rerun on the same data and eval items (the promotion
    # gate compares on the same items), and the scores move.
    second = run([*forgeline, "--set", "train.seed=1"], tmp_path)
    run_ids = [re.search(r"MLflow run: (\w+)", done.stdout).group(1) for done in (first, second)]
    # Prefect shows each flow run's parameters as typed (its config as a path or shipped name):
    # the config they resolve to is each MLflow run's config.yaml.
    parameters = sorted((flow_run["parameters"]["config"], flow_run["parameters"]["overrides"])
                        for flow_run in flow_runs(tmp_path))
    assert parameters == [("debug.yaml", [forgeline[-1]]), ("debug.yaml", [forgeline[-1], "train.seed=1"])]
    client = MlflowClient(mlflow_server)
    runs = [client.get_run(run_id) for run_id in run_ids]
    names = [r.info.run_name for r in runs]
    # Named by the version each registered: the two rows differ where the table shows them.
    assert [re.sub(r" @[0-9a-f]{7}(-dirty)?$", "", n) for n in names] == \
        ["pipeline debug v1 dp1", "pipeline debug v2 dp1"], names
    experiment = runs[0].info.experiment_id
    assert client.get_experiment(experiment).tags[EXPERIMENT_KIND_TAG] == TRAINING_KIND
    assert runs[0].data.metrics["eval/overall"] != runs[1].data.metrics["eval/overall"]

    # The link `forgeline run` ends with: the run's page, in the training view.
    link = re.search(r"MLflow UI: (\S+)", first.stdout).group(1)
    assert link == f"{mlflow_server}/#/experiments/{experiment}/runs/{run_ids[0]}" \
                   "?workflowType=machine_learning"
    browser.get(link)
    wait_for_text(browser, names[0], "train.steps")
    assert "workflowType=machine_learning" in browser.current_url, browser.current_url

    # The runs table's link: the score columns shown, on every row (one name per score).
    browser.get(re.search(r"MLflow runs table, with the scores: (\S+)", second.stdout).group(1))
    wait_for_text(browser, *names, "eval/overall", "train/final_loss")

    # The link the README gives: the experiment on its runs, not on the GenAI overview.
    browser.get(f"{mlflow_server}/#/experiments/{experiment}?workflowType=machine_learning")
    listing = wait_for_text(browser, *names)
    assert f"/experiments/{experiment}/runs" in browser.current_url, browser.current_url
    assert f"forgeline-data ({runs[0].data.tags['forgeline.data.dvc_md5']})" in listing  # the dataset input

    compare = (f"{mlflow_server}/#/compare-runs?runs={quote(json.dumps(run_ids))}"
               f"&experiments={quote(json.dumps([experiment]))}")
    browser.get(compare)
    # Params, metrics and tags side by side (the tables render the rows in view: check early ones).
    text = wait_for_text(browser, *names, "eval.batch_size", "data/documents", "forgeline.data.dvc_md5")
    assert "Show diff only" in text and "train.steps" in text
    for close in browser.find_elements("css selector", f"button[data-component-id='{ASSISTANT_CLOSE}']"):
        close.click()  # the MLflow Assistant panel covers a third of the page
    show_diff_only(browser, "Parameters")  # the seed: the one row that differs
    # Each run's overall score and its standard error, on the plot at the top: the metrics table
    # shows ~6 of its ~70 rows, and scrolled, its row names stay behind.
    scores = ("eval/overall", "eval/stderr/overall")
    plot_metrics(browser, *scores)
    # Each axis is labelled with its two ends: the two runs' values, to 5 decimals.
    wait_for_text(browser, *(f"{r.data.metrics[key]:.5f}" for r in runs for key in scores))
    screenshot = REPO_ROOT / "artifacts" / "screenshots" / "mlflow-compare.png"
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(screenshot)), "no screenshot"
    assert screenshot.stat().st_size > 10_000
