"""Scores from lm-eval results: its metrics flattened to `task/metric` names, each task's value
chance-normalized, averaged per capability dimension and overall, with standard errors from the
per-item values. Shared by the eval stage and the in-training evaluation.

Uncertainty: a task's standard error is the closed form std / sqrt(n) for a mean (lm-eval's
own), and a seeded bootstrap over its items for the other aggregations (bits per byte, ICAT).
Items that share a context (several questions on one passage: SHARED_CONTEXT) are not
independent, so both are clustered on it (Miller, "Adding Error Bars to Evals", 2024): the
cluster-robust form of the closed form, a bootstrap that draws whole clusters. Normalizing
divides it by |best - chance|; a dimension's is sqrt(sum of its tasks' squared errors) / tasks
and the overall one sqrt(sum of the dimensions' squared errors) / dimensions -- tasks draw on
different items, so their errors are taken as independent. A score's 95 % interval is the score
+- 1.96 standard errors.

A paired difference of two models (paired_comparison) is tested, not approximated: under the
hypothesis that the two are equally good, which model gave which answer on an item (a cluster of
items) is a coin flip, so the difference's distribution under it is that of the differences with
the two models' answers swapped on random clusters -- enumerated exactly where at most
EXACT_FLIPS_UP_TO clusters differ (for right/wrong items of one task: the exact sign test),
else PERMUTATIONS seeded random swaps. That holds at any number of items, for any aggregation,
and keeps a cluster's items together. Its p-value and its 95 % interval (the shifts of the
difference that the test keeps) come from that distribution; the gate (tasks/promote.py)
corrects the p-values for testing several dimensions at once (holm).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from lm_eval.api.metrics import bits_per_byte, mean

from forgeline.eval.dimensions import TaskScore
from forgeline.eval.tasks.forgeline_safety import icat

AGGREGATIONS = {"mean": statistics.fmean, "bits_per_byte": bits_per_byte, "icat": icat}
MEANS = (statistics.fmean, mean)  # forgeline's and lm-eval's: aggregations with a closed-form error
BOOTSTRAP_ITERS = 1000
Z95 = 1.959964
Z80_POWER = 0.841621  # the one-sided normal quantile of 80 % power
ALPHA = 0.05  # the gate's family-wise error: of all its tests of one comparison together
PERMUTATIONS = 9999  # random swaps where the exact distribution is too large to enumerate
EXACT_FLIPS_UP_TO = 12  # clusters that differ: up to 2**12 swap patterns are enumerated
# The document field whose value the items of a task share when they share a context (BoolQ asks
# several questions about one passage, StereoSet several sentences about one target group).
SHARED_CONTEXT = {"forgeline_boolq": "passage", "boolq": "passage", "forgeline_stereoset": "target"}
# The document field listing the instruction types of an IFEval prompt (lm-eval's registry ids),
# kept per item so that its prompts can be scored apart by type (eval/instruction_types.py).
INSTRUCTION_TYPES = {"forgeline_ifeval": "instruction_id_list", "ifeval": "instruction_id_list"}


@dataclass(frozen=True)
class TaskItems:
    """One task's registered metric per evaluated item."""

    ids: list[str]
    """Stable across models and runs: the first 16 hex digits of the sha256 of the document."""
    values: list[Any]
    """What the task's aggregation takes per item (TaskScore.aggregation)."""
    clusters: list[str] | None = None
    """Per item, the context it shares with the other items of its cluster (SHARED_CONTEXT);
    None: every item is its own."""
    instruction_types: list[list[str]] | None = None
    """IFEval's: per item, the types of its instructions, from its document (INSTRUCTION_TYPES);
    None for other tasks."""

    @classmethod
    def from_samples(cls, samples: list[dict], score: TaskScore) -> TaskItems:
        """From lm-eval's logged samples of `score.task` (simple_evaluate(log_samples=True))."""
        metric, _, filter_name = score.metric.partition("/")
        rows = [row for row in samples if row["filter"] == (filter_name or "none")]
        context = SHARED_CONTEXT.get(score.task)
        clusters = None if context is None else [text_id(str(row["doc"][context])) for row in rows]
        types = INSTRUCTION_TYPES.get(score.task)
        instruction_types = None if types is None else [list(row["doc"][types]) for row in rows]
        return cls(ids=[row["doc_hash"][:16] for row in rows], values=[row[metric] for row in rows],
                   clusters=clusters, instruction_types=instruction_types)

    def among(self, ids: set[str]) -> TaskItems:
        """The items whose id is in `ids`, each with its value, cluster and instruction types."""
        kept = [index for index, item_id in enumerate(self.ids) if item_id in ids]
        return TaskItems(**{column.name: None if (entries := getattr(self, column.name)) is None
                            else [entries[index] for index in kept] for column in fields(self)})

    def value(self, score: TaskScore) -> float:
        return float(AGGREGATIONS[score.aggregation](self.values))

    def stderr(self, score: TaskScore) -> float | None:
        """None for fewer than two items."""
        return item_stderr(self.values, AGGREGATIONS[score.aggregation], self.clusters)


