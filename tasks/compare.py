"""Runs side by side, as MLflow's compare view shows them: one column per run, one row per
param and per metric (its latest value), a row marked where the runs differ; then each run's
evaluation against the first's, paired item by item on the items both evaluated (the same
comparison as the promotion gate's, tasks/promote.py)."""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import mlflow
from mlflow import MlflowClient

from forgeline.eval.dimensions import TaskScore
from forgeline.eval.scores import paired_comparison
from forgeline.tasks.evaluate import ITEMS_NAME, EvaluatedItems, windows

log = logging.getLogger(__name__)

MISSING = "-"
Read = TypeVar("Read")  # what read_run_items reads from an items.json


@dataclass(frozen=True)
class Comparison:
    run_ids: list[str]
    run_names: list[str]
    params: dict[str, list[str]]  # name -> one value per run
    metrics: dict[str, list[str]]


def compare_runs(client: MlflowClient, run_ids: list[str]) -> Comparison:
    runs = [client.get_run(run_id) for run_id in run_ids]
    param_names = sorted({name for run in runs for name in run.data.params})
    metric_names = sorted({name for run in runs for name in run.data.metrics})
    return Comparison(
        run_ids=run_ids,
        run_names=[run.info.run_name or MISSING for run in runs],
        params={name: [run.data.params.get(name, MISSING) for run in runs] for name in param_names},
        metrics={name: [_number(run.data.metrics.get(name)) for run in runs] for name in metric_names},
    )


def _number(value: float | None) -> str:
    return MISSING if value is None else f"{value:.6g}"


def format_comparison(comparison: Comparison, diff_only: bool) -> str:
    """A fixed-width table; `*` marks rows whose values differ between the runs."""
    header = ["", *comparison.run_ids]
    rows = [["run name", *comparison.run_names]]
    for title, table in (("params", comparison.params), ("metrics", comparison.metrics)):
        picked = {k: v for k, v in table.items() if not diff_only or len(set(v)) > 1}
        rows.append([f"[{title}]", *([""] * len(comparison.run_ids))])
        rows += [[f"{'*' if len(set(v)) > 1 else ' '} {k}", *v] for k, v in picked.items()]
    return fixed_width([header, *rows])


def fixed_width(rows: list[list[str]]) -> str:
    """Rows of cells as left-aligned columns two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


ITEMS_ARTIFACT = f"eval/{ITEMS_NAME}"  # logged by the eval stage's run and with a registered version's


def logged_items(client: MlflowClient, run_id: str) -> EvaluatedItems | None:
    """The per-item eval results logged with a run (an eval or register stage run), or with its
    eval child (a pipeline run); None where there are none."""
    found = run_items(client, run_id)
    if found is not None:
        return found
    children = client.search_runs([client.get_run(run_id).info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{run_id}'")
    return next((found for child in children if (found := run_items(client, child.info.run_id))), None)


def run_items(client: MlflowClient, run_id: str) -> EvaluatedItems | None:
    """The per-item eval results among one run's own artifacts; None when it has none, or only
    ones written before evaluations could be paired. A tracking server or artifact store that
    fails to answer raises: that the items could not be read says nothing about the run."""
    return read_run_items(client, run_id, EvaluatedItems.read)


def run_items_beside_base(client: MlflowClient, run_id: str) -> tuple[EvaluatedItems, EvaluatedItems] | None:
    """The per-item eval results among one run's own artifacts and its base's on the same items,
    scored alike (the eval stage's items.json of a run from a base); None when it has none, or no
    base's (a run trained from scratch). Failures as run_items'."""
    return read_run_items(client, run_id, model_and_base)


def model_and_base(path: Path) -> tuple[EvaluatedItems, EvaluatedItems] | None:
    if "base" not in json.loads(path.read_text()):
        return None
    return EvaluatedItems.read(path), EvaluatedItems.read(path, which="base")


def read_run_items(client: MlflowClient, run_id: str, read: Callable[[Path], Read | None]) -> Read | None:
    """`read` of the run's own items.json; None when it has none, or one without a suite record."""
    folder = ITEMS_ARTIFACT.rpartition("/")[0]
    if ITEMS_ARTIFACT not in {entry.path for entry in client.list_artifacts(run_id, folder)}:
        return None
    with tempfile.TemporaryDirectory() as scratch:
        path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=ITEMS_ARTIFACT,
                                                   dst_path=scratch, tracking_uri=client.tracking_uri)
        try:
            return read(Path(path))
        except json.JSONDecodeError:  # a damaged artifact: an error, not an absence
            raise
        except ValueError as err:  # an items.json without a suite record
            log.warning("run %s: %s", run_id, err)
            return None


def shared_plan(a: EvaluatedItems, b: EvaluatedItems) -> dict[str, list[TaskScore]]:
    """`a`'s scored tasks that `b` evaluated too, with as many few-shot examples."""
    fewshot = b.fewshot()
    plan = {name: [score for score in scores if fewshot.get(score.task) == a.plan[name]["num_fewshot"]]
            for name, scores in a.scores().items()}
    return {name: scores for name, scores in plan.items() if scores}


def paired_against_first(client: MlflowClient, run_ids: list[str]) -> str:
    """Each run's scores minus the first run's, per dimension and overall, paired on the items
    both evaluated, with 95 % intervals and the number of shared items."""
    items = {run_id: logged_items(client, run_id) for run_id in run_ids}
    first = items[run_ids[0]]
    if first is None:
        return f"not paired item by item: run {run_ids[0]} has no per-item eval results"
    lines = []
    for run_id in run_ids[1:]:
        other = items[run_id]
        if other is None:
            lines.append(f"{run_id} - {run_ids[0]}: not paired, {run_id} has no per-item eval results")
            continue
        if other.suite != first.suite:
            lines.append(f"{run_id} - {run_ids[0]}: not paired, evaluated under different suites "
                         f"(fingerprints {other.suite[:12]} and {first.suite[:12]}): the same item may "
                         "be scored differently")
            continue
        if other.max_length != first.max_length:
            lines.append(f"{run_id} - {run_ids[0]}: not paired, scored in {windows(other.max_length)} and "
                         f"{windows(first.max_length)}: the same item may be scored differently")
            continue
        if other.precision != first.precision:
            lines.append(f"{run_id} - {run_ids[0]}: not paired, scored in {other.precision} and "
                         f"{first.precision}: the same item may be scored differently")
            continue
        plan = shared_plan(other, first)
        if not plan:
            lines.append(f"{run_id} - {run_ids[0]}: not paired, no task was evaluated alike by both")
            continue
        comparison = paired_comparison(other.items, first.items, plan)
        lines.append(format_paired(f"{run_id} - {run_ids[0]}", comparison))
    return "\n\n".join(lines)


def format_paired(title: str, comparison: dict) -> str:
    """A dimension per row: the difference, its 95 % interval and the items it rests on."""
    def row(name: str, difference: float | None, ci95: list[float] | None, shared: int) -> list[str]:
        interval = "-" if ci95 is None else f"[{ci95[0]:+.4f}, {ci95[1]:+.4f}]"
        return [name, "-" if difference is None else f"{difference:+.4f}", interval, str(shared)]

    rows = [["", "difference", "95 % interval", "shared items"]]
    for name, entry in comparison["dimensions"].items():
        rows.append(row(name, entry["difference"], entry["ci95"],
                        sum(task["shared"] for task in entry["tasks"].values())))
    rows.append(row("overall", comparison["overall"], comparison["overall_ci95"],
                    sum(comparison["shared_items"].values())))
    return f"paired on shared items, {title}:\n" + fixed_width(rows)
