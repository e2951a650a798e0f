"""The pipeline flow: data -> train -> eval -> register, under one MLflow parent run."""

from __future__ import annotations

from dataclasses import dataclass

from prefect import flow
from prefect.runtime import flow_run

from forgeline.configs import load_config
from forgeline.flows.hooks import notify_failure, prefect_tags
from forgeline.tasks.evaluate import EvalResult
from forgeline.tasks.prefect_tasks import data_task, eval_task, register_task, retrying_train_task
from forgeline.tasks.reproduce import REPRODUCES_TAG
from forgeline.tasks.tracking import tracked_run


@dataclass(frozen=True)
class PipelineResult:
    run_id: str
    model_name: str
    model_version: str
    promotion: str
    overall: float
    dimensions: dict[str, float]


@flow(name="forgeline-pipeline", on_failure=[notify_failure])
def pipeline_flow(config: str | None = None, overrides: list[str] | None = None,
                  force: bool = False) -> PipelineResult:
    """Corpus to a registered, evaluated model. `config`: a YAML path or shipped name
    (default tiny.yaml); `overrides`: `section.key=value` strings; `force`: rerun every stage
    even where its inputs are unchanged and its outputs verify."""
    cfg = load_config(config, overrides or [])
    with tracked_run(cfg, f"pipeline-{flow_run.name}", tags=prefect_tags()) as parent:
        data_task(cfg, parent.run_id, force)
        retrying_train_task(cfg)(cfg, parent.run_id, force)
        evaluation = eval_task(cfg, parent.run_id, force)
        registered = register_task(cfg, parent.run_id, force)
    return PipelineResult(run_id=parent.run_id, model_name=registered.model_name,
                          model_version=registered.version, promotion=registered.promotion,
                          overall=evaluation.overall, dimensions=evaluation.dimensions)


@flow(name="forgeline-reproduce", on_failure=[notify_failure])
def reproduce_flow(config: str, overrides: list[str], reproduces: str) -> tuple[str, EvalResult]:
    """data -> train -> eval of a recorded run's config into fresh outputs, every stage forced;
    registers nothing. Returns the new MLflow run id and the eval result."""
    cfg = load_config(config, overrides)
    tags = prefect_tags() | {REPRODUCES_TAG: reproduces}
    with tracked_run(cfg, f"reproduce-{flow_run.name}", tags=tags) as parent:
        data_task(cfg, parent.run_id, True)
        retrying_train_task(cfg)(cfg, parent.run_id, True)
        evaluation = eval_task(cfg, parent.run_id, True)
    return parent.run_id, evaluation
