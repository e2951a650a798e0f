"""Registration is all-or-nothing and idempotent, against a real `mlflow server` (sqlite store).

The server is killed in the middle of a registration: after the version was created, before it
was marked complete. The register stage fails saying so, and the half-registered version is used
by nothing (not as base, candidate or champion). The server comes back on the same store; the
rerun completes that version instead of registering another, and a rerun after that registers
nothing. A failure while the registry answers deletes the incomplete version and puts the
`candidate` alias back. An outage while the promotion gate reads a candidate's per-item results
is an error, never a recorded decision: the rerun decides. So is a short outage while the stage
uploads the eval's per-item results: no version is registered for the gate to judge on no items."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from forgeline.configs import Config
from forgeline.configs.schema import ConfigError
from forgeline.flows.cli import main
from forgeline.model.spool import TrackingSpool
from forgeline.tasks import compare
from forgeline.tasks.evaluate import ITEMS_NAME
from forgeline.tasks.pretrained import (
    CACHE_ENV,
    COMPLETE,
    INCOMPLETE,
    REGISTRATION_TAG,
    IncompleteRegistration,
    resolve_base,
)
from forgeline.tasks.promote import CHAMPION_ALIAS, DECISION_TAG, aliased, promote
from forgeline.tasks.register import CANDIDATE_ALIAS, REGISTRATION_KEY_TAG, RegistrationError
from forgeline.tasks.runner import run_stage
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import DATA_VERSION_TAG
from forgeline.tasks.train.job import train_model
from tests.conftest import debug_config
from tests.integration.helpers import VENV_BIN, free_port, user_env
from tests.integration.test_promotion import write_synthetic_eval

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# forgeline's bounded waits (configs/environment.py), whatever the environment says: a call to a
# dead server fails in seconds, not the ~4 minutes of MLflow's defaults (7 retries with backoff).
FAST_FAILING = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


@contextmanager
def mlflow_server(root: Path, port: int, proxied: bool = False) -> Iterator[subprocess.Popen]:
    """`mlflow server` on 127.0.0.1:`port` over the sqlite store and artifacts under `root`, in its
    own process group; stopped on exit unless the test killed it. `proxied`: artifacts go through
    the server (mlflow-artifacts:/), as with a remote store, instead of straight to `root`."""
    artifacts = "--artifacts-destination" if proxied else "--default-artifact-root"
    cmd = [str(VENV_BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           artifacts, str(root / "mlartifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with open(root / "mlflow-server.log", "a") as log:
        process = subprocess.Popen(cmd, env=user_env(root), stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not answers(f"http://127.0.0.1:{port}/health"):
            assert process.poll() is None, (root / "mlflow-server.log").read_text()[-8000:]
            assert time.monotonic() < deadline, "mlflow server not healthy after 180 s"
            time.sleep(1)
        yield process
    finally:
        kill(process)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, data_root: Path) -> Path:
    """A root whose train output holds a checkpoint of the debug model, trained once."""
    root = tmp_path_factory.mktemp("trained")
    train_model(debug_config(root, f"data.out_dir={data_root / 'data'}", "train.peak_tflops=1"))
    return root


def evaluated(root: Path, trained: Path, data_root: Path, eval_dir: str, seed: str, *overrides: str,
              **accuracy: float) -> Config:
    """The config of a register stage on the checkpoint under `trained`, after an eval (under
    `root`/`eval_dir`) whose items.json holds 150 right/wrong answers per task at these accuracies
    (tests/integration/test_promotion.py write_synthetic_eval)."""
    write_synthetic_eval(root / eval_dir, seed, **accuracy)
    return debug_config(root, f"data.out_dir={data_root / 'data'}", f"train.out_dir={trained / 'train'}",
                        f"eval.out_dir={root / eval_dir}", f"ops.tracking_spool={root / 'spool'}", *overrides)


def register(cfg: Config, force: bool = False) -> str:
    return run_stage(stage_named("register"), cfg, force=force).version


def test_a_registration_cut_off_by_an_outage_is_completed_by_the_rerun(
        tmp_path: Path, trained: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in FAST_FAILING.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = tmp_path / "server"
    server.mkdir()
    cfg = evaluated(tmp_path, trained, data_root, "eval", "a", f"registry.tracking_uri={url}", math=0.3,
                    code=0.3)
    name = cfg.registry.model_name

    # The fault: the server dies just before the version is marked complete -- created, tagged and
    # aliased `candidate`, it looks usable but is not.
    real_set_tag = MlflowClient.set_model_version_tag
    killed = []

    def dies_before_complete(self, model, version, key, value):
        if key == REGISTRATION_TAG and value == COMPLETE and not killed:
            kill(process)
            killed.append(time.monotonic())
        return real_set_tag(self, model, version, key, value)

    with mlflow_server(server, port) as process:
        with monkeypatch.context() as patch:
            patch.setattr(MlflowClient, "set_model_version_tag", dies_before_complete)
            with pytest.raises(RegistrationError) as failure:
                register(cfg)
        waited = time.monotonic() - killed[0]
    message = str(failure.value)
    assert message.startswith(f"the model registry at {url} stopped answering while registering {name} "
                              f"version 1, at setting its tag {REGISTRATION_TAG}={COMPLETE}"), message
    assert f"It stays incomplete ({REGISTRATION_TAG}={INCOMPLETE}), so it is never used" in message
    assert "Rerun the register stage once the registry answers: it completes version 1 instead of " \
           "registering another" in message
    # No retry storm: MLflow's retries of the one failing call (FAST_FAILING), one probe of /health
    # and the stage run's failure, spooled.
    assert waited < 90, f"{waited:.0f} s from the outage to the error"
    assert not (tmp_path / "register" / "registered.json").exists()

    with mlflow_server(server, port):
        client = MlflowClient(url, url)
        [version] = client.search_model_versions(f"name = '{name}'")
        assert str(version.version) == "1" and version.tags[REGISTRATION_TAG] == INCOMPLETE
        assert str(aliased(client, name, CANDIDATE_ALIAS).version) == "1"  # set before the outage
        assert aliased(client, name, CHAMPION_ALIAS) is None
        # Used by nothing: not as a base, nor judged by the gate, nor promoted from @candidate.
        for init_from in (f"models:/{name}@{CANDIDATE_ALIAS}", f"models:/{name}/1"):
            base = debug_config(tmp_path, f"model.init_from={init_from}", f"registry.tracking_uri={url}")
            with pytest.raises(ConfigError, match="version 1 .* is an incomplete registration"):
                resolve_base(base)
        with pytest.raises(IncompleteRegistration, match=f"register stage \\(run {version.run_id}"):
            promote(cfg, client, "1", force=True)
        assert main(["promote", "--config", "debug.yaml", "--set", f"registry.tracking_uri={url}"]) == 2
        assert aliased(client, name, CHAMPION_ALIAS) is None

        # The rerun completes version 1 (the same train and eval outputs: the same key).
        assert register(cfg) == "1"
        [version] = client.search_model_versions(f"name = '{name}'")
        tags = version.tags
        assert tags[REGISTRATION_TAG] == COMPLETE and len(tags[REGISTRATION_KEY_TAG]) == 64
        assert {DATA_VERSION_TAG, "forgeline.checkpoint_step", "eval.overall"} <= tags.keys()
        assert tags[DECISION_TAG] == "promoted: no champion before"
        assert str(aliased(client, name, CANDIDATE_ALIAS).version) == "1"
        assert str(aliased(client, name, CHAMPION_ALIAS).version) == "1"
        champion = debug_config(tmp_path, f"model.init_from=models:/{name}@{CHAMPION_ALIAS}",
                                f"registry.tracking_uri={url}")
        assert resolve_base(champion).model_version == f"{name}/1"

        # A rerun of a complete registration registers nothing, and the gate does not decide again.
        again = run_stage(stage_named("register"), cfg, force=True)
        assert (again.version, again.run_id) == ("1", version.run_id)
        assert again.promotion == f"{name} version 1 was decided on before: promoted: no champion before"
        assert [str(v.version) for v in client.search_model_versions(f"name = '{name}'")] == ["1"]
        assert client.get_model_version(name, "1").tags == tags


def test_a_failure_while_the_registry_answers_leaves_nothing_registered(
        tmp_path: Path, trained: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = register(evaluated(tmp_path, trained, data_root, "eval1", "a", math=0.3, code=0.3))
    cfg = evaluated(tmp_path, trained, data_root, "eval2", "b", math=0.9, code=0.9)
    uri = cfg.registry.tracking_uri
    client = MlflowClient(uri, uri)
    name = cfg.registry.model_name

    real_set_alias = MlflowClient.set_registered_model_alias

    def refuses_the_alias(self, model, alias, version):
        if alias == CANDIDATE_ALIAS and version != first:
            raise MlflowException("the alias is refused (injected)")
        return real_set_alias(self, model, alias, version)

    with monkeypatch.context() as patch:
        patch.setattr(MlflowClient, "set_registered_model_alias", refuses_the_alias)
        with pytest.raises(RegistrationError) as failure:
            register(cfg)
    assert str(failure.value) == (
        f"registering {name} version 2 in the model registry at {uri} failed at setting alias "
        f"@{CANDIDATE_ALIAS} (the alias is refused (injected)); the incomplete version was deleted and "
        f"@{CANDIDATE_ALIAS} is on version {first} as before: nothing was registered. Rerun the register "
        "stage once the cause is fixed")
    assert [str(v.version) for v in client.search_model_versions(f"name = '{name}'")] == [first]
    assert str(aliased(client, name, CANDIDATE_ALIAS).version) == first

    # Fixed, the rerun registers these outputs once, as a new version: version 2 is gone for good.
    assert register(cfg) == "3"
    assert sorted(str(v.version) for v in client.search_model_versions(f"name = '{name}'")) == [first, "3"]
    assert str(aliased(client, name, CANDIDATE_ALIAS).version) == "3"
    assert register(cfg, force=True) == "3"
    assert len(client.search_model_versions(f"name = '{name}'")) == 2


def test_an_outage_while_the_gate_reads_the_items_is_an_error_and_the_rerun_decides(
        tmp_path: Path, trained: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in FAST_FAILING.items():
        monkeypatch.setenv(key, value)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = tmp_path / "server"
    server.mkdir()
    first = evaluated(tmp_path, trained, data_root, "eval1", "a", f"registry.tracking_uri={url}", math=0.3,
                      code=0.3)
    better = evaluated(tmp_path, trained, data_root, "eval2", "b", f"registry.tracking_uri={url}", math=0.9,
                       code=0.9)
    name = first.registry.model_name

    # The fault: a short outage -- the server dies as the gate reads the candidate's items, and is
    # back before a decision could be recorded.
    real_run_items = compare.run_items
    outages = []

    def read_during_an_outage(client, run_id):
        if outages:
            return real_run_items(client, run_id)
        kill(process)
        outages.append(run_id)
        try:
            return real_run_items(client, run_id)
        finally:
            servers.enter_context(mlflow_server(server, port))

    with ExitStack() as servers:
        process = servers.enter_context(mlflow_server(server, port))
        assert register(first) == "1"
        with monkeypatch.context() as patch:
            patch.setattr(compare, "run_items", read_during_an_outage)
            with pytest.raises(RegistrationError) as failure:
                register(better)
        message = str(failure.value)
        assert message.startswith(f"{name} version 2 is registered in the registry at {url} and complete "
                                  f"(@{CANDIDATE_ALIAS}), but the promotion gate could not decide on it ("), \
            message
        assert "no decision was recorded. Rerun the register stage" in message
        client = MlflowClient(url, url)
        assert outages == [client.get_model_version(name, "2").run_id]  # the candidate's items
        assert DECISION_TAG not in client.get_model_version(name, "2").tags
        assert str(aliased(client, name, CHAMPION_ALIAS).version) == "1"

        # The registry answers again: the rerun registers nothing new and decides.
        assert register(better) == "2"
        assert client.get_model_version(name, "2").tags[DECISION_TAG].startswith(
            "promoted: versus version 1; overall +0.")
        assert str(aliased(client, name, CHAMPION_ALIAS).version) == "2"


def test_items_that_did_not_reach_the_store_are_an_error_and_nothing_is_registered(
        tmp_path: Path, trained: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in FAST_FAILING.items():
        monkeypatch.setenv(key, value)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = tmp_path / "server"
    server.mkdir()
    cfg = evaluated(tmp_path, trained, data_root, "eval", "a", f"registry.tracking_uri={url}",
                    "registry.artifact_location=mlflow-artifacts:///forgeline", math=0.3, code=0.3)
    name = cfg.registry.model_name

    # The fault: a short outage of the server, through which artifacts go, while the register stage
    # uploads the eval's items.json; it is back before the version would be registered.
    real_log_artifact = TrackingSpool.log_artifact

    def uploaded_during_an_outage(self, path, *args, **kwargs):
        if Path(path).name != ITEMS_NAME:
            return real_log_artifact(self, path, *args, **kwargs)
        kill(process)
        try:
            return real_log_artifact(self, path, *args, **kwargs)
        finally:
            servers.enter_context(mlflow_server(server, port, proxied=True))

    with ExitStack() as servers:
        process = servers.enter_context(mlflow_server(server, port, proxied=True))
        with monkeypatch.context() as patch:
            patch.setattr(TrackingSpool, "log_artifact", uploaded_during_an_outage)
            with pytest.raises(RegistrationError, match="per-item results did not reach") as failure:
                register(cfg)
        assert "Nothing was registered; rerun the register stage" in str(failure.value)
        client = MlflowClient(url, url)
        assert client.search_model_versions(f"name = '{name}'") == []  # none judged on no items

        # Back: the rerun registers the version with the items the gate reads.
        assert register(cfg) == "1"
        run_id = client.get_model_version(name, "1").run_id
        assert [f.path for f in client.list_artifacts(run_id, "eval")] == [f"eval/{ITEMS_NAME}"]
