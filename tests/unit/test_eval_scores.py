"""Scoring: chance normalization, dimension and overall aggregation, the task plan."""

import math
import random
from pathlib import Path

import lm_eval
import numpy as np
import pytest
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml  # reads `!function` tags unresolved

import forgeline.eval
from forgeline.configs import load_config
from forgeline.configs.schema import EvalConfig
from forgeline.eval.dimensions import DIMENSION_TASKS, TaskScore
from forgeline.eval.scores import (
    AGGREGATIONS,
    AGGREGATIONS_OF_SUMS,
    Z95,
    TaskItems,
    aggregate,
    detectable_difference,
    flatten_scores,
    holm,
    normalized,
    paired_comparison,
    paired_difference,
    stderr_metrics,
)
from forgeline.tasks.evaluate import check_task_source, plan_tasks

ACC = TaskScore(task="mc", metric="acc", chance=0.25, best=1.0)
BPB = TaskScore(task="lm", metric="bits_per_byte", chance=8.0, best=0.0)
BPB_ITEMS = TaskScore(task="lm", metric="bits_per_byte", chance=8.0, best=0.0, aggregation="bits_per_byte")


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


def test_a_means_stderr_is_the_closed_form_and_others_are_bootstrapped() -> None:
    accuracy = TaskItems(ids=["a", "b", "c", "d"], values=[1.0, 0.0, 1.0, 1.0])
    assert accuracy.value(ACC) == 0.75
    assert accuracy.stderr(ACC) == pytest.approx(math.sqrt(0.75 / 3) / 2)  # sample std / sqrt(n)
    rng = random.Random(0)
    pairs = [(-rng.uniform(50, 150), rng.randint(100, 300)) for _ in range(200)]  # (log-likelihood, bytes)
    bpb_items = TaskItems(ids=[str(i) for i in range(200)], values=pairs)
    expected = -sum(ll for ll, _ in pairs) / sum(b for _, b in pairs) / math.log(2)
    assert bpb_items.value(BPB_ITEMS) == pytest.approx(expected)
    # The delta method's error of a ratio of sums, which the bootstrap should approach.
    ratio = sum(ll for ll, _ in pairs) / sum(b for _, b in pairs)
    residuals = [ll - ratio * b for ll, b in pairs]
    delta = math.sqrt(sum(r * r for r in residuals) / 199) / (sum(b for _, b in pairs) / 200) / math.sqrt(200)
    assert bpb_items.stderr(BPB_ITEMS) == pytest.approx(delta / math.log(2), rel=0.15)
    assert TaskItems(ids=["a"], values=[1.0]).stderr(ACC) is None


def test_intervals_propagate_through_normalization_and_averaging() -> None:
    raw = {"mc/acc": 0.625, "other/acc": 0.25, "lm/bits_per_byte": 2.0}
    other = TaskScore(task="other", metric="acc", chance=0.25, best=1.0)
    stderrs = {"mc/acc": 0.03, "other/acc": 0.06, "lm/bits_per_byte": 0.4}
    report = aggregate(raw, {"reasoning": [ACC, other], "language_modeling": [BPB]}, stderrs)
    reasoning = report["dimensions"]["reasoning"]
    assert reasoning["tasks"]["mc"]["normalized_stderr"] == pytest.approx(0.04)  # / (1 - 0.25)
    assert reasoning["stderr"] == pytest.approx(math.sqrt(0.04 ** 2 + 0.08 ** 2) / 2)
    assert report["dimensions"]["language_modeling"]["stderr"] == pytest.approx(0.05)  # / |0 - 8|
    assert report["overall_stderr"] == pytest.approx(math.sqrt(reasoning["stderr"] ** 2 + 0.05 ** 2) / 2)
    low, high = report["overall_ci95"]
    assert (low + high) / 2 == pytest.approx(report["overall"]) and high - low == pytest.approx(
        2 * Z95 * report["overall_stderr"])
    flat = stderr_metrics(report)
    assert flat["stderr/mc/acc"] == 0.03 and flat["stderr/dimension/reasoning"] == reasoning["stderr"]
    partial = aggregate(raw, {"reasoning": [ACC, other]}, {"mc/acc": 0.03})  # other/acc has none
    assert partial["dimensions"]["reasoning"]["stderr"] is None


