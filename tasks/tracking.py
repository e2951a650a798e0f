"""MLflow runs of a pipeline: one parent run per pipeline run, one nested run per stage.

Everything goes through `MlflowClient` with explicit run ids (not the fluent API's global
active-run stack), so stages can run in Prefect's worker threads and in torchrun children.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml
from dvc_data.hashfile.build import build
from dvc_data.hashfile.db import HashFileDB
from dvc_objects.fs.local import LocalFileSystem
from mlflow import MlflowClient
from mlflow.entities import RunStatus
from mlflow.exceptions import MlflowException
from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from forgeline.configs import Config
from forgeline.configs.redaction import REDACTED, scrub
from forgeline.model.spool import TrackingSpool, discard_sent, replay, spool_files, spooled_metric
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
# code path in the bundled JS). MLflow 3.17's UI ignores it: with its workflow-based navigation
# (always on in 3.17.2's bundle) the kind follows the sidebar switch, `?workflowType=` in the
# address, else the browser's last choice, else GenAI -- no experiment can set it (run_link).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
SYSTEM_METRICS_INTERVAL_S = 5
LOSS_CURVE_METRIC = "loss"  # the ranks' per-step training loss (tasks/train/curves.py)
# Keys whose last part names a credential (`hf_token`, `ops.webhook_url`); a URL's password
# (scheme://user:PASSWORD@host) is one wherever it appears.
SECRET_KEY = re.compile(r"(?:\w+_)?(?:token|password|passwd|secret|secret_key|webhook|webhook_url|"
                        r"api_key|credentials?)", re.IGNORECASE)


def redact(key: str, value: Any) -> Any:
    """`value` with any credential in it replaced, so that no secret lands in MLflow."""
    if isinstance(value, dict):
        return {k: redact(k, v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(key, v) for v in value]
    if SECRET_KEY.fullmatch(re.split(r"[./]", key)[-1]) and value not in (None, ""):
        return REDACTED
    if isinstance(value, str):
        return scrub(value)
    return value


def resolve_tracking_uri(cfg: Config) -> str:
    """Config, else $MLFLOW_TRACKING_URI, else the local sqlite store; relative sqlite and
    file paths are made absolute so child processes in other directories agree. A sqlite store
    is made ready for concurrent writers first (`prepare_sqlite_store`)."""
    uri = cfg.registry.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    if uri.startswith("sqlite:///"):
        if not uri.startswith("sqlite:////"):
            uri = "sqlite:///" + str(Path(uri.removeprefix("sqlite:///")).resolve())
        prepare_sqlite_store(uri)
        return uri
    if "://" not in uri:
        return Path(uri).resolve().as_uri()
    return uri


class ServerUnreachable(ValueError):
    """A server the command needs does not answer at its start: nothing has run."""


def check_tracking_server(cfg: Config, timeout_s: float = 5.0) -> None:
    """Raise ServerUnreachable, before any work, if the tracking URI is a server (http, https)
    that takes no connection or does not answer within `timeout_s`: each stage's run starts
    there (once a run exists, an outage costs nothing: the spool waits). Any HTTP answer counts,
    an error status included: a server that refuses the request says why itself."""
    uri = resolve_tracking_uri(cfg)
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        requests.get(uri, timeout=timeout_s)
    except requests.RequestException as err:
        timed_out = isinstance(err, requests.Timeout)
        reason = f"no answer within {timeout_s:.0f} s" if timed_out else "no connection"
        where = "registry.tracking_uri" if cfg.registry.tracking_uri else "$MLFLOW_TRACKING_URI"
        raise ServerUnreachable(
            f"the MLflow tracking server at {scrub(uri)} does not answer ({reason}): start it (`mlflow "
            f"server`), or point {where} at one that runs; with neither set, runs go to the local store "
            f"{DEFAULT_TRACKING_URI}") from None


@functools.cache  # once per process and store: what it sets persists in the file
def prepare_sqlite_store(uri: str) -> None:
    """Make the sqlite store at `uri` (an absolute sqlite:/// URI) safe for concurrent writers, one
    process at a time (an flock on `<db>.lock`): processes that open a new store at once otherwise
    all run MLflow's schema migrations on it, fail ("table ... already exists") and can leave it
    half-migrated for good. Here the first creates the schema and the others find it. Its journal
    goes to WAL mode, so that readers never wait for the writer nor the writer for readers;
    writers take turns, each waiting up to MLflow's busy timeout (20 s). Both persist in the
    file, so a process prepares each store once."""
    import fcntl
    import sqlite3

    path = Path(uri.removeprefix("sqlite:///").partition("?")[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        db = sqlite3.connect(path, timeout=60)
        try:
            db.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError as err:  # another program holds it open in another mode
            log.warning("%s stays in its journal mode (%s): concurrent readers and writers wait for each "
                        "other", path, err)
        finally:
            db.close()
        MlflowClient(uri)  # creates the schema of a new store, or checks it is current


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
    """One MLflow run, addressed by id. Its writes go through this process's tracking spool
    (model/spool.py): while the store answers they are sent before a call returns, while it does
    not they wait in the spool and the call returns at once."""

    client: MlflowClient
    run_id: str
    spool: TrackingSpool
    earlier_params: dict[str, str] = field(default_factory=dict)
    """Of a reopened run: the params its earlier attempts logged (MLflow refuses another value)."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        now = _now_ms()
        self.spool.log_batch([(key, float(value), now, step or 0) for key, value in metrics.items()],
                             wait=True)

    def log_params(self, params: dict[str, Any]) -> None:
        """Params; in a reopened run, one an earlier attempt logged with another value -- a setting
        that does not change what is computed, as a continued training's resume check ensures
        (train.timeout_s, train.callbacks) -- as tag `forgeline.param_changed.<key>` instead."""
        values = {k: str(redact(k, v)) for k, v in params.items()}
        changed = {k: v for k, v in values.items() if self.earlier_params.get(k, v) != v}
        self.spool.log_batch(params={k: v for k, v in values.items() if k not in changed}, wait=True)
        if changed:
            log.info("run %s: %s changed since its earlier attempt: tagged forgeline.param_changed.*",
                     self.run_id, ", ".join(changed))
            self.set_tags({f"{PARAM_CHANGED_TAG}.{k}": v for k, v in changed.items()})

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.spool.log_batch(tags={k: str(redact(k, v)) for k, v in tags.items()}, wait=True)

    def log_dataset(self, name: str, path: str | Path, digest: str, context: str) -> None:
        """An input dataset of the run, identified by its DVC hash (the digest MLflow shows)."""
        dataset = {"name": name, "digest": digest, "source_type": "local",
                   "source": Path(path).resolve().as_uri()}
        self.spool.log_input(dataset, context, wait=True)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None, landed: bool = False) -> None:
        """`landed=True`: raise NotLanded unless the store holds the file when this returns."""
        self.spool.log_artifact(path, artifact_path, wait=True, landed=landed)


