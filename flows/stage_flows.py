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
from prefect.runtime import flow_run, task_run
from prefect.states import Completed
from prefect.tasks import exponential_backoff

from forgeline.configs import Config
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
from forgeline.flows.orchestrator import API_ERRORS, CACHED, final_states_recorded, forget_reported_states
from forgeline.tasks.runner import UPSTREAM_RUN_TAG, StageRun, reads_layout, tracked_stage, upstream_outputs
from forgeline.tasks.stage import STAGE_NAMES, STAGES, Stage, resolve, stage_named
from forgeline.tasks.tracking import run_name, tracked_run

log = logging.getLogger(__name__)


def stage_task(stage: Stage) -> Task:
    """`run_stage` of `stage` as a Prefect task. Stage outputs live on disk and the stage cache
    decides what can be reused, so Prefect's input-hash result cache stays off; a stage the cache
    skipped ends Completed all the same, in a state named `Cached` whose message says whose result
    it reused."""

    @task(name=stage.name, cache_policy=NO_CACHE)
    def run(cfg: Config, parent_run_id: str | None = None, force: bool = False,
            from_snapshot: bool = False) -> Any:
        # The task run id is the same for every retry: each attempt resumes into one MLflow run.
        run_key = str(task_run.id) if stage.retries else None
        with credentials_masked_in_errors():
            done = tracked_stage(stage, cfg, parent_run_id, force, run_key, from_snapshot)
        report(stage, cfg, done, parent_run_id)
        if done.reused is None:
            return done.result
        return Completed(name=CACHED, data=done.result,
                         message=f"skipped: inputs unchanged and outputs verified; the result of MLflow run "
                                 f"{done.reused}, recorded in run {done.run_id}")

    return run


# Reports made in this layer: they read what the stage recorded in the registry the config names.
# (cfg, result) -> Markdown, by reference: the register stage's imports MLflow's model code.
REGISTRY_REPORTS = {"register": "forgeline.flows.reports:registration_markdown"}


def report(stage: Stage, cfg: Config, done: StageRun, parent_run_id: str | None) -> None:
    """The stage's Markdown report as a Prefect artifact, keyed by the flow and the MLflow run it
    belongs to (`forgeline-pipeline-eval-<run id>`, `forgeline-eval-eval-<run id>`): a standalone
    rerun's report is not a new version of a pipeline's. Its outputs and stage record are written
    already: an API that has gone away costs the report, not the finished stage (a raise here
    would fail the task, and retry it)."""
    if stage.report is None and stage.name not in REGISTRY_REPORTS:
        return
    run_id = parent_run_id or done.run_id
    try:
        markdown = (resolve(REGISTRY_REPORTS[stage.name])(cfg, done.result) if stage.name in REGISTRY_REPORTS
                    else resolve(stage.report)(done.result))
        create_markdown_artifact(markdown=markdown, key=f"{flow_run.flow_name}-{stage.name}-{run_id}",
                                 description=f"{stage.name}: {stage.summary}. MLflow run {run_id}"
                                             + (f", reusing run {done.reused}" if done.reused else ""))
    except API_ERRORS as err:
        log.warning("stage %s finished; its report artifact is left out: the Prefect API could not take it "
                    "(%s: %s)", stage.name, type(err).__name__, err)


STAGE_TASKS = {stage.name: stage_task(stage) for stage in STAGES}


def configured_task(stage: Stage, cfg: Config) -> Task:
    """The stage's task named as its MLflow run is (`train tiny dp1 @1a2b3c4`), tagged with the
    stage, config, model, layout and commit, with the retries `cfg` gives it: exponential backoff,
    and none after an error a retry would repeat."""
    layout = reads_layout(stage)
    named = STAGE_TASKS[stage.name].with_options(task_run_name=run_name(stage.name, cfg, layout),
                                                 tags=run_labels(cfg, [stage.name], layout))
    if stage.retries is None:
        return named
    gives_up_on = resolve(stage.gives_up_on) if stage.gives_up_on else ()

    def worth_retrying(task: Task, run: TaskRun, state: State) -> bool:
        return not isinstance(state.result(raise_on_failure=False), gives_up_on)

    return named.with_options(retries=cfg.value(stage.retries),
                              retry_delay_seconds=exponential_backoff(backoff_factor=10),
                              retry_condition_fn=worth_retrying)


