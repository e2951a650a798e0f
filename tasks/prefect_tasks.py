"""Prefect tasks: thin, typed wrappers over the tracked stage functions in stages.py."""

from __future__ import annotations

from prefect import Task, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State, TaskRun
from prefect.runtime import task_run
from prefect.tasks import exponential_backoff

from forgeline.configs import Config
from forgeline.model.callbacks import TrainingUnstable
from forgeline.tasks.data import DataResult
from forgeline.tasks.evaluate import EvalResult
from forgeline.tasks.register import RegisterResult
from forgeline.tasks.stages import (
    run_data_stage,
    run_eval_stage,
    run_register_stage,
    run_train_stage,
)
from forgeline.tasks.train import TrainResult

# Stage outputs live on disk and the stages themselves decide what can be reused, so
# Prefect's input-hash result cache stays off.


@task(name="data", cache_policy=NO_CACHE)
def data_task(cfg: Config, parent_run_id: str | None = None, force: bool = False,
              from_snapshot: bool = False) -> DataResult:
    return run_data_stage(cfg, parent_run_id, force, from_snapshot)


@task(name="train", cache_policy=NO_CACHE)
def train_task(cfg: Config, parent_run_id: str | None = None, force: bool = False) -> TrainResult:
    # The task run id is the same for every retry: each attempt resumes into one MLflow run.
    return run_train_stage(cfg, parent_run_id, run_key=str(task_run.id), force=force)


def retrying_train_task(cfg: Config) -> Task:
    """train_task with the job-level retries of `cfg`: exponential backoff, none after a run
    gave up on instability (a retry would fail the same way)."""
    return train_task.with_options(
        retries=cfg.train.job_retries,
        retry_delay_seconds=exponential_backoff(backoff_factor=10),
        retry_condition_fn=_not_unstable,
    )


def _not_unstable(task: Task, task_run: TaskRun, state: State) -> bool:
    return not isinstance(state.result(raise_on_failure=False), TrainingUnstable)


@task(name="eval", cache_policy=NO_CACHE)
def eval_task(cfg: Config, parent_run_id: str | None = None, force: bool = False) -> EvalResult:
    result = run_eval_stage(cfg, parent_run_id, force)
    create_markdown_artifact(markdown=result.markdown(), key="forgeline-eval",
                             description="Chance-normalized scores per capability dimension")
    return result


@task(name="register", cache_policy=NO_CACHE)
def register_task(cfg: Config, parent_run_id: str | None = None, force: bool = False) -> RegisterResult:
    return run_register_stage(cfg, parent_run_id, force)
