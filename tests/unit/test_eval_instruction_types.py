"""IFEval apart on the prompts of trained, held-out and mixed instruction types (#48): a preference
run's gain on the types its pairs trained is told from what generalised, each with the gate's
paired statistics. Through lm-eval's real IFEval run: tests/unit/test_eval_instruction_following.py."""

from __future__ import annotations

import logging
import random

import pytest

from forgeline.configs.schema import DimensionConfig
from forgeline.eval.dimensions import task_score
from forgeline.eval.instruction_types import instruction_types_report, type_group
from forgeline.eval.scores import TaskItems
from forgeline.tasks.evaluate import EvalResult, by_instruction_type

IFEVAL = task_score("forgeline_ifeval")
PLAN = {"instruction_following": ([IFEVAL], DimensionConfig(limit=None))}
TRAINED = ["punctuation:no_comma", "change_case:english_lowercase"]
# Prompts by the types of their instructions: every one trained, none trained, some.
TRAINED_TYPES = [["punctuation:no_comma"], ["change_case:english_lowercase", "punctuation:no_comma"]]
HELD_OUT_TYPES = [["keywords:existence"], ["detectable_format:title", "startend:quotation"]]
MIXED_TYPES = [["punctuation:no_comma", "keywords:existence"]]


def ifeval_items(values: list[bool], types: list[list[str]]) -> TaskItems:
    return TaskItems(ids=[f"prompt-{i}" for i in range(len(values))], values=values, instruction_types=types)


@pytest.fixture(scope="module")
def taught() -> tuple[TaskItems, TaskItems]:
    """A run and its base on 60 prompts of trained types, 50 of held-out and 10 mixed: the base
    follows none of the trained ones and the run 30 of them; elsewhere they answer alike."""
    rng = random.Random(0)
    types = [TRAINED_TYPES[i % 2] for i in range(60)] + [HELD_OUT_TYPES[i % 2] for i in range(50)] + \
        MIXED_TYPES * 10
    elsewhere = [rng.random() < 0.3 for _ in range(60)]
    base = ifeval_items([False] * 60 + elsewhere, types)
    run = ifeval_items([i < 30 for i in range(60)] + elsewhere, types)
    return run, base


def test_a_prompt_is_trained_when_every_type_is_held_out_when_none_and_mixed_otherwise() -> None:
    trained = set(TRAINED)
    assert [type_group(types, trained) for types in (*TRAINED_TYPES, *HELD_OUT_TYPES, *MIXED_TYPES)] == [
        "trained", "trained", "held_out", "held_out", "mixed"]


def test_a_gain_on_trained_types_only_is_significant_there_and_nowhere_else(
        taught: tuple[TaskItems, TaskItems]) -> None:
    run, base = taught
    section = instruction_types_report(IFEVAL, run, base, TRAINED)
    trained, held_out, mixed = section["trained"], section["held_out"], section["mixed"]
    assert (trained["prompts"], held_out["prompts"], mixed["prompts"]) == (60, 50, 10)
    assert trained["score"] == 0.5 and trained["base"]["score"] == 0.0
    change = trained["versus_base"]
    assert change["difference"] == 0.5 and change["p_value"] < 0.001 and change["ci95"][0] > 0
    for entry in (held_out, mixed):  # the same answers: no change, nothing to reject
        assert entry["score"] == entry["base"]["score"]
        assert entry["versus_base"]["difference"] == 0.0 and entry["versus_base"]["p_value"] == 1.0
    assert held_out["score"] == pytest.approx(sum(run.values[60:110]) / 50)
    assert section["types"] == {"trained": sorted(TRAINED), "held_out": [
        "detectable_format:title", "keywords:existence", "startend:quotation"]}


def test_without_a_base_the_groups_have_the_runs_scores_only(taught: tuple[TaskItems, TaskItems]) -> None:
    run, _ = taught
    section = instruction_types_report(IFEVAL, run, None, TRAINED)
    assert section["trained"] == {"prompts": 60, "score": 0.5, "stderr": pytest.approx(0.0651, abs=1e-4),
                                  "ci95": pytest.approx([0.5 - 1.959964 * 0.0651, 0.5 + 1.959964 * 0.0651],
                                                        abs=1e-3)}


