"""Scores from lm-eval results: its metrics flattened to `task/metric` names, each task's value
chance-normalized, averaged per capability dimension and overall, with standard errors from the
per-item values. Shared by the eval stage and the in-training evaluation.

Uncertainty: a task's standard error is the closed form std / sqrt(n) for a mean (lm-eval's
own), and a seeded bootstrap over its items for the other aggregations (bits per byte, ICAT).
Normalizing divides it by |best - chance|; a dimension's is sqrt(sum of its tasks' squared
errors) / tasks and the overall one sqrt(sum of the dimensions' squared errors) / dimensions --
tasks draw on different items, so their errors are taken as independent. A 95 % interval is
the score +- 1.96 standard errors.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class TaskItems:
    """One task's registered metric per evaluated item."""

    ids: list[str]
    """Stable across models and runs: the first 16 hex digits of the sha256 of the document."""
    values: list[Any]
    """What the task's aggregation takes per item (TaskScore.aggregation)."""

    @classmethod
    def from_samples(cls, samples: list[dict], score: TaskScore) -> TaskItems:
        """From lm-eval's logged samples of `score.task` (simple_evaluate(log_samples=True))."""
        metric, _, filter_name = score.metric.partition("/")
        rows = [row for row in samples if row["filter"] == (filter_name or "none")]
        return cls(ids=[row["doc_hash"][:16] for row in rows], values=[row[metric] for row in rows])

    def value(self, score: TaskScore) -> float:
        return float(AGGREGATIONS[score.aggregation](self.values))

    def stderr(self, score: TaskScore) -> float | None:
        """None for fewer than two items."""
        return item_stderr(self.values, AGGREGATIONS[score.aggregation])


def item_stderr(values: list[Any], aggregate: Callable[[list[Any]], float]) -> float | None:
    """The standard error of `aggregate` over items with these values: std / sqrt(n) for a mean,
    a seeded bootstrap over the items for another aggregation; None for fewer than two items."""
    n = len(values)
    if n < 2:
        return None
    if aggregate in MEANS:
        return statistics.stdev(values) / math.sqrt(n)
    return bootstrap_stderr(lambda picked: aggregate([values[i] for i in picked]), n)


def bootstrap_stderr(statistic: Callable[[np.ndarray], float], n: int) -> float:
    """The standard deviation of `statistic` over BOOTSTRAP_ITERS seeded resamples of n item
    indices (drawn with replacement)."""
    rng = np.random.default_rng(0)
    return float(np.std([statistic(rng.integers(0, n, n)) for _ in range(BOOTSTRAP_ITERS)], ddof=1))


def paired_difference(a: TaskItems, b: TaskItems, score: TaskScore) -> dict:
    """The task's value of `a` minus `b` on the items both evaluated (matched by id; a repeated
    id by its occurrence), with the standard error of the paired difference -- closed form for
    a mean (of the per-item differences), a bootstrap drawing the same items from both
    otherwise -- and the number of shared items."""
    def keyed(items: TaskItems) -> dict[tuple[str, int], Any]:
        seen: dict[str, int] = {}
        out = {}
        for item_id, value in zip(items.ids, items.values, strict=True):
            seen[item_id] = seen.get(item_id, 0) + 1
            out[(item_id, seen[item_id])] = value
        return out

    theirs = keyed(b)
    pairs = [(value, theirs[key]) for key, value in keyed(a).items() if key in theirs]
    n = len(pairs)
    if n == 0:
        return {"difference": None, "stderr": None, "shared": 0}
    aggregate_values = AGGREGATIONS[score.aggregation]
    ours, others = [x for x, _ in pairs], [y for _, y in pairs]
    difference = float(aggregate_values(ours) - aggregate_values(others))
    if n < 2:
        stderr = None
    elif score.aggregation == "mean":
        stderr = statistics.stdev(x - y for x, y in pairs) / math.sqrt(n)
    else:  # the same items drawn from both
        stderr = bootstrap_stderr(lambda picked: aggregate_values([ours[i] for i in picked])
                                  - aggregate_values([others[i] for i in picked]), n)
    return {"difference": difference, "stderr": stderr, "shared": n}


def paired_comparison(a: dict[str, TaskItems], b: dict[str, TaskItems],
                      plan: dict[str, list[TaskScore]]) -> dict:
    """Model `a` minus model `b`, item by item on the items both evaluated: per task (in its
    metric and normalized), per dimension and overall, each with its standard error and 95 %
    interval; a dimension's and the overall difference are the means of their normalized
    parts, their errors combined as for the scores."""
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
        dimensions[name] = {"difference": value, "stderr": se,
                            "ci95": None if value is None else interval(value, se), "tasks": tasks}
    parts = [d["difference"] for d in dimensions.values()]
    overall = None if None in parts else sum(parts) / len(parts)
    overall_se = combined_stderr([d["stderr"] for d in dimensions.values()])
    shared = {task: t["shared"] for d in dimensions.values() for task, t in d["tasks"].items()}
    return {"overall": overall, "overall_stderr": overall_se,
            "overall_ci95": None if overall is None else interval(overall, overall_se),
            "shared_items": shared, "dimensions": dimensions}


def interval(score: float, stderr: float | None) -> list[float] | None:
    return None if stderr is None else [score - Z95 * stderr, score + Z95 * stderr]


def detectable_difference(stderr: float) -> float:
    """The minimum detectable difference: the smallest true difference that a two-sided test at
    5 % with this standard error finds with 80 % power."""
    return (Z95 + Z80_POWER) * stderr


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
