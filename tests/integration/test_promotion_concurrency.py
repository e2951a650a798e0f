"""Four registrations decided at once, each in its own process, against a real sqlite store and a
real `mlflow server`: the decisions are serialized (tasks/promote.py, the promotion lock), so the
champion ends where the gate's rules put it and every version's decision names the champion it
was compared with -- one history, as if they had been decided one after the other.

The candidates carry synthetic per-item results of a known order: version k answers the first
RIGHT[k] of 150 items of each task right, so of two versions the one with more right answers is
significantly better on every dimension, and the gate promotes it over the other and rejects the
other against it, whatever the order they come in. Each process's decision is slowed by a second
(as evaluating the champion on the candidate's items would), so that all four read the champion
before any moves it: without the lock each was compared with version 1 and promoted over it, and
the alias ended on the last writer's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from mlflow import MlflowClient

from forgeline.configs import Config
from forgeline.tasks.pretrained import COMPLETE, REGISTRATION_TAG
from forgeline.tasks.promote import CHAMPION_ALIAS, DECISION_TAG, EVIDENCE_TAG_PREFIX, promote
from forgeline.tasks.tracking import prepare_sqlite_store
from tests.integration.helpers import free_port, user_env
from tests.integration.test_promotion import PLAN
from tests.integration.test_tracking_outage import mlflow_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RIGHT = {"1": 30, "2": 90, "3": 120, "4": 60, "5": 75}  # version -> right answers of 150 per task
CANDIDATES = ["2", "3", "4", "5"]
BEST = max(CANDIDATES, key=RIGHT.get)

WORKER = r"""
import pathlib, sys, time
from forgeline.configs.environment import apply_environment_defaults
apply_environment_defaults()
from mlflow import MlflowClient
from forgeline.configs import Config
from forgeline.tasks import promote as gate

uri, version, ready, go = sys.argv[1:]
decide = gate.paired_comparison

def slow_decision(*args, **kwargs):
    time.sleep(1.0)
    return decide(*args, **kwargs)

gate.paired_comparison = slow_decision
cfg = Config().with_values({"registry.tracking_uri": uri, "registry.model_name": "m"})
client = MlflowClient(uri, uri)
pathlib.Path(ready).touch()
while not pathlib.Path(go).exists():
    time.sleep(0.01)
print(gate.promote(cfg, client, version).describe(), flush=True)
"""


@contextmanager
def registry(kind: str, root: Path) -> Iterator[str]:
    """The URI of a fresh registry of `kind`: a sqlite store, or a tracking server over one."""
    if kind == "sqlite":
        uri = f"sqlite:///{root / 'mlflow.db'}"
        prepare_sqlite_store(uri)
        yield uri
        return
    port = free_port()
    with mlflow_server(root, port):
        yield f"http://127.0.0.1:{port}"


def nested_items(right: int) -> dict:
    """An eval's items.json: the first `right` of 150 items of each task of PLAN answered right."""
    items = {entry["tasks"][0]: {"metric": "exact_match", "aggregation": "mean",
                                 "ids": [f"item-{i}" for i in range(150)],
                                 "values": [float(i < right) for i in range(150)]}
             for entry in PLAN.values()}
    return {"suite": {"fingerprint": "synthetic", "plan": PLAN}, "model": items}


def register_versions(client: MlflowClient) -> None:
    """Model `m`, one complete version per RIGHT entry, each with its run's eval/items.json."""
    experiment = client.create_experiment("concurrent-promotions")
    client.create_registered_model("m")
    for version, right in RIGHT.items():
        run_id = client.create_run(experiment).info.run_id
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / "items.json"
            path.write_text(json.dumps(nested_items(right)))
            client.log_artifact(run_id, str(path), "eval")
        client.set_terminated(run_id)
        created = client.create_model_version("m", f"runs:/{run_id}/eval", run_id=run_id,
                                              tags={REGISTRATION_TAG: COMPLETE})
        assert str(created.version) == version


def promote_at_once(uri: str, root: Path) -> list[str]:
    """`promote` of every candidate, each in its own process, released together once all are
    ready; what each printed."""
    ready = [root / f"ready-{version}" for version in CANDIDATES]
    go = root / "go"
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, uri, version, str(flag), str(go)],
                                env=user_env(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for version, flag in zip(CANDIDATES, ready, strict=True)]
    try:
        deadline = time.monotonic() + 300
        while not all(flag.exists() for flag in ready):
            assert all(w.poll() is None for w in workers), [w.communicate()[1][-3000:] for w in workers]
            assert time.monotonic() < deadline, "the workers did not start within 300 s"
            time.sleep(0.1)
        go.touch()
        outputs = [w.communicate(timeout=300) for w in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    for worker, (_, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err[-6000:]
    return [out.strip() for out, _ in outputs]


def decision(client: MlflowClient, version: str) -> tuple[str, str]:
    """The outcome recorded on `version` and the version it names as the champion it was compared
    with (its evidence says the same)."""
    tags = client.get_model_version("m", version).tags
    found = re.match(r"(promoted|rejected|inconclusive): versus version (\d+); ", tags.get(DECISION_TAG, ""))
    assert found, f"version {version}: {tags}"
    assert tags[EVIDENCE_TAG_PREFIX + "versus"] == f"version {found[2]}"
    return found[1], found[2]


@pytest.mark.parametrize("kind", ["sqlite", "server"])
def test_four_registrations_at_once_end_as_one_history(kind: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root, ./mlruns, of the store and the server
    with registry(kind, tmp_path) as uri:
        client = MlflowClient(uri, uri)
        register_versions(client)
        cfg = Config().with_values({"registry.tracking_uri": uri, "registry.model_name": "m"})
        assert promote(cfg, client, "1").promoted
        assert client.get_model_version("m", "1").tags[DECISION_TAG] == "promoted: no champion before"

        printed = promote_at_once(uri, tmp_path)

        decisions = {version: decision(client, version) for version in CANDIDATES}
        champion = str(client.get_model_version_by_alias("m", CHAMPION_ALIAS).version)
        assert sorted(model.name for model in client.search_registered_models()) == ["m"]  # no lock left
    # The gate's rules on each pair: the one with more right answers is promoted over the other.
    for version, (outcome, versus) in decisions.items():
        assert outcome == ("promoted" if RIGHT[version] > RIGHT[versus] else "rejected"), decisions
    # One history: each promotion replaced the champion before it, from version 1 to the last.
    successor = {versus: version for version, (outcome, versus) in decisions.items() if outcome == "promoted"}
    promoted = [version for version, (outcome, _) in decisions.items() if outcome == "promoted"]
    assert len(successor) == len(promoted), f"two promotions over one champion: {decisions}"
    history = ["1"]
    while history[-1] in successor:
        history.append(successor[history[-1]])
    assert sorted(history[1:]) == sorted(promoted), decisions
    assert all(versus in history for _, versus in decisions.values()), decisions
    assert champion == history[-1] == BEST, (printed, decisions)