def test_about_95_percent_of_the_intervals_cover_the_true_accuracy() -> None:
    """Repeated draws of 200 items of a task with a true accuracy of 0.6: the score's 95 %
    interval contains 0.6 about 95 % of the time (2,000 draws: within 3 points)."""
    rng = random.Random(0)
    covered = 0
    for _ in range(2000):
        items = TaskItems(ids=[], values=[float(rng.random() < 0.6) for _ in range(200)])
        value, se = items.value(ACC), items.stderr(ACC)
        covered += value - Z95 * se <= 0.6 <= value + Z95 * se
    assert abs(covered / 2000 - 0.95) <= 0.03


def test_a_true_difference_of_the_detectable_size_is_found_about_80_percent_of_the_time() -> None:
    """Two models of accuracy 0.6 and 0.6 + d on 400 items, d the minimum detectable difference of
    their paired standard error: the paired 95 % interval lies above 0 in about 80 % of 1,000
    draws (within 4 points)."""
    rng = random.Random(0)
    n, p = 400, 0.6
    d = detectable_difference(math.sqrt(2 * p * (1 - p) / n))  # p(1-p) barely moves with d
    found = 0
    for _ in range(1000):
        ids = [str(i) for i in range(n)]
        champion = TaskItems(ids=ids, values=[float(rng.random() < p) for _ in range(n)])
        candidate = TaskItems(ids=ids, values=[float(rng.random() < p + d) for _ in range(n)])
        paired = paired_difference(candidate, champion, ACC)
        found += paired["difference"] - Z95 * paired["stderr"] > 0
    assert abs(found / 1000 - 0.80) <= 0.04


def correlated_pair(rng: random.Random, n: int) -> tuple[TaskItems, TaskItems]:
    """Model a right with probability 0.6; model b answers as a on 90 % of the items and guesses
    (0.5) on the rest: accuracy 0.59, a true difference of 0.01, strongly paired."""
    a = [float(rng.random() < 0.6) for _ in range(n)]
    b = [x if rng.random() < 0.9 else float(rng.random() < 0.5) for x in a]
    ids = [f"{i:016x}" for i in range(n)]
    return TaskItems(ids=ids, values=a), TaskItems(ids=ids, values=b)


def test_about_95_percent_of_the_paired_intervals_cover_the_true_difference() -> None:
    rng = random.Random(1)
    covered, paired_wider = 0, 0
    for _ in range(2000):
        a, b = correlated_pair(rng, 200)
        paired = paired_difference(a, b, ACC)
        covered += abs(paired["difference"] - 0.01) <= Z95 * paired["stderr"]
        paired_wider += paired["stderr"] >= math.hypot(a.stderr(ACC), b.stderr(ACC))
    assert abs(covered / 2000 - 0.95) <= 0.03
    assert paired_wider == 0  # pairing removes the items' shared difficulty from the error


def test_a_paired_difference_matches_items_by_id_and_counts_the_shared_ones() -> None:
    a = TaskItems(ids=["x", "y", "z", "y"], values=[1.0, 1.0, 0.0, 0.0])
    b = TaskItems(ids=["y", "w", "x"], values=[0.0, 1.0, 1.0])  # y's first occurrence, x; not w, z
    paired = paired_difference(a, b, ACC)
    assert paired["shared"] == 2 and paired["difference"] == pytest.approx(0.5)  # (1 + 1)/2 - (1 + 0)/2
    assert paired_difference(a, TaskItems(ids=["q"], values=[1.0]), ACC) == {
        "difference": None, "stderr": None, "shared": 0}
    rng = random.Random(0)
    pairs = [(-rng.uniform(50, 150), rng.randint(100, 300)) for _ in range(50)]
    same = TaskItems(ids=[str(i) for i in range(50)], values=pairs)
    assert paired_difference(same, same, BPB_ITEMS) == {"difference": 0.0, "stderr": 0.0, "shared": 50}


