"""Credentials stay out of Prefect, checked in what a real `prefect server start` stored -- flow
runs with their parameters and states, task runs, logs, artifacts and events, read through its
API: a URL with a password or a secret parameter (`?token=`, a presigned URL's signature) is
refused before the CLI starts a flow; a flow run started with one in its overrides, as a
deployment's is, fails on its config without logging it; credentials from the environment reach
nothing, a tracking URI with a token included (nor MLflow); and a URL credential that
forgeline's code logs is masked in the run's logs."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient

from tests.conftest import output_overrides
from tests.integration.helpers import VENV_BIN, running_prefect_server, user_env

pytestmark = pytest.mark.integration

SECRET = "s3cr3tvalue"
PAGE = 200  # the API's largest page


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One server for the module, which reads all it holds: each test uses a secret of its own."""
    with running_prefect_server(tmp_path_factory.mktemp("prefect")) as url:
        yield url


def start(cmd: list[str], workdir: Path, api: str, env: dict[str, str] | None = None,
          timeout: float = 600) -> subprocess.CompletedProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=workdir, env=user_env(workdir) | {"PREFECT_API_URL": api} | (env or {}),
                          capture_output=True, text=True, timeout=timeout)


def set_args(overrides: list[str]) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


def pages(api: str, path: str, body: dict | None = None) -> list[dict]:
    found: list[dict] = []
    while True:
        response = httpx.post(f"{api}{path}", json=(body or {}) | {"limit": PAGE, "offset": len(found)},
                              timeout=30)
        page = response.raise_for_status().json()
        found += page
        if len(page) < PAGE:
            return found


def stored(api: str) -> dict[str, list[dict]]:
    """Everything Prefect's database holds about runs, as its API returns it."""
    flow_runs = pages(api, "/flow_runs/filter")
    page = httpx.post(f"{api}/events/filter", json={"limit": 50}, timeout=30).raise_for_status().json()
    events = page["events"]
    while page["next_page"]:
        page = httpx.get(page["next_page"], timeout=30).raise_for_status().json()
        events += page["events"]
    states = [httpx.get(f"{api}/flow_run_states/", params={"flow_run_id": run["id"]}, timeout=30)
              .raise_for_status().json() for run in flow_runs]
    return {
        "flows": pages(api, "/flows/filter"),
        "flow_runs": flow_runs,
        "states": states,
        "task_runs": pages(api, "/task_runs/filter"),
        "logs": pages(api, "/logs/filter"),
        "artifacts": pages(api, "/artifacts/filter"),
        "events": events,
    }