def run_one_stage(stage: Stage, config: str | None, overrides: list[str] | None,
                  upstream_run: str | None, force: bool, from_snapshot: bool = False) -> Any:
    """A config path, with `overrides` and `upstream_run` applied here."""
    with credentials_masked_in_errors():
        return _run_one_stage(stage, config, overrides, upstream_run, force, from_snapshot)


def _run_one_stage(stage: Stage, config: str | None, overrides: list[str] | None,
                   upstream_run: str | None, force: bool, from_snapshot: bool) -> Any:
    apply_environment_defaults()
    cfg = flow_config(config, overrides)
    tags = prefect_tags()
    if upstream_run:
        cfg = cfg.with_values(upstream_outputs(cfg, stage, upstream_run))
        tags[UPSTREAM_RUN_TAG] = upstream_run
    # `stage train ...` holds the nested `train ...` run, as `pipeline ...` holds all four.
    name = run_name(f"stage {stage.name}", cfg, reads_layout(stage))
    labels = run_labels(cfg, [stage.name], reads_layout(stage))
    if upstream_run:
        labels.append(f"upstream:{upstream_run}")
    with final_states_recorded() as states, tracked_run(cfg, name, tags=tags) as parent:
        label_flow_run(name, labels, cfg, parent.run_id)
        result = states.run(configured_task(stage, cfg), cfg, parent.run_id, force, from_snapshot)
        states.message = f"{states.summary()}; {mlflow_link(cfg, parent.run_id)}"
    return Completed(message=states.message, data=result)  # the caller gets `result`


CONFIG_DOC = ("a run config: a YAML path, relative to the deployment's working directory, or the name "
              "of a shipped one (tiny.yaml, debug.yaml, smollm2-sft.yaml ...). `forgeline config show "
              "--docs` lists its fields.")
OVERRIDES_DOC = ("config values to change, one `section.key=value` each, applied after the file: e.g. "
                 "train.steps=50, parallel.dp_shard=2, eval.out_dir=artifacts/eval-rerun (a JSON list).")
FORCE_DOC = ("run every stage even where the stage cache would skip it (inputs -- config section, "
             "upstream outputs, code -- unchanged and outputs verified). Off: such a stage ends Cached.")
UPSTREAM_RUN_DOC = ("the MLflow run id of an earlier pipeline or stage run: read the upstream stages' "
                    "outputs it recorded (checked unchanged) instead of the directories the config names.")
FROM_SNAPSHOT_DOC = ("build from the raw snapshot already in data.raw_dir, reading no source; fails if it "
                     "is missing, damaged or was taken for another config.")


def stage_flow(stage: Stage) -> Flow:
    """The flow of one stage; a stage with a snapshot step also takes `from_snapshot`: build from
    the snapshot already there, reading no source. Its docstring documents the parameters in the
    deployment's run form (Prefect reads a Google-style Args section)."""
    if stage.snapshot is None:
        def one_stage(config: str | None = None, overrides: list[str] | None = None,
                      upstream_run: str | None = None, force: bool = False) -> Any:
            return run_one_stage(stage, config, overrides, upstream_run, force)
    else:
        def one_stage(config: str | None = None, overrides: list[str] | None = None,
                      upstream_run: str | None = None, force: bool = False,
                      from_snapshot: bool = False) -> Any:
            return run_one_stage(stage, config, overrides, upstream_run, force, from_snapshot)
    args = {"config": CONFIG_DOC + " Default: tiny.yaml.", "overrides": OVERRIDES_DOC,
            "upstream_run": UPSTREAM_RUN_DOC, "force": FORCE_DOC.replace("every stage", "the stage")}
    if stage.snapshot is not None:
        args["from_snapshot"] = FROM_SNAPSHOT_DOC
    one_stage.__doc__ = google_docstring(f"The {stage.name} stage: {stage.summary}.", args)
    return flow(name=f"forgeline-{stage.name}", description=stage.summary,
                on_completion=[forget_reported_states],
                on_failure=[forget_reported_states, notify_failure])(one_stage)


def google_docstring(summary: str, args: dict[str, str]) -> str:
    return summary + "\n\nArgs:\n" + "".join(f"    {name}: {text}\n" for name, text in args.items())


STAGE_FLOWS = {name: stage_flow(stage_named(name)) for name in STAGE_NAMES}


def __getattr__(name: str) -> Flow:
    """`<stage>_flow`, the attribute a deployment's entrypoint names
    (`forgeline.flows.stage_flows:eval_flow`)."""
    stage = name.removesuffix("_flow")
    if name.endswith("_flow") and stage in STAGE_FLOWS:
        return STAGE_FLOWS[stage]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