# This process's spool of each run it writes to: the stages of a pipeline flow run in its
# process and all write to the parent run.
_SPOOLS: dict[str, TrackingSpool] = {}
_SPOOLS_LOCK = threading.Lock()


def tracker_for(cfg: Config, run_id: str, client: MlflowClient | None = None) -> RunTracker:
    """A tracker of the run `run_id`, through this process's spool of it."""
    client = client or MlflowClient(resolve_tracking_uri(cfg))
    with _SPOOLS_LOCK:
        spool = _SPOOLS.get(run_id)
        if spool is None:
            spool = _SPOOLS[run_id] = TrackingSpool(cfg.ops.tracking_spool, run_id, client.tracking_uri,
                                                    writer="stage")
    return RunTracker(client, run_id, spool)


def close_tracker(cfg: Config, tracker: RunTracker, finished: bool) -> None:
    """Send what the run's spool holds (at most ops.tracking_flush_s), and then what processes
    that died left for the run (a rank killed before it could send). The spool goes once
    everything in it is sent -- but a failed training attempt's stays: its retry reopens the run
    and draws its loss curve from every attempt's steps (`forgeline sync` removes it later)."""
    with _SPOOLS_LOCK:
        _SPOOLS.pop(tracker.run_id, None)
    if tracker.spool.close(cfg.ops.tracking_flush_s) == 0:
        replay(tracker.spool.dir.parent, tracker.run_id, discard=False,
               tracking_uri=resolve_tracking_uri(cfg))
    if finished or not spooled_metric(tracker.spool.dir.parent, tracker.run_id, LOSS_CURVE_METRIC):
        discard_sent(tracker.spool.dir)


def sync_tracking(cfg: Config) -> tuple[list[str], int]:
    """`forgeline sync`'s part for the tracking store: send what runs left in the spool
    (ops.tracking_spool) while it did not answer. Lines to print, and the writes still unsent."""
    # The store is resolved only when there is something to send: resolving a sqlite store makes it.
    uri = resolve_tracking_uri(cfg) if any(spool_files(cfg.ops.tracking_spool)) else None
    sent, left = replay(cfg.ops.tracking_spool, tracking_uri=uri)
    lines = [f"tracking: sent {sent} spooled write(s) from {cfg.ops.tracking_spool}"]
    if left:
        lines.append(f"tracking: {left} write(s) still unsent: the tracking store does not answer yet")
    return lines, left


