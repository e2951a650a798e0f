"""One flow per stage, for rerunning a single stage by hand (`forgeline stage NAME`,
`dvc repro`, or a per-stage deployment). Each reads its inputs from the upstream stages'
output directories named in the config."""

from __future__ import annotations

from prefect import flow

from forgeline.configs import load_config
from forgeline.tasks.data import DataResult
from forgeline.tasks.evaluate import EvalResult
from forgeline.tasks.prefect_tasks import data_task, eval_task, register_task, retrying_train_task
from forgeline.tasks.register import RegisterResult
from forgeline.tasks.train import TrainResult


@flow(name="forgeline-data")
def data_flow(config: str | None = None, overrides: list[str] | None = None) -> DataResult:
    """Corpus -> tokenizer -> packed webdataset shards and manifest."""
    return data_task(load_config(config, overrides or []))


@flow(name="forgeline-train")
def train_flow(config: str | None = None, overrides: list[str] | None = None) -> TrainResult:
    """torchrun training from the data stage's shards to a committed checkpoint."""
    cfg = load_config(config, overrides or [])
    return retrying_train_task(cfg)(cfg)


@flow(name="forgeline-eval")
def eval_flow(config: str | None = None, overrides: list[str] | None = None) -> EvalResult:
    """lm-eval on the train stage's checkpoint."""
    return eval_task(load_config(config, overrides or []))


@flow(name="forgeline-register")
def register_flow(config: str | None = None, overrides: list[str] | None = None) -> RegisterResult:
    """Register the trained, evaluated model as a new MLflow model version."""
    return register_task(load_config(config, overrides or []))


STAGE_FLOWS = {"data": data_flow, "train": train_flow, "eval": eval_flow, "register": register_flow}