def text_id(text: str) -> str:
    """The first 16 hex digits of the sha256 of `text`, as items are identified."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cluster_indices(clusters: list[str] | None, n: int) -> list[np.ndarray]:
    """The item indices of each cluster, in order of first appearance; one per item without
    clusters."""
    if clusters is None:
        return [np.array([i]) for i in range(n)]
    members: dict[str, list[int]] = {}
    for index, cluster in enumerate(clusters):
        members.setdefault(cluster, []).append(index)
    return [np.array(indices) for indices in members.values()]


def item_stderr(values: list[Any], aggregate: Callable[[list[Any]], float],
                clusters: list[str] | None = None) -> float | None:
    """The standard error of `aggregate` over items with these values, clustered on `clusters`:
    the cluster-robust closed form for a mean (std / sqrt(n) when every item is its own cluster),
    a seeded bootstrap drawing whole clusters for another aggregation; None for fewer than two
    items or clusters."""
    groups = cluster_indices(clusters, len(values))
    if len(values) < 2 or len(groups) < 2:
        return None
    if aggregate in MEANS:
        return clustered_mean_stderr(np.asarray(values, dtype=float), groups)
    return bootstrap_stderr(lambda picked: aggregate([values[i] for i in picked]), groups)


def clustered_mean_stderr(values: np.ndarray, groups: list[np.ndarray]) -> float:
    """The cluster-robust standard error of the mean of `values`: sqrt(G / (G - 1) * sum over
    the G clusters of (the sum of their items' deviations from the mean)^2) / n. Positively
    correlated items of a cluster add up instead of cancelling; with one item a cluster it is
    the sample std / sqrt(n)."""
    deviations = values - values.mean()
    cluster_sums = np.array([deviations[indices].sum() for indices in groups])
    g = len(groups)
    return float(math.sqrt(g / (g - 1) * float(np.sum(cluster_sums ** 2))) / len(values))


def bootstrap_stderr(statistic: Callable[[np.ndarray], float], groups: list[np.ndarray]) -> float:
    """The standard deviation of `statistic` over BOOTSTRAP_ITERS seeded resamples of the
    clusters (drawn with replacement, each with all its item indices)."""
    rng = np.random.default_rng(0)
    draws = []
    for _ in range(BOOTSTRAP_ITERS):
        picked = rng.integers(0, len(groups), len(groups))
        draws.append(statistic(np.concatenate([groups[i] for i in picked])))
    return float(np.std(draws, ddof=1))


def paired_items(a: TaskItems, b: TaskItems) -> tuple[list[Any], list[Any], list[str]]:
    """The values of `a` and `b` on the items both evaluated (matched by id; a repeated id by its
    occurrence), and each pair's cluster (`a`'s; the item's id where `a` has none)."""
    def keyed(items: TaskItems) -> dict[tuple[str, int], tuple[Any, str]]:
        seen: dict[str, int] = {}
        out = {}
        clusters = items.clusters or items.ids
        for item_id, value, cluster in zip(items.ids, items.values, clusters, strict=True):
            seen[item_id] = seen.get(item_id, 0) + 1
            out[(item_id, seen[item_id])] = (value, cluster)
        return out

    theirs = keyed(b)
    shared = [(value, theirs[key][0], cluster) for key, (value, cluster) in keyed(a).items() if key in theirs]
    return [x for x, _, _ in shared], [y for _, y, _ in shared], [c for _, _, c in shared]


def paired_difference(a: TaskItems, b: TaskItems, score: TaskScore) -> dict:
    """The task's value of `a` minus `b` on the items both evaluated (paired_items), with the
    standard error of the paired difference, clustered as the items are -- closed form for a mean
    (of the per-item differences), a bootstrap drawing the same clusters from both otherwise --
    and the number of shared items."""
    ours, others, clusters = paired_items(a, b)
    n = len(ours)
    if n == 0:
        return {"difference": None, "stderr": None, "shared": 0}
    aggregate_values = AGGREGATIONS[score.aggregation]
    difference = float(aggregate_values(ours) - aggregate_values(others))
    groups = cluster_indices(clusters, n)
    if n < 2 or len(groups) < 2:
        stderr = None
    elif score.aggregation == "mean":
        stderr = clustered_mean_stderr(np.subtract(ours, others, dtype=float), groups)
    else:  # the same clusters drawn from both
        stderr = bootstrap_stderr(lambda picked: aggregate_values([ours[i] for i in picked])
                                  - aggregate_values([others[i] for i in picked]), groups)
    return {"difference": difference, "stderr": stderr, "shared": n}


# Each aggregation as a function of the column sums of its items' values (`sums`: (..., columns))
# and their number, so that the value of every swap pattern is computed at once (SwapTask).
AGGREGATIONS_OF_SUMS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "mean": lambda sums, n: sums[..., 0] / n,
    # lm-eval's bits_per_byte: -sum(log-likelihood) / sum(bytes) / ln 2
    "bits_per_byte": lambda sums, n: -sums[..., 0] / sums[..., 1] / math.log(2),
    # forgeline_safety.icat of (ss, lms of the stereotype, lms of the anti-stereotype) triples
    "icat": lambda sums, n: ((sums[..., 1] + sums[..., 2]) / (2 * n))
    * np.minimum(sums[..., 0] / n, 1 - sums[..., 0] / n) / 0.5,
}


@dataclass(frozen=True)
class SwapTask:
    """One task's paired items as the swap test needs them: with s_c = +1 (kept) or -1 (the two
    models' answers swapped) for each cluster, model a's column sums are middle + s @ half and
    model b's middle - s @ half. Clusters where the two answered alike are left out: swapping
    them changes nothing."""

    middle: np.ndarray  # (columns,): the column sums of both models' answers, halved
    half: np.ndarray  # (clusters that differ, columns): a's cluster sums minus b's, halved
    n: int
    weight: float  # of the task's normalized difference in the tested statistic
    aggregate_sums: Callable[[np.ndarray, int], np.ndarray]
    scale: float  # best - chance

    @classmethod
    def of(cls, a: TaskItems, b: TaskItems, score: TaskScore, weight: float) -> SwapTask:
        ours, others, clusters = paired_items(a, b)
        groups = cluster_indices(clusters, len(ours))

        def cluster_sums(values: list[Any]) -> np.ndarray:  # (clusters, columns)
            columns = np.asarray(values, dtype=float).reshape(len(values), -1)
            return np.array([columns[indices].sum(axis=0) for indices in groups])

        a_sums, b_sums = cluster_sums(ours), cluster_sums(others)
        half = (a_sums - b_sums) / 2
        return cls(middle=(a_sums + b_sums).sum(axis=0) / 2, half=half[np.any(half != 0, axis=1)],
                   n=len(ours), weight=weight, aggregate_sums=AGGREGATIONS_OF_SUMS[score.aggregation],
                   scale=score.best - score.chance)

    def differences(self, signs: np.ndarray) -> np.ndarray:
        """The weighted normalized difference a - b under each row of `signs` (swaps, clusters)."""
        shift = signs @ self.half
        return self.weight * (self.aggregate_sums(self.middle + shift, self.n)
                              - self.aggregate_sums(self.middle - shift, self.n)) / self.scale


def swap_test(tasks: list[SwapTask], null: float = 0.0) -> dict:
    """The paired test of sum(task.weight * normalized difference) = `null` (the statistic of a
    dimension or of the overall) over the tasks' swaps of clusters (see the module docstring):
    its two-sided p-value and the 95 % interval of the shifts it keeps. Seeded: the same items
    give the same result."""
    differing = sum(len(task.half) for task in tasks)
    observed = float(sum(task.differences(np.ones((1, len(task.half))))[0] for task in tasks))
    if differing <= EXACT_FLIPS_UP_TO:
        patterns = itertools.product((1.0, -1.0), repeat=differing)
        signs = np.array(list(patterns)).reshape(2 ** differing, differing)
        counted_observed = 0  # the observed pattern is among those enumerated
    else:
        signs = np.random.default_rng(0).choice((1.0, -1.0), size=(PERMUTATIONS, differing))
        counted_observed = 1  # the observed statistic counts as one draw (a valid Monte Carlo p)
    statistic = np.zeros(len(signs))
    start = 0
    for task in tasks:
        statistic += task.differences(signs[:, start:start + len(task.half)])
        start += len(task.half)
    magnitudes = np.sort(np.abs(statistic))
    slack = 1e-12 * max(1.0, float(magnitudes[-1]))  # swaps that give the same value in float
    at_least = int(np.sum(magnitudes >= abs(observed - null) - slack))
    total = len(magnitudes) + counted_observed
    p_value = (at_least + counted_observed) / total
    # The interval: the shifts whose test keeps them at 5 % -- the half-width is the largest
    # |statistic| that more than 5 % of the swaps reach.
    allowed = math.floor(ALPHA * total + 1e-9) - counted_observed
    half_width = float(magnitudes[len(magnitudes) - 1 - max(allowed, 0)])
    return {"p_value": min(1.0, p_value), "ci95": [observed - half_width, observed + half_width]}


def paired_comparison(a: dict[str, TaskItems], b: dict[str, TaskItems],
                      plan: dict[str, list[TaskScore]], margin: float = 0.0) -> dict:
    """Model `a` minus model `b`, item by item on the items both evaluated: per task (in its
    metric and normalized), per dimension and overall, each with its standard error (clustered);
    a dimension's and the overall difference are the means of their normalized parts, their
    errors combined as for the scores. Each dimension's difference is tested against 0 and the
    overall one against `margin` by the swap test, which gives their p-values and 95 % intervals
    (None where a task has fewer than two shared items)."""
    dimensions = {}
    for name, scores in plan.items():
        tasks = {}
        for score in scores:
            paired = paired_difference(a[score.task], b[score.task], score)
            scale = score.best - score.chance  # a difference normalizes without the chance offset
            tasks[score.task] = paired | {
                "metric": score.metric,
                "normalized": None if paired["difference"] is None else paired["difference"] / scale,
                "normalized_stderr": None if paired["stderr"] is None else paired["stderr"] / abs(scale)}
        parts = [t["normalized"] for t in tasks.values()]
        value = None if None in parts else sum(parts) / len(parts)
        se = combined_stderr([t["normalized_stderr"] for t in tasks.values()])
        tested = swap_test([SwapTask.of(a[s.task], b[s.task], s, 1 / len(scores)) for s in scores]) \
            if se is not None else {"p_value": None, "ci95": None}
        dimensions[name] = {"difference": value, "stderr": se, **tested, "tasks": tasks}
    parts = [d["difference"] for d in dimensions.values()]
    overall = None if None in parts else sum(parts) / len(parts)
    overall_se = combined_stderr([d["stderr"] for d in dimensions.values()])
    tested = {"p_value": None, "ci95": None}
    if overall_se is not None:
        tested = swap_test([SwapTask.of(a[s.task], b[s.task], s, 1 / len(plan) / len(scores))
                            for scores in plan.values() for s in scores], margin)
    shared = {task: t["shared"] for d in dimensions.values() for task, t in d["tasks"].items()}
    return {"overall": overall, "overall_stderr": overall_se, "overall_ci95": tested["ci95"],
            "overall_p_value": tested["p_value"], "margin": margin,
            "shared_items": shared, "dimensions": dimensions}


def holm(p_values: dict[str, float]) -> dict[str, float]:
    """Holm's adjusted p-values: a hypothesis is rejected at family-wise error ALPHA -- the chance
    of rejecting any true one, however many are tested -- when its adjusted p-value is at most
    ALPHA. The k-th smallest of m p-values is multiplied by m - k + 1, and kept at least the
    adjusted value before it."""
    adjusted, running = {}, 0.0
    ordered = sorted(p_values.items(), key=lambda item: item[1])
    for rank, (name, p_value) in enumerate(ordered):
        running = max(running, min(1.0, (len(ordered) - rank) * p_value))
        adjusted[name] = running
    return adjusted


def interval(score: float, stderr: float | None) -> list[float] | None:
    return None if stderr is None else [score - Z95 * stderr, score + Z95 * stderr]


def detectable_difference(stderr: float, tests: int = 1) -> float:
    """The minimum detectable difference: the smallest true difference that a two-sided test at
    family-wise error ALPHA over `tests` tests (Holm's first step, ALPHA / tests: the level a
    difference must reach when it is the only one) finds with 80 % power, for an estimate with
    this standard error."""
    return (statistics.NormalDist().inv_cdf(1 - ALPHA / 2 / tests) + Z80_POWER) * stderr


def combined_stderr(stderrs: list[float | None]) -> float | None:
    """Of the mean of independent estimates; None when one of them has none."""
    if any(se is None for se in stderrs):
        return None
    return math.sqrt(sum(se * se for se in stderrs)) / len(stderrs)


def flatten_scores(results: dict[str, dict]) -> dict[str, float]:
    """{"task": {"acc,none": 0.3, "acc_stderr,none": ...}} -> {"task/acc": 0.3}. Only
    `metric,filter` entries with a finite number are kept, standard errors dropped; a filter
    other than `none` stays in the name (`task/exact_match/strict-match`)."""
    flat = {}
    for task, entries in sorted(results.items()):
        for key, value in entries.items():
            metric, comma, flt = key.partition(",")
            if not comma or metric.endswith("_stderr"):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                continue
            flat[score_name(task, metric, flt)] = float(value)
    return flat


def item_stderrs(samples: dict[str, list[dict]], aggregations: dict[str, dict[str, Callable]]
                 ) -> dict[str, float]:
    """`task/metric` (as flatten_scores names it) -> the standard error of every metric of every
    task, from lm-eval's logged items (simple_evaluate(log_samples=True)) and the function each
    task aggregates the metric with (Task.aggregation()); one per filter, none under two items."""
    stderrs = {}
    for task, rows in samples.items():
        for metric, aggregate in aggregations[task].items():
            values: dict[str, list] = {}
            for row in rows:
                if metric in row:
                    values.setdefault(row["filter"], []).append(row[metric])
            for filter_name, items in values.items():
                se = item_stderr(items, aggregate)
                if se is not None:
                    stderrs[score_name(task, metric, filter_name)] = se
    return stderrs


def score_name(task: str, metric: str, filter_name: str) -> str:
    """How forgeline names lm-eval's `metric,filter` of `task`: `task/metric`, the filter added
    when it is not `none`."""
    return f"{task}/{metric}" if filter_name == "none" else f"{task}/{metric}/{filter_name}"


def normalized(value: float, score: TaskScore) -> float:
    """0 at chance, 1 at the best possible value, whichever direction is better."""
    return (value - score.chance) / (score.best - score.chance)


def aggregate(raw: dict[str, float], plan: dict[str, list[TaskScore]],
              stderrs: dict[str, float | None] | None = None) -> dict:
    """Dimension scores (mean of their tasks' normalized values) and the overall score (mean of
    the dimensions); with `stderrs` (by task/metric name) each with its standard error and 95 %
    interval. A registered metric missing from the results is an error, not a zero."""
    stderrs = stderrs or {}
    dimensions = {}
    for name, scores in plan.items():
        tasks = {}
        for score in scores:
            key = f"{score.task}/{score.metric}"
            if key not in raw:
                raise KeyError(f"{key} is not among the results; the task produced: "
                               f"{sorted(k for k in raw if k.startswith(score.task + '/'))}")
            se = stderrs.get(key)
            normalized_se = None if se is None else se / abs(score.best - score.chance)
            tasks[score.task] = {"metric": score.metric, "value": raw[key], "stderr": se,
                                 "normalized": normalized(raw[key], score),
                                 "normalized_stderr": normalized_se}
        value = sum(t["normalized"] for t in tasks.values()) / len(tasks)
        se = combined_stderr([t["normalized_stderr"] for t in tasks.values()])
        dimensions[name] = {"score": value, "stderr": se, "ci95": interval(value, se), "tasks": tasks}
    overall = sum(d["score"] for d in dimensions.values()) / len(dimensions)
    overall_se = combined_stderr([d["stderr"] for d in dimensions.values()])
    return {"overall": overall, "overall_stderr": overall_se, "overall_ci95": interval(overall, overall_se),
            "dimensions": dimensions}


def stderr_metrics(report: dict) -> dict[str, float]:
    """The report's standard errors as flat metrics, under `stderr/` so that no reader of
    `dimension/*` or `overall` mistakes one for a score: `stderr/<task>/<metric>`,
    `stderr/dimension/<name>`, `stderr/overall` (those that exist)."""
    flat = {f"stderr/{task}/{entry['metric']}": entry["stderr"]
            for dimension in report["dimensions"].values() for task, entry in dimension["tasks"].items()}
    flat |= {f"stderr/dimension/{name}": entry["stderr"] for name, entry in report["dimensions"].items()}
    flat["stderr/overall"] = report["overall_stderr"]
    return {key: value for key, value in flat.items() if value is not None}