@atexit.register
def _close_spools() -> None:
    """Spools of runs whose tracker this process borrowed (a parent run it did not open)."""
    for spool in list(_SPOOLS.values()):
        spool.close(0)


# A view of the runs table that MLflow's UI opens from `?viewStateShareKey=forgeline` (what its
# Share button saves: an experiment tag `mlflow.sharedViewState.<key>` holding the view's JSON):
# the columns of the scores, which its default view leaves out (it shows no metric until a user
# picks some among all of them).
RUNS_VIEW_KEY = "forgeline"
RUNS_VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"
RUNS_VIEW_COLUMNS = ("eval/overall", "eval/stderr/overall", "train/final_loss", "train/best_val_bpb")


def runs_view() -> str:
    """RUNS_VIEW_TAG's value: the UI's column keys (`metrics.`eval/overall``), the scores first
    (beside the run names: the table is narrow), then the model version and the dataset."""
    columns = [f"metrics.`{key}`" for key in RUNS_VIEW_COLUMNS]
    columns += ["tags.`forgeline.model_version`", "attributes.`Dataset`"]
    return json.dumps({"selectedColumns": columns, "columnOrder": columns})


def experiment_id(client: MlflowClient, cfg: Config) -> str:
    """The id of the experiment `cfg` logs to, created if missing; marked as holding training
    runs unless its kind is set already (an older forgeline created it without, or the user
    chose one in the UI), and holding forgeline's view of its runs table (RUNS_VIEW_TAG)."""
    name = cfg.registry.experiment
    tags = {EXPERIMENT_KIND_TAG: TRAINING_KIND, RUNS_VIEW_TAG: runs_view()}
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(
                name, artifact_location=resolve_artifact_location(cfg.registry.artifact_location), tags=tags)
        except MlflowException:  # created concurrently by another process
            found = client.get_experiment_by_name(name)
    if EXPERIMENT_KIND_TAG not in found.tags:
        client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
    if found.tags.get(RUNS_VIEW_TAG) != tags[RUNS_VIEW_TAG]:  # forgeline's, as this version sees it
        client.set_experiment_tag(found.experiment_id, RUNS_VIEW_TAG, tags[RUNS_VIEW_TAG])
    return found.experiment_id


def runs_link(cfg: Config) -> str:
    """The runs table of `cfg`'s experiment in MLflow's UI, in its training view, with the score
    columns (RUNS_VIEW_TAG)."""
    try:
        experiment = experiment_id(MlflowClient(resolve_tracking_uri(cfg)), cfg)
    except STORE_DOWN:  # the run's writes wait in the spool; its link is for when the store answers
        return store_down(cfg)
    return ui_page(cfg, f"#/experiments/{experiment}/runs?workflowType=machine_learning"
                        f"&viewStateShareKey={RUNS_VIEW_KEY}")


# What a store that does not answer raises: MLflow's client wraps most, not all, of requests' errors.
STORE_DOWN = (MlflowException, requests.RequestException, OSError)
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a store that is no server


def store_down(cfg: Config) -> str:
    """What a link says in place of a page when the tracking store does not answer."""
    return f"(the tracking store {scrub(resolve_tracking_uri(cfg))} does not answer now)"


def run_link(cfg: Config, run_id: str) -> str:
    """The run's page in MLflow's UI, in its training view: MLflow 3.17's UI opens an experiment on
    its GenAI view unless the address says `workflowType=machine_learning` (its sidebar switch;
    it reads no experiment tag for this), and `#/experiments/<id>/runs/<run>` is its run page.
    A store that is no server is served by `mlflow ui` first, which the line says."""
    try:
        experiment = MlflowClient(resolve_tracking_uri(cfg)).get_run(run_id).info.experiment_id
    except STORE_DOWN:  # a run that finished through an outage: its writes wait in the spool
        return store_down(cfg)
    return ui_page(cfg, f"#/experiments/{experiment}/runs/{run_id}?workflowType=machine_learning")


def ui_page(cfg: Config, page: str) -> str:
    """`page` (a route of MLflow's UI) on the tracking server, or on `mlflow ui` over the store."""
    uri = resolve_tracking_uri(cfg)
    if uri.startswith(("http://", "https://")):
        return f"{scrub(uri).rstrip('/')}/{page}"
    return f"{LOCAL_UI}/{page} (after `mlflow ui --backend-store-uri {uri}`)"


