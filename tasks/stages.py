"""The four stages as tracked runs: each runs its plain stage function inside an MLflow run
(nested under the pipeline's parent run when there is one) and records its results there.
Plain Python -- the Prefect tasks in prefect_tasks.py only wrap these."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from mlflow import MlflowClient

from forgeline.configs import Config
from forgeline.model.data import MANIFEST_NAME
from forgeline.model.parallel import resolve_precision
from forgeline.tasks import STAGES
from forgeline.tasks.cache import out_dir_tag, outputs_tag, run_cached
from forgeline.tasks.curves import LOSS_PLOT, write_loss_curve
from forgeline.tasks.data import DataResult, build_from_snapshot, preflight_data
from forgeline.tasks.evaluate import (
    METRICS_NAME,
    EvalResult,
    check_task_source,
    evaluate_model,
    plan_tasks,
    read_eval_metrics,
)
from forgeline.tasks.promote import promote
from forgeline.tasks.raw import SOURCES_NAME, take_snapshot
from forgeline.tasks.register import RegisterResult, register_model
from forgeline.tasks.tracking import RunTracker, dvc_hash, resolve_tracking_uri, tracked_run
from forgeline.tasks.train import SUMMARY_NAME, TrainResult, read_train_summary, train_model

DATA_VERSION_TAG = "forgeline.data.dvc_md5"
RAW_VERSION_TAG = "forgeline.data.raw_dvc_md5"  # the raw snapshot the data was built from
DATASET_NAME = "forgeline-data"  # the MLflow dataset; its digest is the DVC hash of data.out_dir
UPSTREAM_RUN_TAG = "forgeline.upstream_run"
UPSTREAM = {stage: STAGES[:index] for index, stage in enumerate(STAGES)}


class MissingInputError(FileNotFoundError):
    """A stage was asked to run before the stages it reads from."""


def stage_output_marker(stage: str, cfg: Config) -> Path:
    """The file a stage writes last: its presence means the stage's output is complete."""
    return {
        "data": Path(cfg.data.out_dir) / MANIFEST_NAME,
        "train": Path(cfg.train.out_dir) / SUMMARY_NAME,
        "eval": Path(cfg.eval.out_dir) / METRICS_NAME,
    }[stage]


def preflight(cfg: Config, stages: tuple[str, ...], from_snapshot: bool = False) -> None:
    """What can be checked before any work when `stages` run in order: the first one's
    upstream outputs exist, every data source (or, for a data stage `from_snapshot`, the raw
    snapshot) and a tokenizer to load are readable, the training precision suits this machine,
    the eval tasks exist."""
    check_stage_inputs(stages[0], cfg)
    if "data" in stages:
        preflight_data(cfg.data, from_snapshot)
    if "train" in stages:
        resolve_precision(cfg.train.precision, "cuda" if torch.cuda.is_available() else "cpu")
    if "eval" in stages:
        plan_tasks(cfg.eval)
        check_task_source(cfg.eval)


def check_stage_inputs(stage: str, cfg: Config) -> None:
    """Fail before any work if an upstream stage's output is missing."""
    missing = [up for up in UPSTREAM[stage] if not stage_output_marker(up, cfg).is_file()]
    if missing:
        paths = ", ".join(str(stage_output_marker(up, cfg)) for up in missing)
        raise MissingInputError(
            f"stage {stage!r} reads the output of {', '.join(missing)}, which is missing ({paths}); "
            f"run `forgeline stage {missing[0]}` first, or the whole pipeline with `forgeline run`"
        )


def upstream_overrides(cfg: Config, stage: str, run_id: str) -> list[str]:
    """Overrides that point `stage` at the upstream outputs the earlier run `run_id` (a pipeline or
    stage run) recorded, after checking they are still what that run wrote."""
    tags = MlflowClient(resolve_tracking_uri(cfg)).get_run(run_id).data.tags
    overrides = []
    for up in UPSTREAM[stage]:
        if out_dir_tag(up) not in tags:
            raise MissingInputError(f"run {run_id} recorded no {up} stage output; pick a run whose "
                                    f"{up} stage finished (`forgeline compare` shows its tags)")
        out_dir = tags[out_dir_tag(up)]
        recorded = tags[outputs_tag(up)]
        if not Path(out_dir).is_dir() or dvc_hash(out_dir) != recorded:
            raise MissingInputError(f"the {up} output of run {run_id} at {out_dir} is gone or has changed "
                                    f"since (md5 {recorded}); rerun `forgeline stage {up}`")
        overrides.append(f"{up}.out_dir={out_dir}")
    return overrides


def _on_parent(cfg: Config, parent_run_id: str | None) -> RunTracker | None:
    if parent_run_id is None:
        return None
    return RunTracker(MlflowClient(resolve_tracking_uri(cfg)), parent_run_id)