def test_a_paired_comparison_normalizes_and_combines_like_the_scores() -> None:
    rng = random.Random(2)
    a_mc, b_mc = correlated_pair(rng, 100)
    pairs = [(-rng.uniform(50, 150), rng.randint(100, 300)) for _ in range(40)]
    worse = [(ll * 1.1, b) for ll, b in pairs]  # 10 % more bits per byte
    ids = [str(i) for i in range(40)]
    a = {"mc": a_mc, "lm": TaskItems(ids=ids, values=pairs)}
    b = {"mc": b_mc, "lm": TaskItems(ids=ids, values=worse)}
    comparison = paired_comparison(a, b, {"reasoning": [ACC], "language_modeling": [BPB_ITEMS]})
    lm = comparison["dimensions"]["language_modeling"]
    assert lm["difference"] > 0  # fewer bits per byte is better: a positive normalized change
    assert lm["tasks"]["lm"]["difference"] < 0 and lm["difference"] == pytest.approx(
        lm["tasks"]["lm"]["difference"] / -8.0)
    reasoning = comparison["dimensions"]["reasoning"]["difference"]
    assert comparison["overall"] == pytest.approx((reasoning + lm["difference"]) / 2)
    assert comparison["shared_items"] == {"mc": 100, "lm": 40}
    low, high = comparison["overall_ci95"]
    assert low < comparison["overall"] < high  # the swap test's interval, about the difference
    assert (high - low) / 2 == pytest.approx(Z95 * comparison["overall_stderr"], rel=0.25)


def test_a_missing_registered_metric_is_an_error_not_a_zero() -> None:
    with pytest.raises(KeyError, match="mc/acc is not among the results"):
        aggregate({"mc/acc_norm": 0.3}, {"reasoning": [ACC]})


def test_lm_eval_results_are_flattened_without_stderr_or_aliases() -> None:
    results = {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "exact_match,strict-match": 0.2}}
    assert flatten_scores(results) == {"t/acc": 0.5, "t/exact_match/strict-match": 0.2}


def test_every_dimension_is_registered_and_the_default_plan_covers_it() -> None:
    assert set(DIMENSION_TASKS) == {"reasoning", "knowledge", "math", "code", "safety", "language_modeling",
                                    "instruction_following"}
    plan = plan_tasks(EvalConfig())
    assert set(plan) == set(DIMENSION_TASKS) and all(scores for scores, _ in plan.values())


def test_a_task_outside_its_dimension_is_refused_before_any_work() -> None:
    cfg = load_config("tiny.yaml", ["eval.dimensions={math: {tasks: [forgeline_arc_easy]}}"])
    expected = r"eval.dimensions.math.tasks: \['forgeline_arc_easy'\] are not math tasks"
    with pytest.raises(ValueError, match=expected):
        plan_tasks(cfg.eval)


def included_builtin_task(task: str) -> str | None:
    """The `task:` of the lm-eval file a packaged task YAML includes (None for a template)."""
    suite = Path(forgeline.eval.__file__).parent / "tasks"
    include = load_yaml(suite / f"{task}.yaml", resolve_func=False, recursive=False)["include"]
    builtin = Path(lm_eval.__file__).parent / "tasks" / include.removeprefix("${LM_EVAL_TASKS}/")
    return load_yaml(builtin, resolve_func=False, recursive=False).get("task")


def test_hub_source_runs_lm_evals_standard_task_of_the_same_benchmark() -> None:
    packaged = plan_tasks(EvalConfig())  # every dimension
    hub = plan_tasks(EvalConfig(task_source="hub"))
    standard = set(TaskManager().all_tasks)
    for name, (scores, _) in packaged.items():
        for local, remote in zip(scores, hub[name][0], strict=True):
            assert (remote.metric, remote.chance, remote.best) == (local.metric, local.chance, local.best)
            if local.hub_task is None:  # held-out text, code and safety stay packaged
                assert remote.task == local.task and name in ("code", "safety", "language_modeling")
                continue
            assert remote.task == local.hub_task and remote.task in standard
            # The packaged task is the standard one pointed at local data: same prompt, same metric.
            assert included_builtin_task(local.task) in (local.hub_task, None)