def layout_label(cfg: Config) -> str:
    """The parallel layout in a few characters: `dp1` on one rank, `pp2xdp2`, `dp4xtp2` (dp counts
    every data-parallel rank, replicated or sharded; the `forgeline.layout` tag splits it)."""
    par = cfg.parallel
    degrees = [f"pp{par.pp}"] if par.pp > 1 else []
    degrees.append(f"dp{par.dp}")
    if par.tp > 1:
        degrees.append(f"tp{par.tp}")
    return "x".join(degrees)


MODEL_NAME_PREFIX = "forgeline-"  # of every shipped config's registered model: no part of a label


def config_label(cfg: Config) -> str:
    """The config in a word, for run names: its run.name where the config or an override sets
    one (`ablation-lr`), else its registered model's name without `forgeline-` (`tiny`, `debug`,
    `mine`) -- the name filled in when it was loaded, `<stem>-<fingerprint>`, would say less in
    the runs table's narrow column. A Config does not know the file it was read from."""
    if not cfg.run_name_filled_in:
        return cfg.run.name
    return cfg.registry.model_name.removeprefix(MODEL_NAME_PREFIX) or cfg.registry.model_name


def run_name(what: str, cfg: Config, with_layout: bool, code: dict[str, str] | None = None) -> str:
    """A run's name that says what it is in the runs table, its telling words first (the table
    cuts names short): `what` ran (a stage, `pipeline`), for which config (config_label), on
    which layout (`with_layout`: for the runs that train), at which commit (of `code`, default
    this checkout's; `-dirty` with uncommitted changes): `train tiny pp2xdp2 @1a2b3c4-dirty`.
    Runs that learn more once done are renamed then: the eval run by the checkpoint it scored and
    the version registered from it (`eval tiny step-300 v3`), the parent by the same."""
    code = git_info() if code is None else code
    parts = [what, config_label(cfg)]
    if with_layout:
        parts.append(layout_label(cfg))
    if code["git.commit"] != "unknown":
        parts.append("@" + code["git.commit"][:7] + ("-dirty" if code["git.dirty"] == "true" else ""))
    return " ".join(parts)


CONTINUED_FROM_TAG = "forgeline.continued_from_parent_run_id"  # on a run another parent's rerun continued
CONTINUED_IN_TAG = "forgeline.continued_in_run_id"  # on that earlier parent: the run, continued elsewhere
PARAM_CHANGED_TAG = "forgeline.param_changed"  # + ".<key>": a reopened run's param, changed since