def stage_result() -> EvalResult:
    return EvalResult(out_dir="eval", checkpoint="step-00000010", overall=0.1,
                      dimensions={"instruction_following": 0.1}, metrics={"overall": 0.1})


def test_the_eval_stage_reports_the_groups_in_report_json_metrics_and_under_the_table(
        taught: tuple[TaskItems, TaskItems]) -> None:
    run, base = taught
    report: dict = {}
    result = by_instruction_type(stage_result(), report, PLAN, {IFEVAL.task: run}, {IFEVAL.task: base},
                                 TRAINED)
    section = report["instruction_types"]
    assert result.instruction_types == section
    metrics = result.metrics
    assert metrics["instruction_following/trained_types"] == 0.5
    assert metrics["base/instruction_following/trained_types"] == 0.0
    assert metrics["versus_base/instruction_following/trained_types"] == 0.5
    assert metrics["versus_base/p_value/instruction_following/trained_types"] < 0.001
    assert metrics["versus_base/instruction_following/held_out_types"] == 0.0
    assert (metrics["prompts/instruction_following/trained_types"],
            metrics["prompts/instruction_following/held_out_types"],
            metrics["prompts/instruction_following/mixed_types"]) == (60, 50, 10)
    assert metrics["stderr/instruction_following/held_out_types"] == section["held_out"]["stderr"]
    assert metrics["overall"] == 0.1  # the rest as it was
    lines = result.markdown().split("\n\n")[1].splitlines()
    assert lines[0] == "IFEval prompt_level_strict_acc by instruction type (2 types trained, 3 held out):"
    low, high = section["trained"]["versus_base"]["ci95"]
    assert lines[1] == (f"- every type trained: 60 prompts, 0.500 ± 0.128; base 0.000 ± 0.000, change +0.500 "
                        f"(95 % interval {low:+.3f} to {high:+.3f}, p 0.0001)")
    assert lines[2].startswith("- no type trained: 50 prompts, ")
    assert lines[3].startswith("- some types trained: 10 prompts, ")


def test_a_group_without_prompts_has_no_scores(taught: tuple[TaskItems, TaskItems]) -> None:
    run, base = taught
    report: dict = {}
    # Lowercase untrained: the trained group's prompts that also ask for it are mixed now.
    by_instruction_type(stage_result(), report, PLAN, {IFEVAL.task: run}, {IFEVAL.task: base},
                        ["punctuation:no_comma"])
    assert report["instruction_types"]["trained"]["prompts"] == 30
    assert report["instruction_types"]["mixed"]["prompts"] == 40
    result = by_instruction_type(stage_result(), report, PLAN, {IFEVAL.task: run}, {IFEVAL.task: base},
                                 ["language:response_language"])  # a type none of these prompts has
    assert report["instruction_types"]["trained"] == {
        "prompts": 0, "score": None, "stderr": None, "ci95": None,
        "base": {"score": None, "stderr": None, "ci95": None},
        "versus_base": {"difference": None, "stderr": None, "ci95": None, "p_value": None}}
    assert "instruction_following/trained_types" not in result.metrics
    assert result.metrics["prompts/instruction_following/trained_types"] == 0
    assert "- every type trained: no prompts" in result.markdown()


def test_a_plan_without_ifeval_is_left_as_it_is_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    lambada = task_score("forgeline_lambada")
    plan = {"language_modeling": ([lambada], DimensionConfig())}
    items = {lambada.task: TaskItems(ids=["a", "b"], values=[1.0, 0.0])}
    report: dict = {}
    with caplog.at_level(logging.WARNING):
        result = by_instruction_type(stage_result(), report, plan, items, None, TRAINED)
    assert result == stage_result() and report == {}
    assert "IFEval is not evaluated" in caplog.text