def run_data_stage(cfg: Config, parent_run_id: str | None = None, force: bool = False,
                   from_snapshot: bool = False) -> DataResult:
    """The snapshot of the raw inputs -- taken on every run, like dvc.yaml's always-changed
    `sources` stage; with `from_snapshot` the one in data.raw_dir is used -- then the build
    from it, skipped when the snapshot, config and code are an earlier run's (stage caching)."""
    preflight_data(cfg.data, from_snapshot)
    parent = _on_parent(cfg, parent_run_id)
    with tracked_run(cfg, "data", parent_run_id) as run:
        if not from_snapshot:
            take_snapshot(cfg.data)
        result = run_cached("data", cfg, run, parent, DataResult, lambda: build_from_snapshot(cfg), force)
        metrics = {"documents": result.documents, "train_tokens": result.train_tokens,
                   "train_samples": result.train_samples, "val_samples": result.val_samples}
        lineage = {DATA_VERSION_TAG: dvc_hash(result.out_dir),
                   "forgeline.data.manifest_sha256": result.manifest_sha256}
        run.log_metrics(metrics)
        run.set_tags({**lineage, RAW_VERSION_TAG: dvc_hash(cfg.data.raw_dir)})
        run.log_dataset(DATASET_NAME, result.out_dir, lineage[DATA_VERSION_TAG], "output")
        run.log_artifact(Path(result.out_dir) / MANIFEST_NAME, "data")
        run.log_artifact(Path(cfg.data.raw_dir) / SOURCES_NAME, "data")
        run.log_artifact(Path(result.out_dir) / "tokenizer", "data/tokenizer")
        if parent:
            parent.set_tags(lineage)
            parent.log_dataset(DATASET_NAME, result.out_dir, lineage[DATA_VERSION_TAG], "training")
            parent.log_metrics({f"data/{k}": v for k, v in metrics.items()})
    return result


def run_train_stage(cfg: Config, parent_run_id: str | None = None, run_key: str | None = None,
                    force: bool = False) -> TrainResult:
    """`run_key` (e.g. the Prefect task run id) makes a retry resume into the same MLflow run."""
    parent = _on_parent(cfg, parent_run_id)
    with tracked_run(cfg, "train", parent_run_id, run_key=run_key) as run:
        run.log_params({k: v for k, v in cfg.flat().items()
                        if k.split(".")[0] in ("model", "parallel", "train", "checkpoint")})
        run.log_dataset(DATASET_NAME, cfg.data.out_dir, dvc_hash(cfg.data.out_dir), "training")

        def train_and_plot() -> TrainResult:
            trained = train_model(cfg, mlflow_run_id=run.run_id)
            write_loss_curve(run.client, run.run_id, Path(trained.out_dir))
            return trained

        result = run_cached("train", cfg, run, parent, TrainResult, train_and_plot, force)
        summary = {"final_loss": result.loss, "tokens_seen": result.tokens_seen,
                   "worker_failures": len(result.failures)}
        run.log_metrics(summary, step=result.step)
        checkpoint = {"forgeline.checkpoint": str(Path(result.checkpoint).resolve()),
                      "forgeline.checkpoint_uri": checkpoint_uri(cfg, result.checkpoint)}
        failures = {f"forgeline.worker_failure.{i + 1}": why for i, why in enumerate(result.failures)}
        run.set_tags(checkpoint | failures)
        run.log_artifact(Path(result.out_dir) / "config.yaml")
        run.log_artifact(Path(result.out_dir) / LOSS_PLOT, "train")
        if parent:
            parent.log_artifact(Path(result.out_dir) / LOSS_PLOT, "train")
            parent.log_metrics({f"train/{k}": v for k, v in summary.items()}, step=result.step)
            parent.set_tags({**checkpoint, "forgeline.train_run_id": run.run_id})
    return result


def checkpoint_uri(cfg: Config, checkpoint: str) -> str:
    """Where the checkpoint lives for good: its upload under checkpoint.persistent_url, else the
    local directory."""
    if cfg.checkpoint.persistent_url:
        return f"{cfg.checkpoint.persistent_url.rstrip('/')}/{Path(checkpoint).name}"
    return Path(checkpoint).resolve().as_uri()


def run_eval_stage(cfg: Config, parent_run_id: str | None = None, force: bool = False) -> EvalResult:
    parent = _on_parent(cfg, parent_run_id)
    with tracked_run(cfg, "eval", parent_run_id) as run:
        run.log_params({k: v for k, v in cfg.flat().items() if k.startswith("eval.")})
        result = run_cached("eval", cfg, run, parent, EvalResult, lambda: evaluate_model(cfg), force)
        run.log_metrics(result.metrics)
        for name in ("report.json", "lm_eval_results.json", "dimensions.png"):
            run.log_artifact(Path(result.out_dir) / name, "eval")
        if parent:
            parent.log_metrics({f"eval/{k}": v for k, v in result.metrics.items()})
            parent.log_artifact(Path(result.out_dir) / "dimensions.png", "eval")
    return result


def run_register_stage(cfg: Config, parent_run_id: str | None = None, force: bool = False) -> RegisterResult:
    train = read_train_summary(cfg)
    scores = read_eval_metrics(cfg)
    data_version = dvc_hash(cfg.data.out_dir)
    parent = _on_parent(cfg, parent_run_id)
    with tracked_run(cfg, "register", parent_run_id) as run:
        version_tags = {DATA_VERSION_TAG: data_version, "forgeline.checkpoint_step": str(train.step),
                        **{f"eval.{k}": f"{v:.6g}" for k, v in scores.items()
                           if k == "overall" or k.startswith("dimension/")}}
        if parent_run_id:
            version_tags["forgeline.pipeline_run_id"] = parent_run_id

        def register_and_promote() -> RegisterResult:
            registered = register_model(cfg, run, train.checkpoint,
                                        str(Path(cfg.data.out_dir) / "tokenizer"), version_tags)
            decision = promote(run.client, cfg.registry, registered.version)
            return replace(registered, promotion=decision.describe())

        result = run_cached("register", cfg, run, parent, RegisterResult, register_and_promote, force)
        run.set_tags({"forgeline.model_version": result.version})
        if parent:
            parent.set_tags({"forgeline.model_name": result.model_name,
                             "forgeline.model_version": result.version})
    return result
