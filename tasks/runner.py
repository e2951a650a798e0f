"""A stage as a tracked run: its plain function (named by its record, tasks/stage.py) inside an
MLflow run -- nested under the pipeline's parent run when there is one -- skipped when the stage
cache allows, with what the stage records. Plain Python: the Prefect tasks of flows/ only wrap
`run_stage`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow import MlflowClient

from forgeline.configs import Config
from forgeline.tasks.cache import CACHE_SOURCE_TAG, CACHE_TAG, out_dir_tag, outputs_tag, run_cached
from forgeline.tasks.stage import Stage, check_in_pipeline, producer, resolve, stage_named
from forgeline.tasks.stage_log import stage_log
from forgeline.tasks.tracking import (
    RunTracker,
    check_tracking_server,
    dvc_hash,
    resolve_tracking_uri,
    run_name,
    tracked_run,
    tracker_for,
)

UPSTREAM_RUN_TAG = "forgeline.upstream_run"
STAGE_TAG = "forgeline.stage"  # the stage a stage run ran: find runs by it, not by their names


class MissingInputError(FileNotFoundError):
    """A stage was asked to run before the stages it reads from."""


def preflight(cfg: Config, stages: tuple[Stage, ...], from_snapshot: bool = False) -> None:
    """What can be checked before any work when `stages` run in order: the first one's upstream
    outputs exist, each stage's own checks pass (its sources, or with `from_snapshot` its
    snapshot; a tokenizer to load; the precision; the eval tasks), and a tracking server answers."""
    for stage in stages:  # a stage of the other pipeline is named as such, not as one lacking inputs
        check_in_pipeline(stage, cfg)
    check_stage_inputs(stages[0], cfg, from_snapshot)
    for stage in stages:
        preflight_stage(stage, cfg, from_snapshot)
    check_tracking_server(cfg)


def preflight_stage(stage: Stage, cfg: Config, from_snapshot: bool = False) -> None:
    if from_snapshot and stage.snapshot is None:
        raise ValueError(f"stage {stage.name} has no snapshot step to build from")
    if stage.snapshot is not None:
        resolve(stage.snapshot.check if from_snapshot else stage.snapshot.preflight)(cfg)
    if stage.preflight is not None:
        resolve(stage.preflight)(cfg)


def check_stage_inputs(stage: Stage, cfg: Config, from_snapshot: bool = False) -> None:
    """Fail before any work if an upstream stage's output is missing: one the stage reads, or one
    of the config's pipeline that its snapshot step copies (unless it builds from the snapshot
    taken before)."""
    copied = () if from_snapshot or stage.snapshot is None else tuple(
        read.stage for read in stage.snapshot.reads if stage_named(read.stage).runs_for(cfg))
    missing = [producer(up, cfg) for up in (*stage.upstream, *copied)
               if not producer(up, cfg).done_marker(cfg).is_file()]
    if missing:
        paths = ", ".join(str(up.done_marker(cfg)) for up in missing)
        raise MissingInputError(
            f"stage {stage.name!r} reads the output of {', '.join(up.name for up in missing)}, which is "
            f"missing ({paths}); run `forgeline stage {missing[0].name}` first, or the whole pipeline "
            "with `forgeline run`"
        )


def upstream_outputs(cfg: Config, stage: Stage, run_id: str) -> dict[str, str]:
    """The output directories of the upstream stages that the earlier run `run_id` (a pipeline
    or stage run) recorded, by config field, after checking they are still what it wrote."""
    tags = MlflowClient(resolve_tracking_uri(cfg)).get_run(run_id).data.tags
    fields = {}
    for up in (producer(name, cfg) for name in stage.upstream):
        if out_dir_tag(up.name) not in tags:
            raise MissingInputError(f"run {run_id} recorded no {up.name} stage output; pick a run whose "
                                    f"{up.name} stage finished (`forgeline compare` shows its tags)")
        out_dir = tags[out_dir_tag(up.name)]
        recorded = tags[outputs_tag(up.name)]
        if not Path(out_dir).is_dir() or dvc_hash(out_dir) != recorded:
            raise MissingInputError(f"the {up.name} output of run {run_id} at {out_dir} is gone or has "
                                    f"changed since (md5 {recorded}); rerun `forgeline stage {up.name}`")
        fields[up.output] = out_dir
    return fields


def reads_layout(stage: Stage) -> bool:
    """Whether the parallel layout is part of what `stage` computes (its run names the layout)."""
    return "parallel" in stage.sections


@dataclass(frozen=True)
class StageRun:
    """What one run of a stage came to: its result, its MLflow run, and the stage cache's decision."""

    result: Any
    run_id: str
    reused: str | None = None
    """The MLflow run whose result it reused, when the cache skipped the stage's function."""
    reason: str = ""
    """Why the function ran, when it did (the cache's reason, `--force`)."""


class DecisionNoted:
    """A RunTracker that keeps the tags set through it: the stage cache's decision, as it tags it."""

    def __init__(self, run: RunTracker) -> None:
        self.run = run
        self.tags: dict[str, Any] = {}

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.tags |= tags
        self.run.set_tags(tags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.run, name)


def run_stage(stage: Stage, cfg: Config, parent_run_id: str | None = None, force: bool = False,
              run_key: str | None = None, from_snapshot: bool = False) -> Any:
    """`tracked_stage`'s result."""
    return tracked_stage(stage, cfg, parent_run_id, force, run_key, from_snapshot).result


def tracked_stage(stage: Stage, cfg: Config, parent_run_id: str | None = None, force: bool = False,
                  run_key: str | None = None, from_snapshot: bool = False) -> StageRun:
    """Run `stage` as an MLflow run: its checks, the snapshot it builds from (taken on every run,
    like dvc.yaml's always-changed snapshot stage; with `from_snapshot` the one there is used),
    then its function unless the stage cache allows a skip, then what it records; all it logs goes
    to its log file (tasks/stage_log.py). `run_key` (e.g. the Prefect task run id) makes a retry
    resume into the same MLflow run."""
    check_in_pipeline(stage, cfg)
    preflight_stage(stage, cfg, from_snapshot)
    client = MlflowClient(resolve_tracking_uri(cfg))
    parent = None if parent_run_id is None else tracker_for(cfg, parent_run_id, client)
    function = resolve(stage.function)
    name = run_name(stage.name, cfg, with_layout=reads_layout(stage))
    continues = resolve(stage.continues)(cfg) if stage.continues else None
    with (tracked_run(cfg, name, parent_run_id, tags={STAGE_TAG: stage.name}, run_key=run_key,
                      continues=continues) as run,
          stage_log(stage.name, cfg, run)):
        run.log_params({k: v for k, v in cfg.flat().items()
                        if k.split(".")[0] in stage.sections or k in stage.params_of(cfg)})
        if stage.snapshot is not None and not from_snapshot:
            resolve(stage.snapshot.take)(cfg)
        noted = DecisionNoted(run)
        result = run_cached(stage, cfg, noted, parent, resolve(stage.result_type),
                            lambda: function(cfg, run, parent), force)
        resolve(stage.record)(cfg, run, parent, result)
    hit = noted.tags.get(CACHE_TAG) == "hit"
    return StageRun(result, run.run_id, noted.tags.get(CACHE_SOURCE_TAG) if hit else None,
                    "" if hit else str(noted.tags.get(f"{CACHE_TAG}.reason", "")))
