"""Reproduce a recorded pipeline run: the same config (the run's `config.yaml` artifact), on the
same code version (its git commit) and data version (its DVC hash), into fresh output
directories; then say whether the data and every eval score came out the same."""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient

from forgeline.configs import Config
from forgeline.tasks.stage import STAGES, Stage, pipeline_stages
from forgeline.tasks.tracking import DATA_VERSION_TAG, git_info

REPRODUCES_TAG = "forgeline.reproduces"
NOT_REPRODUCED = "register"  # it would add a version to the model the run registered
EVAL_PREFIX = "eval/"


def reproduced_stages(cfg: Config) -> tuple[Stage, ...]:
    """What a reproduction reruns: the stages of the run's pipeline whose outputs it compares (the
    data version, the eval scores) -- all but register."""
    return tuple(stage for stage in pipeline_stages(cfg) if stage.name != NOT_REPRODUCED)


class ReproduceError(ValueError):
    """The run cannot be reproduced here as recorded."""


@dataclass(frozen=True)
class Recorded:
    run_id: str
    config_yaml: str
    code: dict[str, str]  # git.commit, git.dirty and, when dirty, git.diff_sha256
    data_md5: str
    scores: dict[str, float]  # "overall" and "dimension/<name>", as the eval stage logged them


@dataclass(frozen=True)
class Check:
    name: str
    recorded: str
    reproduced: str
    matches: bool


def recorded_run(client: MlflowClient, run_id: str) -> Recorded:
    run = client.get_run(run_id)
    tags = run.data.tags
    if "mlflow.parentRunId" in tags or "git.commit" not in tags or DATA_VERSION_TAG not in tags:
        raise ReproduceError(f"run {run_id} is not a pipeline run with its lineage tags (git.commit, "
                             f"{DATA_VERSION_TAG}): pass the parent run `forgeline run` printed")
    if tags["git.commit"] == "unknown":
        raise ReproduceError(f"run {run_id} did not record a code version (forgeline was not installed "
                             "from a git checkout)")
    with tempfile.TemporaryDirectory() as scratch:
        config_yaml = Path(client.download_artifacts(run_id, "config.yaml", scratch)).read_text()
    scores = {k.removeprefix(EVAL_PREFIX): v for k, v in run.data.metrics.items()
              if k == "eval/overall" or k.startswith("eval/dimension/")}
    code = {k: v for k, v in tags.items() if k in ("git.commit", "git.dirty", "git.diff_sha256")}
    return Recorded(run_id, config_yaml, code, tags[DATA_VERSION_TAG], scores)


def check_code_version(recorded: Recorded) -> None:
    """This checkout must be the recorded code: the same commit, and the same uncommitted diff."""
    here, commit = git_info(), recorded.code["git.commit"]
    if here["git.commit"] != commit:
        raise ReproduceError(f"run {recorded.run_id} ran commit {commit}; this checkout is at "
                             f"{here['git.commit']}: `git checkout {commit}` (or a `git worktree add`) and "
                             "reinstall, then reproduce from there")
    if here.get("git.diff_sha256") != recorded.code.get("git.diff_sha256"):
        raise ReproduceError(f"the uncommitted changes on top of {commit} differ from those run "
                             f"{recorded.run_id} ran with (git diff HEAD sha256 "
                             f"{recorded.code.get('git.diff_sha256', 'none: it was clean')})")


def output_overrides(root: Path, cfg: Config) -> list[str]:
    """The output directory (and snapshot) of every stage of `cfg`'s pipeline under `root`, named
    after the first stage that writes it (train: sft and preference write there too). Only its
    own stages': naming a section the config leaves unset (pairs) would set it, with its defaults."""
    stages = pipeline_stages(cfg)
    written = {stage.output for stage in stages}
    directories = {stage.output: root / stage.name for stage in reversed(STAGES) if stage.output in written}
    overrides = [f"{field}={directory}" for field, directory in directories.items()]
    return overrides + [f"{stage.snapshot.output}={root / 'raw'}" for stage in stages if stage.snapshot]


def compare(recorded: Recorded, data_md5: str, scores: dict[str, float], tolerance: float) -> list[Check]:
    checks = [Check("data version (DVC md5)", recorded.data_md5, data_md5, recorded.data_md5 == data_md5)]
    for name, before in sorted(recorded.scores.items()):
        after = scores.get(name)
        same = after is not None and math.isclose(before, after, rel_tol=0, abs_tol=tolerance)
        checks.append(Check(name, f"{before:.6g}", "-" if after is None else f"{after:.6g}", same))
    return checks