@contextmanager
def tracked_run(cfg: Config, name: str, parent_run_id: str | None = None,
                tags: dict[str, str] | None = None, run_key: str | None = None,
                continues: str | None = None) -> Iterator[RunTracker]:
    """An MLflow run for the block: nested under `parent_run_id` if given, else a top-level
    run that carries the flattened config and git lineage itself. Marked FINISHED, or FAILED
    (with the error as a tag) if the block raises. With `run_key`, a retry of the same work
    reopens the run created under that key instead of starting another. `continues`: the run of
    stopped work this block goes on with (a training resumed from the stopped run's checkpoint):
    reopened as a retry's is, moved under `parent_run_id` -- one run, one loss curve -- and linked
    both ways with the parent it was stopped under; unless it finished, or is not in this
    experiment. Creating or reopening the run needs the store; every write after that goes
    through the spool, so an outage once the run exists costs nothing (the store gets it all
    when it answers)."""
    client = MlflowClient(tracking_uri=resolve_tracking_uri(cfg))
    experiment = experiment_id(client, cfg)
    run = _run_with_key(client, experiment, run_key) if run_key else None
    if run is None and continues:
        run = _continued_run(client, experiment, continues, name, parent_run_id, run_key)
    if run is None:
        run_tags = {MLFLOW_RUN_NAME: name, **(tags or {})}
        if parent_run_id:
            run_tags[MLFLOW_PARENT_RUN_ID] = parent_run_id
        if run_key:
            run_tags[RUN_KEY_TAG] = run_key
        run = client.create_run(experiment, tags=run_tags, run_name=name)
        tracker = tracker_for(cfg, run.info.run_id, client)
        if not parent_run_id:
            tracker.log_params(cfg.flat())
            tracker.set_tags(git_info() | run_context_tags(cfg))
            with tempfile.TemporaryDirectory() as scratch:
                config = Path(scratch) / "config.yaml"
                config.write_text(yaml.safe_dump(redact("", cfg.model_dump(mode="json")), sort_keys=False))
                tracker.log_artifact(config)
        attempt = 1
    else:
        tracker = tracker_for(cfg, run.info.run_id, client)
        tracker.earlier_params = dict(run.data.params)
        attempt = int(run.data.tags.get(ATTEMPT_TAG, "1")) + 1
        client.update_run(tracker.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
    tracker.set_tags({ATTEMPT_TAG: attempt})
    log.info("MLflow run %s (%s, attempt %d) in %s", tracker.run_id, name, attempt, client.tracking_uri)
    # CPU, memory, disk and network of the work, not of the waiting parent: stage runs only.
    sampler = SystemMetrics(tracker, run.info.start_time) if parent_run_id else None
    finished = False
    try:
        yield tracker
        finished = True
    except BaseException as err:
        tracker.set_tags({f"forgeline.attempt.{attempt}.error": f"{type(err).__name__}: {err}"[:5000]})
        raise
    finally:
        if sampler:
            sampler.stop()
        tracker.spool.terminate(RunStatus.to_string(RunStatus.FINISHED if finished else RunStatus.FAILED))
        close_tracker(cfg, tracker, finished)


class SystemMetrics:
    """`system/*` metrics of the machine (CPU, memory, disk, network; MLflow's own monitors)
    every SYSTEM_METRICS_INTERVAL_S into a run's spool. Not MLflow's SystemMetricsMonitor: that
    one reads the run from the store at every sample and stops for good at the first failure.
    Steps count intervals since the run started, so a retry's samples follow the first attempt's."""

    def __init__(self, tracker: RunTracker, run_start_ms: int):
        self.tracker = tracker
        self.run_start_ms = run_start_ms
        self.monitors = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="system-metrics", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(SYSTEM_METRICS_INTERVAL_S):
            metrics = {}
            for monitor in self.monitors:
                monitor.collect_metrics()
                metrics |= monitor.aggregate_metrics()
                monitor.clear_metrics()
            now = _now_ms()
            step = (now - self.run_start_ms) // (1000 * SYSTEM_METRICS_INTERVAL_S)
            self.tracker.spool.log_batch([(f"system/{k}", float(v), now, step) for k, v in metrics.items()])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_context_tags(cfg: Config) -> dict[str, str]:
    """The parallel layout. (Not dvc.lock's hashes: read as the run starts, they would be the
    previous run's; each stage tags its own outputs' DVC hash as it ends, when forgeline also
    records it in dvc.lock -- tasks/cache.py run_cached.)"""
    par = cfg.parallel
    return {"forgeline.layout": f"pp{par.pp} x dp_replicate{par.dp_replicate} x dp_shard{par.dp_shard} "
                                f"x tp{par.tp} = {par.world_size} ranks on {par.nnodes} node(s)"}


def _continued_run(client: MlflowClient, experiment: str, run_id: str, name: str, parent_run_id: str | None,
                   run_key: str | None):
    """The stopped run `run_id`, renamed `name` and moved under `parent_run_id` (under `run_key`,
    for this work's retries), with the parent it was stopped under and that parent linked to it;
    None when it is gone, finished, deleted or in another experiment."""
    try:
        run = client.get_run(run_id)
    except MlflowException:
        log.info("run %s, which the checkpoint records, is not in %s: a new run starts", run_id,
                 client.tracking_uri)
        return None
    if run.info.experiment_id != experiment or run.info.status == "FINISHED" or \
            run.info.lifecycle_stage != "active":
        return None
    earlier_parent = run.data.tags.get(MLFLOW_PARENT_RUN_ID)
    tags = {MLFLOW_RUN_NAME: name}
    if run_key:
        tags[RUN_KEY_TAG] = run_key
    if parent_run_id and earlier_parent != parent_run_id:
        tags[MLFLOW_PARENT_RUN_ID] = parent_run_id
        if earlier_parent:
            tags[CONTINUED_FROM_TAG] = earlier_parent
            client.set_tag(earlier_parent, CONTINUED_IN_TAG, run_id)
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    log.info("continuing MLflow run %s (stopped under pipeline run %s)", run_id, earlier_parent)
    return client.get_run(run_id)


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
    # Masked: the stamp is a file anyone may read, and a password names no other registry.
    return {"tracking_uri": scrub(resolve_tracking_uri(cfg))}


def version_still_registered(cfg: Config, result: dict[str, Any]) -> str | None:
    """Why an earlier registration no longer holds: its model version is gone."""
    try:
        MlflowClient(resolve_tracking_uri(cfg)).get_model_version(result["model_name"], result["version"])
    except MlflowException:
        return f"model version {result['model_name']}/{result['version']} is gone from the registry"
    return None
