"""The two UIs as a person reads them (`make ui-check`; marked `ui`, so neither `make test` nor
`make test-slow` runs it), in headless Chromium (Debian's, `make browser`). Prefect: a stage run
against `prefect server start` on 127.0.0.1, its flow run page showing forgeline's events in the
logs, and a stage deployment's run form documenting its parameters. MLflow: two `forgeline run`s
against `mlflow server`, the second's training stopped by SIGTERM and resumed -- the runs table
with the scores as columns, the two eval runs compared, the resumed training's one loss curve
and the versions list. Screenshots are saved under artifacts/screenshots/ (ignored by git) for a
person to look at."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from mlflow import MlflowClient
from selenium import webdriver

from forgeline.tasks.runner import STAGE_TAG
from forgeline.tasks.tracking import CONTINUED_FROM_TAG, RUNS_VIEW_COLUMNS
from tests.conftest import REPO_ROOT
from tests.integration.helpers import VENV_BIN, run, running_prefect_server, user_env
from tests.integration.test_mlflow_ui import (  # noqa: F401 (fixtures)
    ASSISTANT_CLOSE,
    browser,
    mlflow_server,
    plot_metrics,
    show_diff_only,
    wait_for_text,
)
from tests.integration.test_preemption import logged_step
from tests.integration.test_recovery import callbacks

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


def test_mlflow_shows_the_runs_table_scores_an_eval_comparison_and_a_resumed_loss_curve(
        tmp_path: Path, mlflow_server: str, browser: webdriver.Chrome) -> None:  # noqa: F811
    """Two `forgeline run`s against `mlflow server`, the second's training stopped by SIGTERM
    once and resumed by the run: the runs table (forgeline's shared view) shows the scores as
    columns, with values; the two eval runs side by side say what each scored; the resumed
    training is one run whose loss starts at step 1."""
    forgeline = [str(VENV_BIN / "forgeline"), "run", "--config", "debug.yaml",
                 "--set", f"registry.tracking_uri={mlflow_server}"]
    run(forgeline, tmp_path)
    stop_training_once(tmp_path, ["--set", f"registry.tracking_uri={mlflow_server}", "--set", "train.seed=1"])
    resumed = run([*forgeline, "--set", "train.seed=1"], tmp_path)
    # From the step the stop saved, or the periodic save before it (every 10 steps).
    assert re.search(r"starting at step 1[01]/20", resumed.stderr), resumed.stderr[-4000:]
    table = re.search(r"MLflow runs table, with the scores: (\S+)", resumed.stdout).group(1)
    look_at_mlflow(browser, mlflow_server, table)


def look_at_mlflow(driver: webdriver.Chrome, server: str, table_link: str) -> None:
    """The runs table (`table_link`), the two eval runs compared and the resumed training's loss,
    each checked on the page and saved as a screenshot."""
    client = MlflowClient(server)
    experiment = client.get_experiment_by_name("forgeline-debug").experiment_id
    pipelines = client.search_runs([experiment], "attributes.run_name LIKE 'pipeline%'",
                                   order_by=["attributes.start_time ASC"])
    evals, trains = ([found for found in client.search_runs([experiment], f"tags.`{STAGE_TAG}` = '{stage}'",
                                                            order_by=["attributes.start_time ASC"])]
                     for stage in ("eval", "train"))
    assert len(pipelines) == len(evals) == len(trains) == 2

    # The runs table, in the view `forgeline run` links to: each score a column, each row a value.
    driver.get(table_link)
    table = wait_for_text(driver, *(p.info.run_name for p in pipelines), *RUNS_VIEW_COLUMNS)
    for pipeline in pipelines:
        overall = pipeline.data.metrics["eval/overall"]
        assert any(f"{overall:.{digits}f}" in table for digits in (2, 3, 4)), (overall, table)
    close_assistant(driver)
    screenshot(driver, "mlflow-runs-table.png")

    # The two eval runs side by side: their names say the version each scored; their params the
    # checkpoint and the training run, which differ; the plot each run's overall score.
    names = [e.info.run_name for e in evals]
    assert len(set(names)) == 2 and all(re.fullmatch(r"eval debug step-20 v\d", n) for n in names), names
    assert evals[0].data.params["train_run_id"] != evals[1].data.params["train_run_id"]
    driver.get(f"{server}/#/compare-runs?runs={quote(json.dumps([e.info.run_id for e in evals]))}"
                f"&experiments={quote(json.dumps([experiment]))}")
    wait_for_text(driver, *names, "checkpoint_step", "train_run_id")
    close_assistant(driver)
    show_diff_only(driver, "Parameters")  # what differs: the checkpoint and its training run
    wait_for_text(driver, *(e.data.params["train_run_id"] for e in evals))
    plot_metrics(driver, "eval/overall")
    wait_for_text(driver, *(f"{e.data.metrics['eval/overall']:.5f}" for e in evals))
    screenshot(driver, "mlflow-eval-compare.png")

    # The resumed training: one FINISHED run of two attempts, which took over the stopped one's
    # parent's run, its loss from step 1 to the end, on the metric's page: one run (1/1), one curve.
    train = trains[1]
    assert train.info.status == "FINISHED" and train.data.tags["forgeline.attempts"] == "2"
    assert CONTINUED_FROM_TAG in train.data.tags
    steps = [m.step for m in client.get_metric_history(train.info.run_id, "loss")]
    assert sorted(steps) == list(range(1, 21)), steps
    driver.get(f"{server}/#/metric?runs={quote(json.dumps([train.info.run_id]))}&metric=%22loss%22"
               f"&experiments={quote(json.dumps([experiment]))}&plot_metric_keys=%5B%22loss%22%5D"
               "&x_axis=step&show_point=true")
    wait_for_text(driver, "Completed Runs\n1/1", f"{train.info.run_name} (loss)", "(step=20)")
    close_assistant(driver)
    screenshot(driver, "mlflow-resumed-loss.png")

    # The model's versions list: a few tags per row (what identifies a version and the decision),
    # and the decision in one line as the description.
    versions = client.search_model_versions("name = 'forgeline-debug'")
    assert len(versions) == 2 and all(len(v.tags) <= 11 for v in versions), [v.tags for v in versions]
    driver.get(f"{server}/#/models/forgeline-debug")
    # (the list cuts a description short: its first words)
    wait_for_text(driver, "Version 1", "Version 2", "eval.overall",
                  *(" ".join(v.description.split()[:2]) for v in versions))
    close_assistant(driver)
    screenshot(driver, "mlflow-versions.png")


def stop_training_once(workdir: Path, overrides: list[str]) -> None:
    """`forgeline stage train` stopped by SIGTERM before step 11 (after the checkpoint of step 10)
    as an eviction does: it saves step 11 and exits, its MLflow run left to the rerun."""
    cue = workdir / "signalled"
    cmd = [str(VENV_BIN / "forgeline"), "stage", "train", "--config", "debug.yaml", *overrides,
           "--set", callbacks(("WaitBefore", {"step": 11, "until": str(cue)}))]
    log = workdir / "stopped-train.log"
    env = user_env(workdir) | {"PYTHONPATH": str(REPO_ROOT)}  # the ranks import tests.faults
    stage = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    deadline = time.monotonic() + 300
    while not logged_step(workdir / "artifacts" / "tracking-spool", 10):
        assert stage.poll() is None and time.monotonic() < deadline, log.read_text()[-6000:]
        time.sleep(0.2)
    stage.send_signal(signal.SIGTERM)
    cue.touch()
    assert stage.wait(timeout=200) != 0, log.read_text()[-6000:]


def close_assistant(driver: webdriver.Chrome) -> None:
    """Close the MLflow Assistant panel, which covers a third of the page."""
    for close in driver.find_elements("css selector", f"button[data-component-id='{ASSISTANT_CLOSE}']"):
        close.click()
