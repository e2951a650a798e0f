"""A dimension's `chat` setting (configs/schema.py DimensionConfig): refused where nothing could
go through a chat template, part of what caches the eval stage and pairs two evaluations. The
prompts each setting gives the model: tests/unit/test_eval_instruction_following.py."""

from __future__ import annotations

import pytest

from forgeline.configs import Config, load_config
from forgeline.configs.schema import DimensionConfig
from forgeline.eval.dimensions import task_score
from forgeline.eval.scores import TaskItems
from forgeline.tasks.evaluate import EvaluatedItems, plan_record, plan_tasks
from forgeline.tasks.stage import stage_named


def test_chat_true_without_a_fine_tuned_tokenizer_is_refused_at_config_time_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"eval\.dimensions\.math\.chat=true .* \(set the `sft` section\)"):
        Config().with_values({"eval.dimensions": {"math": {"chat": True}}})
    Config().with_values({"eval.dimensions": {"math": {"chat": False}}})  # a completion model's way: fine


def test_chat_true_on_a_dimension_that_generates_nothing_is_refused_before_any_model_loads() -> None:
    cfg = load_config("configs/smollm2-sft.yaml")
    refused = r"eval\.dimensions\.reasoning\.chat=true, but .* score log-likelihoods"
    with pytest.raises(ValueError, match=refused):
        plan_tasks(cfg.with_values({"eval.dimensions": {"reasoning": {"chat": True}}}).eval)
    plan = plan_tasks(cfg.with_values({"eval.dimensions": {"math": {"chat": True}}}).eval)
    assert plan["math"][1].chat is True


def test_the_setting_is_in_the_eval_stages_cache_key() -> None:
    """The stage's config key is the hash of its sections (tasks/cache.py stage_inputs)."""
    assert "eval" in stage_named("eval").sections
    default, plain = (Config().with_values({"eval.dimensions": {"math": {"chat": chat}}})
                      for chat in (None, False))
    assert default.section_hash("eval") != plain.section_hash("eval")
    assert plain.flat()["eval.dimensions.math.chat"] == "False"  # the eval run's MLflow param (runner)


def test_evaluations_asked_otherwise_do_not_pair() -> None:
    """A base's cached scores are keyed by the plan record, which holds the setting; two item
    records of different settings are said not to pair."""
    gsm8k = task_score("forgeline_gsm8k")
    items = {"forgeline_gsm8k": TaskItems(ids=["a", "b"], values=[1.0, 0.0])}
    as_completion, as_assistant = (
        EvaluatedItems("suite", plan_record({"math": ([gsm8k], DimensionConfig(limit=2, chat=chat))}), items)
        for chat in (False, True))
    assert as_completion.plan != as_assistant.plan
    assert as_completion.unpaired(as_assistant) == [
        "math's generative tasks were asked with chat=False, not True"]
    assert as_assistant.eval_plan()["math"][1].chat is True


def test_the_generative_tasks_are_those_lm_eval_asks_to_generate(tmp_path) -> None:
    """TaskScore.generative, which decides what goes through the template, agrees with each
    rendered task's lm-eval output_type."""
    from lm_eval.tasks._yaml_loader import load_yaml

    from forgeline.eval.dimensions import DIMENSION_TASKS
    from forgeline.eval.suite import render_suite

    suite = render_suite(tmp_path / "suite", tmp_path / "data")
    for score in (score for scores in DIMENSION_TASKS.values() for score in scores):
        config = load_yaml(suite / f"{score.task}.yaml", resolve_func=False, recursive=True)
        assert score.generative == (config["output_type"] == "generate_until"), score.task
