"""One flow per stage, for rerunning a single stage by hand (`forgeline stage NAME`,
`dvc repro`, or a per-stage deployment). Each reads its inputs from the upstream stages'
output directories named in the config -- or, with `upstream_run`, from the ones an earlier
pipeline run recorded -- and records its work as an MLflow run with the stage's run nested
under it, like the pipeline does."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from forgeline.configs import load_config
from forgeline.flows.hooks import notify_failure, prefect_tags
from forgeline.tasks.data import DataResult
from forgeline.tasks.evaluate import EvalResult
from forgeline.tasks.prefect_tasks import data_task, eval_task, register_task, retrying_train_task
from forgeline.tasks.register import RegisterResult
from forgeline.tasks.stages import UPSTREAM_RUN_TAG, upstream_overrides
from forgeline.tasks.tracking import tracked_run
from forgeline.tasks.train import TrainResult


def run_one_stage(stage: str, config: str | None, overrides: list[str] | None, upstream_run: str | None,
                  force: bool, **options: Any) -> Any:
    """`options`: the stage task's own keyword arguments (data: `from_snapshot`)."""
    cfg = load_config(config, overrides or [])
    tags = prefect_tags()
    if upstream_run:
        cfg = load_config(config, [*(overrides or []), *upstream_overrides(cfg, stage, upstream_run)])
        tags[UPSTREAM_RUN_TAG] = upstream_run
    task = retrying_train_task(cfg) if stage == "train" else STAGE_TASKS[stage]
    with tracked_run(cfg, f"{stage}-{flow_run.name}", tags=tags) as parent:
        return task(cfg, parent.run_id, force, **options)


@flow(name="forgeline-data", on_failure=[notify_failure])
def data_flow(config: str | None = None, overrides: list[str] | None = None,
              upstream_run: str | None = None, force: bool = False,
              from_snapshot: bool = False) -> DataResult:
    """Corpus -> raw snapshot -> tokenizer -> packed webdataset shards and manifest;
    `from_snapshot`: build from the snapshot already in data.raw_dir, reading no source."""
    return run_one_stage("data", config, overrides, upstream_run, force, from_snapshot=from_snapshot)


@flow(name="forgeline-train", on_failure=[notify_failure])
def train_flow(config: str | None = None, overrides: list[str] | None = None,
               upstream_run: str | None = None, force: bool = False) -> TrainResult:
    """torchrun training from the data stage's shards to a committed checkpoint."""
    return run_one_stage("train", config, overrides, upstream_run, force)


@flow(name="forgeline-eval", on_failure=[notify_failure])
def eval_flow(config: str | None = None, overrides: list[str] | None = None,
              upstream_run: str | None = None, force: bool = False) -> EvalResult:
    """lm-eval on the train stage's checkpoint."""
    return run_one_stage("eval", config, overrides, upstream_run, force)


@flow(name="forgeline-register", on_failure=[notify_failure])
def register_flow(config: str | None = None, overrides: list[str] | None = None,
                  upstream_run: str | None = None, force: bool = False) -> RegisterResult:
    """Register the trained, evaluated model as a new MLflow model version."""
    return run_one_stage("register", config, overrides, upstream_run, force)


STAGE_TASKS = {"data": data_task, "eval": eval_task, "register": register_task}
STAGE_FLOWS = {"data": data_flow, "train": train_flow, "eval": eval_flow, "register": register_flow}
