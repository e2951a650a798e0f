"""MLflow runs of a pipeline: one parent run per pipeline run, one nested run per stage.

Everything goes through `MlflowClient` with explicit run ids (not the fluent API's global
active-run stack), so stages can run in Prefect's worker threads and in torchrun children.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from dvc_data.hashfile.build import build
from dvc_data.hashfile.db import HashFileDB
from dvc_objects.fs.local import LocalFileSystem
from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from forgeline.configs import Config
from forgeline.tasks.stage import PACKAGE_ROOT

log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
# Lineage: the DVC md5 of the data stage's output, and of the raw snapshot it was built from.
DATA_VERSION_TAG = "forgeline.data.dvc_md5"
RAW_VERSION_TAG = "forgeline.data.raw_dvc_md5"
DATASET_NAME = "forgeline-data"  # the MLflow dataset; its digest is the DVC hash of data.out_dir
RUN_KEY_TAG = "forgeline.run_key"  # identifies the work a run records, across retries
ATTEMPT_TAG = "forgeline.attempts"
# The experiment kind MLflow's UI writes when a user picks one: `custom_model_development`
# ("Machine learning") opens the experiment on its runs in UIs that read it (the kind selector's
# code path in the bundled JS). MLflow 3.17's UI decides by its sidebar switch instead (`?workflowType=`).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
MAX_PARAMS_PER_BATCH = 100
SYSTEM_METRICS_INTERVAL_S = 5
REDACTED = "***"
# Keys whose last part names a credential (`hf_token`, `ops.webhook_url`); a URL's password
# (scheme://user:PASSWORD@host) is one wherever it appears.
SECRET_KEY = re.compile(r"(?:\w+_)?(?:token|password|passwd|secret|secret_key|webhook|webhook_url|"
                        r"api_key|credentials?)", re.IGNORECASE)
URL_PASSWORD = re.compile(r"(?<=://)([^/@:\s]+):([^/@\s]+)@")


def redact(key: str, value: Any) -> Any:
    """`value` with any credential in it replaced, so that no secret lands in MLflow."""
    if isinstance(value, dict):
        return {k: redact(k, v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(key, v) for v in value]
    if SECRET_KEY.fullmatch(re.split(r"[./]", key)[-1]) and value not in (None, ""):
        return REDACTED
    if isinstance(value, str):
        return URL_PASSWORD.sub(rf"\1:{REDACTED}@", value)
    return value


def resolve_tracking_uri(cfg: Config) -> str:
    """Config, else $MLFLOW_TRACKING_URI, else the local sqlite store; relative sqlite and
    file paths are made absolute so child processes in other directories agree."""
    uri = cfg.registry.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri.removeprefix("sqlite:///")).resolve())
    if "://" not in uri:
        return Path(uri).resolve().as_uri()
    return uri


def resolve_artifact_location(location: str) -> str:
    return location if "://" in location else Path(location).resolve().as_uri()


def git_info(cwd: str | Path = PACKAGE_ROOT) -> dict[str, str]:
    """Commit and dirty flag of the checkout forgeline runs from, and with uncommitted changes
    the sha256 of their diff: together the code version. 'unknown' when forgeline is not
    installed from a git checkout."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"git.commit": "unknown", "git.dirty": "unknown"}
    status = git("status", "--porcelain", "--untracked-files=no")
    info = {"git.commit": commit, "git.dirty": str(bool(status)).lower()}
    if status:
        info["git.diff_sha256"] = hashlib.sha256((git("diff", "HEAD") or "").encode()).hexdigest()
    return info