def run_logs(api: str, flow_run_id: str) -> str:
    return "\n".join(log["message"] for log in
                     pages(api, "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}}))


@pytest.mark.parametrize(("override", "refusal", "hint"), [
    ("checkpoint.persistent_url=s3://AKIAEXAMPLE:{secret}@127.0.0.1:9/bucket",
     "checkpoint.persistent_url: the URL holds a password", "AWS_SECRET_ACCESS_KEY"),
    ("checkpoint.persistent_url=https://acct.blob.core.windows.net/ckpt?sv=2022-11-02&sp=rw&sig={secret}",
     "checkpoint.persistent_url: the URL holds a credential (its `sig` parameter)", "fsspec"),
    ("registry.tracking_uri=http://127.0.0.1:9/?token={secret}",
     "registry.tracking_uri: the URL holds a credential (its `token` parameter)", "MLFLOW_TRACKING_TOKEN"),
    ("data.sources=[{{kind: files, path: 'https://b.s3.amazonaws.com/c.jsonl?X-Amz-Signature={secret}'}}]",
     "data.sources.0.path: the URL holds a credential (its `X-Amz-Signature` parameter)",
     "AWS_SECRET_ACCESS_KEY"),
], ids=["password", "sas-signature", "tracking-token", "presigned-source"])
def test_the_cli_refuses_a_url_credential_before_prefect_sees_it(api: str, tmp_path: Path, override: str,
                                                                 refusal: str, hint: str) -> None:
    secret = f"{SECRET}-cli-{tmp_path.name}"
    done = start([str(VENV_BIN / "forgeline"), "stage", "data", "--config", "debug.yaml",
                  *set_args(output_overrides(tmp_path / "out")), "--set", override.format(secret=secret)],
                 tmp_path / "work", api)
    assert done.returncode == 2, done.stderr[-4000:]
    assert refusal in done.stderr and hint in done.stderr
    assert secret not in done.stdout + done.stderr
    assert secret not in json.dumps(stored(api))
    assert not (tmp_path / "out" / "data").exists()


def test_a_flow_run_given_a_url_password_fails_on_its_config_without_logging_it(api: str,
                                                                                tmp_path: Path) -> None:
    """As a deployment's flow run: the overrides come as the flow's parameters, which Prefect
    stores as submitted before forgeline's code runs."""
    secret = f"{SECRET}-deployment"
    overrides = output_overrides(tmp_path / "out") + [
        f"checkpoint.persistent_url=s3://AKIAEXAMPLE:{secret}@127.0.0.1:9/bucket"]
    script = ("import json, sys\nfrom forgeline.configs.environment import apply_environment_defaults\n"
              "apply_environment_defaults()\nfrom forgeline.flows.stage_flows import STAGE_FLOWS\n"
              "STAGE_FLOWS['data'](config='debug.yaml', overrides=json.loads(sys.argv[1]))\n")
    done = start([sys.executable, "-c", script, json.dumps(overrides)], tmp_path / "work", api)
    assert done.returncode != 0
    assert "checkpoint.persistent_url: the URL holds a password" in done.stderr, done.stderr[-4000:]
    assert secret not in done.stdout + done.stderr

    everything = stored(api)
    [flow_run] = [run for run in everything["flow_runs"] if secret in json.dumps(run["parameters"])]
    assert flow_run["state"]["type"] == "FAILED"
    assert "checkpoint.persistent_url" in flow_run["state"]["message"]
    assert "checkpoint.persistent_url: the URL holds a password" in run_logs(api, flow_run["id"])
    for run in everything["flow_runs"]:
        run.pop("parameters")  # the one place it is: what the run was submitted with
    assert secret not in json.dumps(everything)
    assert not (tmp_path / "out" / "data").exists()


def test_credentials_from_the_environment_reach_no_flow_run(api: str, tmp_path: Path) -> None:
    secret = f"{SECRET}-environment"
    done = start([str(VENV_BIN / "forgeline"), "stage", "data", "--config", "debug.yaml",
                  *set_args(output_overrides(tmp_path / "out")),
                  "--set", "checkpoint.persistent_url=s3://bucket/checkpoints"],
                 tmp_path / "work", api,
                 env={"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": secret,
                      "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    assert done.returncode == 0, done.stderr[-6000:]
    assert (tmp_path / "out" / "data" / "manifest.json").is_file()
    everything = stored(api)
    stored_s3 = "checkpoint.persistent_url=s3://bucket/checkpoints"
    [flow_run] = [run for run in everything["flow_runs"]
                  if stored_s3 in (run["parameters"].get("overrides") or [])]
    assert flow_run["state"]["type"] == "COMPLETED"
    assert all(everything[kind] for kind in ("task_runs", "logs", "events"))  # were read (no artifacts here)
    assert secret not in done.stdout + done.stderr
    assert secret not in json.dumps(everything)


def test_a_tracking_uri_with_a_token_from_the_environment_is_masked_in_logs_and_mlflow(
        api: str, tmp_path: Path) -> None:
    """A real stage run whose MLflow store comes from $MLFLOW_TRACKING_URI with a query secret
    (here a token sqlite ignores, as a database URI's `?password=` would be): the stage logs the
    store it records to; no log line, Prefect record, MLflow param or tag shows the secret."""
    secret = f"{SECRET}-tracking-token"
    store = tmp_path / "mlflow.db"
    uri = f"sqlite:///{store}?token={secret}"
    overrides = [o for o in output_overrides(tmp_path / "out") if not o.startswith("registry.tracking_uri=")]
    done = start([str(VENV_BIN / "forgeline"), "stage", "data", "--config", "debug.yaml",
                  *set_args(overrides)], tmp_path / "work", api, env={"MLFLOW_TRACKING_URI": uri})
    assert done.returncode == 0, done.stderr[-6000:]
    masked = f"sqlite:///{store}?token=***"
    assert masked in done.stderr  # the stage's "MLflow run ... in <store>" line: the path ran
    assert secret not in done.stdout + done.stderr

    everything = stored(api)
    out_dir = f"data.out_dir={tmp_path / 'out' / 'data'}"
    [flow_run] = [run for run in everything["flow_runs"]
                  if out_dir in (run["parameters"].get("overrides") or [])]
    assert flow_run["state"]["type"] == "COMPLETED"
    assert masked in run_logs(api, flow_run["id"])
    assert secret not in json.dumps(everything)

    client = MlflowClient(f"sqlite:///{store}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert runs and all(run.data.params and run.data.tags for run in runs)
    assert secret not in json.dumps([[run.data.params, run.data.tags] for run in runs])


def test_a_url_password_logged_in_a_flow_run_is_masked(api: str, tmp_path: Path) -> None:
    """A flow that starts as forgeline's do (`flow_config`, which installs the filter), then logs a
    URL from the environment, and a traceback with one in its error, as a client library's may be
    -- a URL with a password, and presigned URLs with their signature in the query."""
    secret = f"{SECRET}-log"
    script = f"""
import logging
from forgeline.configs.environment import apply_environment_defaults
apply_environment_defaults()
from prefect import flow, get_run_logger
from forgeline.flows.hooks import flow_config

URL = "postgresql://ml:{secret}@db:5432/mlflow"

@flow(name="forgeline-secrets-probe")
def probe() -> None:
    flow_config("debug.yaml", [])
    log = logging.getLogger("forgeline.tasks.tracking")
    log.warning("MLflow run in %s", URL)
    get_run_logger().info("tracking store " + URL)
    try:
        raise ConnectionError("cannot reach " + URL)
    except ConnectionError:
        log.exception("upload failed")
    log.warning("reading %s", "https://b.s3.amazonaws.com/c.jsonl?X-Amz-Credential=AKIA&X-Amz-Signature={secret}")
    try:
        raise PermissionError("403 on https://a.blob.core.windows.net/c?sv=1&sig={secret}&sp=r")
    except PermissionError:
        get_run_logger().exception("download failed")

probe()
"""
    done = start([sys.executable, "-c", script], tmp_path / "work", api)
    assert done.returncode == 0, done.stderr[-4000:]
    masked = "postgresql://ml:***@db:5432/mlflow"
    assert f"MLflow run in {masked}" in done.stderr
    assert secret not in done.stdout + done.stderr
    everything = stored(api)
    [probe] = [flow["id"] for flow in everything["flows"] if flow["name"] == "forgeline-secrets-probe"]
    [flow_run] = [run for run in everything["flow_runs"] if run["flow_id"] == probe]
    logs = run_logs(api, flow_run["id"])
    assert f"MLflow run in {masked}" in logs and f"tracking store {masked}" in logs
    assert f"ConnectionError: cannot reach {masked}" in logs
    assert "reading https://b.s3.amazonaws.com/c.jsonl?X-Amz-Credential=***&X-Amz-Signature=***" in logs
    assert "PermissionError: 403 on https://a.blob.core.windows.net/c?sv=1&sig=***&sp=r" in logs
    assert secret not in json.dumps(everything)


class Unavailable(http.server.BaseHTTPRequestHandler):
    """A tracking server's address whose server behind it is down, as a proxy answers: 503 to
    every request. It answers, so the CLI's start-up check lets the stage start (a server that
    takes no connection is refused before any work, tests/integration/test_servers_down_at_start.py);
    the stage's first MLflow call then fails."""

    def do_GET(self) -> None:
        self.send_error(503)

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def unavailable_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_failure_whose_error_names_a_url_with_a_token_is_masked_in_prefect_and_on_the_console(
        api: str, tmp_path: Path, unavailable_server: str) -> None:
    """A stage that fails on a tracking server that answers 503 to everything, given in
    $MLFLOW_TRACKING_URI with a token: MLflow's error names the URL. The failed states Prefect
    keeps (their messages are made from the exception, not from a log record) and the CLI's last
    line mask it."""
    secret = f"{SECRET}-failure"
    overrides = [o for o in output_overrides(tmp_path / "out") if not o.startswith("registry.tracking_uri=")]
    done = start([str(VENV_BIN / "forgeline"), "stage", "data", "--config", "debug.yaml",
                  *set_args(overrides)], tmp_path / "work", api,
                 env={"MLFLOW_TRACKING_URI": f"{unavailable_server}/?token={secret}"})
    assert done.returncode == 1, done.stderr[-4000:]
    failed = ("forgeline: forgeline-data failed: MlflowException: API request to "
              f"{unavailable_server}/?token=***")
    assert failed in done.stderr, done.stderr[-4000:]
    assert secret not in done.stdout + done.stderr

    everything = stored(api)
    out_dir = f"data.out_dir={tmp_path / 'out' / 'data'}"
    [flow_run] = [run for run in everything["flow_runs"]
                  if out_dir in (run["parameters"].get("overrides") or [])]
    assert flow_run["state"]["type"] == "FAILED"
    assert "?token=***" in flow_run["state"]["message"], flow_run["state"]["message"]
    assert secret not in json.dumps(everything)
