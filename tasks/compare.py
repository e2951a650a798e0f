"""Runs side by side, as MLflow's compare view shows them: one column per run, one row per
param and per metric (its latest value), a row marked where the runs differ."""

from __future__ import annotations

from dataclasses import dataclass

from mlflow import MlflowClient

MISSING = "-"


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
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                     for row in [header, *rows])
