"""Scores from lm-eval results: its metrics flattened to `task/metric` names, each task's value
chance-normalized, averaged per capability dimension and overall. Shared by the eval stage and
the in-training evaluation."""

from __future__ import annotations

import math

from forgeline.eval.dimensions import TaskScore


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
            name = f"{task}/{metric}" if flt == "none" else f"{task}/{metric}/{flt}"
            flat[name] = float(value)
    return flat


def normalized(value: float, score: TaskScore) -> float:
    """0 at chance, 1 at the best possible value, whichever direction is better."""
    return (value - score.chance) / (score.best - score.chance)


def aggregate(raw: dict[str, float], plan: dict[str, list[TaskScore]]) -> dict:
    """Dimension scores (mean of their tasks' normalized values) and the overall score (mean of
    the dimensions). A registered metric missing from the results is an error, not a zero."""
    dimensions = {}
    for name, scores in plan.items():
        tasks = {}
        for score in scores:
            key = f"{score.task}/{score.metric}"
            if key not in raw:
                raise KeyError(f"{key} is not among the results; the task produced: "
                               f"{sorted(k for k in raw if k.startswith(score.task + '/'))}")
            tasks[score.task] = {"metric": score.metric, "value": raw[key],
                                 "normalized": normalized(raw[key], score)}
        dimensions[name] = {"score": sum(t["normalized"] for t in tasks.values()) / len(tasks),
                            "tasks": tasks}
    overall = sum(d["score"] for d in dimensions.values()) / len(dimensions)
    return {"overall": overall, "dimensions": dimensions}
