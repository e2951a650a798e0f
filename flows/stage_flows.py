"""The Prefect tasks and flows of the stages, made from their records (tasks/stage.py): one task
per stage, which the pipeline flow chains, and one flow per stage for rerunning it by hand
(`forgeline stage NAME`, `dvc repro`, or a per-stage deployment). A stage flow reads its inputs
from the upstream output directories named in the config -- or, with `upstream_run`, from the
ones an earlier run recorded -- and records its work as an MLflow run with the stage's run
nested under it, like the pipeline does.

A finished stage is not lost to the Prefect API going away: its report artifact is left out, and
the flow's final states wait for `forgeline sync` (flows/orchestrator.py)."""

from __future__ import annotations

import logging
from typing import Any

from prefect import Flow, Task, flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State, TaskRun
from prefect.runtime import task_run
from prefect.tasks import exponential_backoff

from forgeline.configs import Config
from forgeline.configs.environment import apply_environment_defaults
from forgeline.configs.redaction import credentials_masked_in_errors
from forgeline.flows.hooks import flow_config, notify_failure, prefect_tags
from forgeline.flows.orchestrator import API_ERRORS, final_states_recorded, forget_reported_states
from forgeline.tasks.runner import UPSTREAM_RUN_TAG, reads_layout, run_stage, upstream_outputs
from forgeline.tasks.stage import STAGE_NAMES, STAGES, Stage, resolve, stage_named
from forgeline.tasks.tracking import run_name, tracked_run

log = logging.getLogger(__name__)


def stage_task(stage: Stage) -> Task:
    """`run_stage` of `stage` as a Prefect task. Stage outputs live on disk and the stage cache
    decides what can be reused, so Prefect's input-hash result cache stays off."""

    @task(name=stage.name, cache_policy=NO_CACHE)
    def run(cfg: Config, parent_run_id: str | None = None, force: bool = False,
            from_snapshot: bool = False) -> Any:
        # The task run id is the same for every retry: each attempt resumes into one MLflow run.
        run_key = str(task_run.id) if stage.retries else None
        with credentials_masked_in_errors():
            result = run_stage(stage, cfg, parent_run_id, force, run_key, from_snapshot)
        if stage.report is not None:
            report(stage, result)
        return result

    return run


def report(stage: Stage, result: Any) -> None:
    """The stage's Markdown report as a Prefect artifact. Its outputs and stage record are written
    already: an API that has gone away costs the report, not the finished stage (a raise here
    would fail the task, and retry it)."""
    try:
        create_markdown_artifact(markdown=resolve(stage.report)(result), key=f"forgeline-{stage.name}",
                                 description=stage.summary)
    except API_ERRORS as err:
        log.warning("stage %s finished; its report artifact is left out: the Prefect API could not take it "
                    "(%s: %s)", stage.name, type(err).__name__, err)


STAGE_TASKS = {stage.name: stage_task(stage) for stage in STAGES}


def configured_task(stage: Stage, cfg: Config) -> Task:
    """The stage's task with the retries `cfg` gives it: exponential backoff, and none after an
    error a retry would repeat."""
    base = STAGE_TASKS[stage.name]
    if stage.retries is None:
        return base
    gives_up_on = resolve(stage.gives_up_on) if stage.gives_up_on else ()

    def worth_retrying(task: Task, run: TaskRun, state: State) -> bool:
        return not isinstance(state.result(raise_on_failure=False), gives_up_on)

    return base.with_options(retries=cfg.value(stage.retries),
                             retry_delay_seconds=exponential_backoff(backoff_factor=10),
                             retry_condition_fn=worth_retrying)


def run_one_stage(stage: Stage, config: Config | str | None, overrides: list[str] | None,
                  upstream_run: str | None, force: bool, from_snapshot: bool = False) -> Any:
    """A config path (with `overrides` and `upstream_run` applied here), or a `Config` its caller
    resolved already (the CLI: then `upstream_run` only labels the run)."""
    with credentials_masked_in_errors():
        return _run_one_stage(stage, config, overrides, upstream_run, force, from_snapshot)


def _run_one_stage(stage: Stage, config: Config | str | None, overrides: list[str] | None,
                   upstream_run: str | None, force: bool, from_snapshot: bool) -> Any:
    apply_environment_defaults()
    cfg = flow_config(config, overrides)
    tags = prefect_tags()
    if upstream_run:
        if not isinstance(config, Config):
            cfg = cfg.with_values(upstream_outputs(cfg, stage, upstream_run))
        tags[UPSTREAM_RUN_TAG] = upstream_run
    # `stage train ...` holds the nested `train ...` run, as `pipeline ...` holds all four.
    with (final_states_recorded() as states,
          tracked_run(cfg, run_name(f"stage {stage.name}", cfg, reads_layout(stage)), tags=tags) as parent):
        return states.run(configured_task(stage, cfg), cfg, parent.run_id, force, from_snapshot)


def stage_flow(stage: Stage) -> Flow:
    """The flow of one stage; a stage with a snapshot step also takes `from_snapshot`: build from
    the snapshot already there, reading no source."""
    if stage.snapshot is None:
        def one_stage(config: Config | str | None = None, overrides: list[str] | None = None,
                      upstream_run: str | None = None, force: bool = False) -> Any:
            return run_one_stage(stage, config, overrides, upstream_run, force)
    else:
        def one_stage(config: Config | str | None = None, overrides: list[str] | None = None,
                      upstream_run: str | None = None, force: bool = False,
                      from_snapshot: bool = False) -> Any:
            return run_one_stage(stage, config, overrides, upstream_run, force, from_snapshot)
    one_stage.__doc__ = stage.summary
    return flow(name=f"forgeline-{stage.name}", description=stage.summary,
                on_completion=[forget_reported_states],
                on_failure=[forget_reported_states, notify_failure])(one_stage)


STAGE_FLOWS = {name: stage_flow(stage_named(name)) for name in STAGE_NAMES}


def __getattr__(name: str) -> Flow:
    """`<stage>_flow`, the attribute a deployment's entrypoint names
    (`forgeline.flows.stage_flows:eval_flow`)."""
    stage = name.removesuffix("_flow")
    if name.endswith("_flow") and stage in STAGE_FLOWS:
        return STAGE_FLOWS[stage]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
