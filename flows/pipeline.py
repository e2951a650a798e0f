"""The pipeline flow: every stage of the config's pipeline in order (tasks/stage.py: data -> train
or sft -> eval -> register), under one MLflow parent run; and the
flow that reproduces a recorded run."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefect import flow
from prefect.states import Completed

from forgeline.configs.environment import apply_environment_defaults
from forgeline.configs.redaction import credentials_masked_in_errors
from forgeline.flows.hooks import (
    flow_config,
    label_flow_run,
    mlflow_link,
    notify_failure,
    prefect_tags,
    run_labels,
)
from forgeline.flows.orchestrator import final_states_recorded, forget_reported_states
from forgeline.flows.stage_flows import configured_task
from forgeline.tasks.reproduce import REPRODUCES_TAG, reproduced_stages
from forgeline.tasks.stage import pipeline_stages
from forgeline.tasks.tracking import run_name, tracked_run


@dataclass(frozen=True)
class PipelineResult:
    run_id: str
    model_name: str
    model_version: str
    promotion: str
    overall: float
    dimensions: dict[str, float]
    stderrs: dict[str, float] = field(default_factory=dict)  # "overall" and each dimension's
    base_overall: float | None = None  # the pretrained base's (model.init_from), on the same items
    base_dimensions: dict[str, float] | None = None
    detectable: float | None = None  # the smallest overall change the eval's items detect


@flow(name="forgeline-pipeline", on_completion=[forget_reported_states],
      on_failure=[forget_reported_states, notify_failure])
def pipeline_flow(config: str | None = None, overrides: list[str] | None = None,
                  force: bool = False) -> PipelineResult:
    """Corpus to a registered, evaluated model: every stage of the config's pipeline under one
    MLflow parent run. The CLI passes the path and overrides as typed, once it has read and
    checked them (flows/cli.py run_pipeline).

    Args:
        config: a run config: a YAML path, relative to the deployment's working directory, or the
            name of a shipped one (tiny.yaml, debug.yaml, smollm2-sft.yaml ...). `forgeline config
            show --docs` lists its fields. Default: tiny.yaml.
        overrides: config values to change, one `section.key=value` each, applied after the file:
            e.g. train.steps=50, parallel.dp_shard=2, eval.out_dir=artifacts/eval-rerun (a JSON list).
        force: run every stage even where the stage cache would skip it (inputs -- config section,
            upstream outputs, code -- unchanged and outputs verified). Off: such a stage ends Cached.
    """
    apply_environment_defaults()
    cfg = flow_config(config, overrides)
    stages = pipeline_stages(cfg)
    name = run_name("pipeline", cfg, with_layout=True)
    with (credentials_masked_in_errors(), final_states_recorded() as states,
          tracked_run(cfg, name, tags=prefect_tags()) as parent):
        label_flow_run(name, ["pipeline", *run_labels(cfg, [stage.name for stage in stages], True)],
                       cfg, parent.run_id)
        results = {stage.name: states.run(configured_task(stage, cfg), cfg, parent.run_id, force)
                   for stage in stages}
        states.message = f"{states.summary()}; {mlflow_link(cfg, parent.run_id)}"
    registered, evaluation = results["register"], results["eval"]
    result = PipelineResult(run_id=parent.run_id, model_name=registered.model_name,
                            model_version=registered.version, promotion=registered.promotion,
                            overall=evaluation.overall, dimensions=evaluation.dimensions,
                            stderrs=evaluation.stderrs,
                            base_overall=evaluation.base_overall, base_dimensions=evaluation.base_dimensions,
                            detectable=evaluation.detectable)
    # The flow run ends Completed with the summary as its message; the caller gets the result.
    return Completed(message=f"{states.message}; {registered.promotion}", data=result)


@flow(name="forgeline-reproduce", on_completion=[forget_reported_states],
      on_failure=[forget_reported_states, notify_failure])
def reproduce_flow(config: str, overrides: list[str], reproduces: str) -> tuple[str, dict[str, float]]:
    """The stages up to eval of a recorded run's config into fresh outputs, every stage forced;
    registers nothing. Returns the new MLflow run id and the eval metrics."""
    apply_environment_defaults()
    cfg = flow_config(config, overrides)
    tags = prefect_tags() | {REPRODUCES_TAG: reproduces}
    stages = reproduced_stages(cfg)
    name = run_name("reproduce", cfg, with_layout=True)
    with (credentials_masked_in_errors(), final_states_recorded() as states,
          tracked_run(cfg, name, tags=tags) as parent):
        label_flow_run(name, ["reproduce", *run_labels(cfg, [stage.name for stage in stages], True),
                              f"reproduces:{reproduces}"], cfg, parent.run_id)
        results = {stage.name: states.run(configured_task(stage, cfg), cfg, parent.run_id, True)
                   for stage in stages}
        states.message = f"{states.summary()}; MLflow run {parent.run_id}"
    return parent.run_id, results["eval"].metrics