def test_hub_source_is_refused_while_the_hub_is_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    hub = load_config("tiny.yaml", ["eval.task_source=hub"]).eval
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    with pytest.raises(ValueError, match="run with HF_HUB_OFFLINE=0 or use eval.task_source=packaged"):
        check_task_source(hub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    check_task_source(hub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_task_source(load_config("tiny.yaml").eval)  # packaged needs nothing


MATH = TaskScore(task="forgeline_gsm8k", metric="exact_match", chance=0.0, best=1.0)


def test_three_discordant_items_of_ten_all_worse_are_not_significantly_worse() -> None:
    """Issue 43: the normal interval of this difference, [-0.599, -0.0006], called it worse; the
    exact sign test on its 3 discordant items gives p = 2 / 8."""
    ids = [str(i) for i in range(10)]
    candidate = TaskItems(ids, [0.0] * 3 + [1.0] * 3 + [0.0] * 4)
    champion = TaskItems(ids, [1.0] * 3 + [1.0] * 3 + [0.0] * 4)
    math_dimension = paired_comparison({MATH.task: candidate}, {MATH.task: champion},
                                       {"math": [MATH]})["dimensions"]["math"]
    assert math_dimension["difference"] == pytest.approx(-0.3)
    assert math_dimension["p_value"] == 0.25
    low, high = math_dimension["ci95"]
    assert low < 0 <= high


def test_the_swap_test_is_exact_where_few_items_differ_and_seeded_otherwise() -> None:
    """Seven of 200 items better and none worse: p = 2 / 2**7 exactly; 60 better of 200: the
    seeded permutation p-value, the same on every call."""
    ids = [str(i) for i in range(200)]
    champion = TaskItems(ids, [0.0] * 200)
    seven = paired_comparison({MATH.task: TaskItems(ids, [1.0] * 7 + [0.0] * 193)}, {MATH.task: champion},
                              {"math": [MATH]})
    assert seven["dimensions"]["math"]["p_value"] == pytest.approx(2 / 2 ** 7)
    rng = random.Random(3)
    noisy = TaskItems(ids, [float(rng.random() < 0.3) for _ in ids])
    first, again = (paired_comparison({MATH.task: noisy}, {MATH.task: champion}, {"math": [MATH]})
                    for _ in range(2))
    assert first == again and first["overall_p_value"] < 1e-3


def test_a_clustered_stderr_is_wider_when_the_items_of_a_cluster_agree() -> None:
    """Five questions on each of 20 passages, answered alike within a passage: 20 independent
    observations, not 100. The clustered error is about sqrt(5) times the unclustered one."""
    rng = random.Random(4)
    per_passage = [float(rng.random() < 0.5) for _ in range(20)]
    values = [answer for answer in per_passage for _ in range(5)]
    ids = [str(i) for i in range(100)]
    passages = [f"passage-{i // 5}" for i in range(100)]
    unclustered = TaskItems(ids, values).stderr(ACC)
    clustered = TaskItems(ids, values, clusters=passages).stderr(ACC)
    assert clustered == pytest.approx(unclustered * math.sqrt(5), rel=0.1)
    champion = TaskItems(ids, [1.0 - v for v in values])  # differs on every item, by passage
    unclustered_paired = paired_difference(TaskItems(ids, values), champion, ACC)["stderr"]
    clustered_paired = paired_difference(TaskItems(ids, values, clusters=passages), champion, ACC)["stderr"]
    assert clustered_paired == pytest.approx(unclustered_paired * math.sqrt(5), rel=0.1)


def test_boolqs_questions_on_one_passage_form_a_cluster() -> None:
    samples = [{"filter": "none", "doc_hash": f"{i:064x}", "acc": 1.0, "doc": {"passage": f"p{i // 2}"}}
               for i in range(4)]
    items = TaskItems.from_samples(samples, DIMENSION_TASKS["reasoning"][5])  # forgeline_boolq
    assert items.clusters[0] == items.clusters[1] != items.clusters[2] == items.clusters[3]


def test_each_aggregation_of_sums_is_its_aggregation() -> None:
    rng = random.Random(5)
    samples = {"mean": [float(rng.random() < 0.5) for _ in range(30)],
               "bits_per_byte": [[-rng.uniform(50, 150), rng.randint(100, 300)] for _ in range(30)],
               "icat": [[float(rng.random() < 0.6), float(rng.random() < 0.8), float(rng.random() < 0.7)]
                        for _ in range(30)]}
    for aggregation, values in samples.items():
        sums = np.asarray(values, dtype=float).reshape(30, -1).sum(axis=0)
        assert AGGREGATIONS_OF_SUMS[aggregation](sums, 30) == pytest.approx(AGGREGATIONS[aggregation](values))


def test_holm_multiplies_the_kth_smallest_p_value_by_the_tests_left() -> None:
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})
