"""Prefect tasks: thin, typed wrappers over the tracked stage functions in stages.py."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from forgeline.configs import Config
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
def data_task(cfg: Config, parent_run_id: str | None = None) -> DataResult:
    return run_data_stage(cfg, parent_run_id)


@task(name="train", cache_policy=NO_CACHE)
def train_task(cfg: Config, parent_run_id: str | None = None) -> TrainResult:
    return run_train_stage(cfg, parent_run_id)


@task(name="eval", cache_policy=NO_CACHE)
def eval_task(cfg: Config, parent_run_id: str | None = None) -> EvalResult:
    return run_eval_stage(cfg, parent_run_id)


@task(name="register", cache_policy=NO_CACHE)
def register_task(cfg: Config, parent_run_id: str | None = None) -> RegisterResult:
    return run_register_stage(cfg, parent_run_id)