@dataclass
class RunTracker:
    """One MLflow run, addressed by id."""

    client: MlflowClient
    run_id: str

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if not metrics:
            return
        now = _now_ms()
        self.client.log_batch(self.run_id, metrics=[
            Metric(key, float(value), now, step or 0) for key, value in metrics.items()
        ])

    def log_params(self, params: dict[str, Any]) -> None:
        items = [Param(k, str(redact(k, v))) for k, v in params.items()]
        for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[start:start + MAX_PARAMS_PER_BATCH])

    def set_tags(self, tags: dict[str, Any]) -> None:
        if tags:
            self.client.log_batch(self.run_id, tags=[RunTag(k, str(redact(k, v))) for k, v in tags.items()])

    def log_dataset(self, name: str, path: str | Path, digest: str, context: str) -> None:
        """An input dataset of the run, identified by its DVC hash (the digest MLflow shows)."""
        source = Path(path).resolve().as_uri()
        dataset = Dataset(name=name, digest=digest, source_type="local", source=source)
        self.client.log_inputs(self.run_id, datasets=[
            DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)


def experiment_id(client: MlflowClient, cfg: Config) -> str:
    """The id of the experiment `cfg` logs to, created if missing; marked as holding training
    runs unless its kind is set already (an older forgeline created it without, or the user
    chose one in the UI)."""
    name = cfg.registry.experiment
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(
                name, artifact_location=resolve_artifact_location(cfg.registry.artifact_location),
                tags={EXPERIMENT_KIND_TAG: TRAINING_KIND})
        except MlflowException:  # created concurrently by another process
            found = client.get_experiment_by_name(name)
    if EXPERIMENT_KIND_TAG not in found.tags:
        client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
    return found.experiment_id


def layout_label(cfg: Config) -> str:
    """The parallel layout in a few characters: `dp1` on one rank, `pp2xdp2`, `dp4xtp2` (dp counts
    every data-parallel rank, replicated or sharded; the `forgeline.layout` tag splits it)."""
    par = cfg.parallel
    degrees = [f"pp{par.pp}"] if par.pp > 1 else []
    degrees.append(f"dp{par.dp}")
    if par.tp > 1:
        degrees.append(f"tp{par.tp}")
    return "x".join(degrees)


def run_name(what: str, cfg: Config, with_layout: bool, code: dict[str, str] | None = None) -> str:
    """A run's name that says what it is in the runs table: `what` ran (a stage, `pipeline`), for
    which model, on which layout (`with_layout`: for the runs that train), at which commit (of
    `code`, default this checkout's; `-dirty` with uncommitted changes):
    `train forgeline-tiny pp2xdp2 @1a2b3c4-dirty`. The registered model's name stands for the
    config: a Config does not know the file it was read from."""
    code = git_info() if code is None else code
    parts = [what, cfg.registry.model_name]
    if with_layout:
        parts.append(layout_label(cfg))
    if code["git.commit"] != "unknown":
        parts.append("@" + code["git.commit"][:7] + ("-dirty" if code["git.dirty"] == "true" else ""))
    return " ".join(parts)


@contextmanager
def tracked_run(cfg: Config, name: str, parent_run_id: str | None = None,
                tags: dict[str, str] | None = None, run_key: str | None = None) -> Iterator[RunTracker]:
    """An MLflow run for the block: nested under `parent_run_id` if given, else a top-level
    run that carries the flattened config and git lineage itself. Marked FINISHED, or FAILED
    (with the error as a tag) if the block raises. With `run_key`, a retry of the same work
    reopens the run created under that key instead of starting another."""
    client = MlflowClient(tracking_uri=resolve_tracking_uri(cfg))
    experiment = experiment_id(client, cfg)
    run = _run_with_key(client, experiment, run_key) if run_key else None
    if run is None:
        run_tags = {MLFLOW_RUN_NAME: name, **(tags or {})}
        if parent_run_id:
            run_tags[MLFLOW_PARENT_RUN_ID] = parent_run_id
        if run_key:
            run_tags[RUN_KEY_TAG] = run_key
        run = client.create_run(experiment, tags=run_tags, run_name=name)
        tracker = RunTracker(client, run.info.run_id)
        if not parent_run_id:
            tracker.log_params(cfg.flat())
            tracker.set_tags(git_info() | run_context_tags(cfg))
            client.log_text(tracker.run_id, yaml.safe_dump(redact("", cfg.model_dump(mode="json")),
                                                           sort_keys=False), "config.yaml")
            if Path(DVC_LOCK).is_file():
                tracker.log_artifact(DVC_LOCK)
        attempt = 1
    else:
        tracker = RunTracker(client, run.info.run_id)
        attempt = int(run.data.tags.get(ATTEMPT_TAG, "1")) + 1
        client.update_run(tracker.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
    tracker.set_tags({ATTEMPT_TAG: attempt})
    log.info("MLflow run %s (%s, attempt %d) in %s", tracker.run_id, name, attempt, client.tracking_uri)
    # CPU, memory, disk and network (and GPU when there is one) of the work, not of the waiting
    # parent: sampled for stage runs only.
    monitor = SystemMetricsMonitor(tracker.run_id, sampling_interval=SYSTEM_METRICS_INTERVAL_S,
                                   resume_logging=attempt > 1,
                                   tracking_uri=client.tracking_uri) if parent_run_id else None
    if monitor:
        monitor.start()
    try:
        yield tracker
    except BaseException as err:
        tracker.set_tags({f"forgeline.attempt.{attempt}.error": f"{type(err).__name__}: {err}"[:5000]})
        client.set_terminated(tracker.run_id, RunStatus.to_string(RunStatus.FAILED))
        raise
    finally:
        if monitor:
            monitor.finish()
    client.set_terminated(tracker.run_id, RunStatus.to_string(RunStatus.FINISHED))


DVC_LOCK = "dvc.lock"


def run_context_tags(cfg: Config) -> dict[str, str]:
    """The parallel layout and, when the run starts in a DVC repository, the output hashes its
    dvc.lock records (`dvc.lock.<stage>` -> md5 of each out)."""
    par = cfg.parallel
    tags = {"forgeline.layout": f"pp{par.pp} x dp_replicate{par.dp_replicate} x dp_shard{par.dp_shard} "
                                f"x tp{par.tp} = {par.world_size} ranks on {par.nnodes} node(s)"}
    if Path(DVC_LOCK).is_file():
        lock = yaml.safe_load(Path(DVC_LOCK).read_text()) or {}
        for stage, entry in lock.get("stages", {}).items():
            for out in entry.get("outs", []):
                tags[f"dvc.lock.{stage}.{out['path']}"] = out.get("md5", "")
    return tags


def _run_with_key(client: MlflowClient, experiment: str, run_key: str):
    found = client.search_runs([experiment], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'",
                               max_results=1)
    return found[0] if found else None


def dvc_hash(path: str | Path) -> str:
    """The md5 DVC records for `path` in dvc.lock (a `.dir` hash for directories), computed
    without touching the DVC cache, so runs outside `dvc repro` carry the same data version."""
    fs = LocalFileSystem()
    with tempfile.TemporaryDirectory() as scratch:
        _, _, obj = build(HashFileDB(fs, scratch), str(Path(path).resolve()), fs, "md5",
                          dry_run=True)
    return obj.hash_info.value


def _now_ms() -> int:
    return int(time.time() * 1000)


def registry_input(cfg: Config) -> dict[str, str]:
    """The register stage's input DVC does not see: the registry a version was written to is part of
    what registering did. (Here, not in register.py: `forgeline status` decides every stage's cache
    without importing what the stages run.)"""
    return {"tracking_uri": resolve_tracking_uri(cfg)}


def version_still_registered(cfg: Config, result: dict[str, Any]) -> str | None:
    """Why an earlier registration no longer holds: its model version is gone."""
    try:
        MlflowClient(resolve_tracking_uri(cfg)).get_model_version(result["model_name"], result["version"])
    except MlflowException:
        return f"model version {result['model_name']}/{result['version']} is gone from the registry"
    return None
