"""Scoring: chance normalization, dimension and overall aggregation, the task plan."""

import pytest

from forgeline.configs import load_config
from forgeline.eval.dimensions import DIMENSIONS, TaskScore
from forgeline.tasks.evaluate import aggregate, flatten_scores, normalized, plan_tasks

ACC = TaskScore(task="mc", metric="acc", chance=0.25, best=1.0)
BPB = TaskScore(task="lm", metric="bits_per_byte", chance=8.0, best=0.0)


def test_normalization_puts_chance_at_zero_and_best_at_one_in_either_direction() -> None:
    assert normalized(0.25, ACC) == 0 and normalized(1.0, ACC) == 1 and normalized(0.625, ACC) == 0.5
    assert normalized(8.0, BPB) == 0 and normalized(0.0, BPB) == 1 and normalized(2.0, BPB) == 0.75
    assert normalized(0.1, ACC) < 0  # below chance stays visible


def test_dimensions_average_their_tasks_and_overall_averages_dimensions() -> None:
    raw = {"mc/acc": 0.625, "lm/bits_per_byte": 2.0, "other/acc": 0.25}
    other = TaskScore(task="other", metric="acc", chance=0.25, best=1.0)
    report = aggregate(raw, {"reasoning": [ACC, other], "language_modeling": [BPB]})
    assert report["dimensions"]["reasoning"]["score"] == pytest.approx(0.25)
    assert report["dimensions"]["language_modeling"]["tasks"]["lm"]["normalized"] == pytest.approx(0.75)
    assert report["overall"] == pytest.approx(0.5)


def test_a_missing_registered_metric_is_an_error_not_a_zero() -> None:
    with pytest.raises(KeyError, match="mc/acc is not among the results"):
        aggregate({"mc/acc_norm": 0.3}, {"reasoning": [ACC]})


def test_lm_eval_results_are_flattened_without_stderr_or_aliases() -> None:
    results = {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "exact_match,strict-match": 0.2}}
    assert flatten_scores(results) == {"t/acc": 0.5, "t/exact_match/strict-match": 0.2}


def test_every_dimension_is_registered_and_the_default_plan_covers_it() -> None:
    assert set(DIMENSIONS) == {"reasoning", "knowledge", "math", "code", "safety", "language_modeling"}
    plan = plan_tasks(load_config("tiny.yaml").eval)
    assert set(plan) == set(DIMENSIONS) and all(scores for scores, _ in plan.values())


def test_a_task_outside_its_dimension_is_refused_before_any_work() -> None:
    cfg = load_config("tiny.yaml", ["eval.dimensions={math: {tasks: [forgeline_arc_easy]}}"])
    expected = r"eval.dimensions.math.tasks: \['forgeline_arc_easy'\] are not math tasks"
    with pytest.raises(ValueError, match=expected):
        plan_tasks(cfg.eval)
