"""The register stage's Prefect artifact, read back from a real sqlite registry holding a
decision as the promotion gate records it (tasks/promote.py's own functions make the tags): the
version, the aliases and what moved, the decision and the per-dimension intervals against the
champion it faced."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient

from forgeline.configs import Config
from forgeline.flows.reports import registration_markdown
from forgeline.tasks.promote import (
    CHAMPION_ALIAS,
    DECISION_TAG,
    PROMOTED,
    REJECTED,
    Decision,
    evidence_tags,
)
from forgeline.tasks.register import CANDIDATE_ALIAS, RegisterResult

COMPARISON = {  # candidate minus champion, as tasks/compare.py's paired comparison has it
    "overall": 0.012, "overall_ci95": [-0.004, 0.028], "overall_p_value": 0.2, "margin": 0.0,
    "shared_items": {"hellaswag": 30, "mmlu": 20},
    "dimensions": {"reasoning": {"difference": 0.021, "ci95": [0.013, 0.029], "p_value": 0.001},
                   "knowledge": {"difference": -0.03, "ci95": [-0.041, -0.019], "p_value": 0.002}},
}


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sqlite store with MLflow's schema, created once (its migrations take seconds)."""
    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def registry(tmp_path: Path, empty_store: Path) -> tuple[Config, MlflowClient]:
    shutil.copy(empty_store, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri, uri)
    client.create_registered_model("m")
    for _ in range(2):
        client.create_model_version("m", str(tmp_path))
    return Config().with_values({"registry.tracking_uri": uri, "registry.model_name": "m"}), client


def decided(client: MlflowClient, decision: Decision, champion: str) -> RegisterResult:
    """Version 2 with `decision` recorded as the gate records it, `champion` aliased."""
    for key, value in (evidence_tags(COMPARISON, "1", "") | {DECISION_TAG: decision.record()}).items():
        client.set_model_version_tag("m", "2", key, value)
    client.update_model_version("m", "2", description=decision.one_line())
    client.set_registered_model_alias("m", CANDIDATE_ALIAS, "2")
    client.set_registered_model_alias("m", CHAMPION_ALIAS, champion)
    return RegisterResult(run_id="abc", model_name="m", version="2", model_uri="models:/m/2",
                          promotion=decision.describe())


def test_a_rejected_version_reports_its_intervals_against_the_champion(registry) -> None:
    cfg, client = registry
    decision = Decision("m", "2", "1", REJECTED, ["worse on knowledge"],
                        gist="worse on knowledge (-0.030 ± 0.011)")
    markdown = registration_markdown(cfg, decided(client, decision, champion="1"))
    assert markdown.startswith("## m version 2: rejected\n")
    assert "- decision: rejected against champion version 1: worse on knowledge (-0.030 ± 0.011)" in markdown
    assert "- aliases now: @candidate -> v2, @champion -> v1" in markdown
    assert "- alias moves: @candidate -> v2, @champion stays at v1" in markdown
    assert "Candidate minus champion (version 1), with the 95 % interval, on 50 shared items" in markdown
    assert "| **overall** | +0.0120 [-0.0040, +0.0280] |" in markdown
    assert "| reasoning | +0.0210 [+0.0130, +0.0290] |" in markdown
    assert "| knowledge | -0.0300 [-0.0410, -0.0190] |" in markdown


def test_a_promotion_names_the_champion_it_replaced(registry) -> None:
    cfg, client = registry
    decision = Decision("m", "2", "1", PROMOTED, ["better on reasoning"], gist="better on reasoning")
    markdown = registration_markdown(cfg, decided(client, decision, champion="2"))
    assert markdown.startswith("## m version 2: promoted\n")
    assert "- alias moves: @candidate -> v2, @champion -> v2 (from v1)" in markdown
