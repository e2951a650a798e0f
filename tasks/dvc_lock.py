"""dvc.lock entries for the stages forgeline runs, so that DVC and forgeline keep one record: after
`forgeline run` in a DVC repository `dvc status` reports its stages up to date and `dvc repro`
runs none of them (but the always-changed `sources` and `base`), as after `dvc repro` forgeline's
stage cache skips them.

A stage forgeline runs, or skips as cached, is committed as `dvc commit --force STAGE` commits it,
by DVC's own `Repo.commit`: the md5 of each dep and out, its params as the params file holds them,
the outs dvc.yaml keeps in DVC's cache stored there (not those marked `cache: false`), under the
repository lock every DVC writer takes. With it go the DVC stages dvc.yaml splits off it: the
`base` stamp (written here, from the identity its cache key resolved) and its `sources` snapshot.

Only where dvc.yaml describes the run: the working directory is a DVC repository; not inside `dvc
repro`, which records the stage itself; dvc.yaml's entry for the stage is the one `forgeline stages
--write` renders for the run's config, and the params file's values of its params are the run's.
A `--set` that moves the run's directories or changes the stage's params, an `--upstream-run`, a
fine-tuning config under a pretraining dvc.yaml: DVC would record paths or values this run did not
compute from, so nothing is written, and the log says why.

A lock entry that cannot be written is a warning, not the stage's failure: the stage's outputs and
its stamp are complete, and a stale entry only makes DVC run the stage again (as it did before
forgeline wrote any), never skip one. Failing would report finished work as failed and have
Prefect retry it. The warning names the cause and `dvc commit -f` of the stages.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from forgeline.configs import Config, load_config
from forgeline.tasks.atomic import write_text_atomic
from forgeline.tasks.dvc_yaml import Paths, dvc_stages
from forgeline.tasks.stage import BASE, Stage, resolve

log = logging.getLogger(__name__)

DVC_YAML = Path("dvc.yaml")
# Another DVC writer holds the repository lock for as long as its command runs: a `dvc commit` of
# a train output copies its checkpoints into the cache, a `dvc repro` beside forgeline holds it
# until it ends. Long enough for the first, not held up by the second.
LOCK_WAIT_S = 300


def dvc_stage_names(stage: Stage) -> tuple[str, ...]:
    """The DVC stages of a forgeline stage, in order: the base stamp its deps include, its
    snapshot, itself."""
    base = (BASE.name,) if stage.reads_base else ()
    snapshot = (stage.snapshot.name,) if stage.snapshot is not None else ()
    return (*base, *snapshot, stage.name)


def in_dvc_repository() -> bool:
    """The working directory holds a DVC repository with a dvc.yaml, and no `dvc repro` runs this
    process (DVC names the stage it runs in $DVC_STAGE, and records it itself)."""
    return Path(".dvc").is_dir() and DVC_YAML.is_file() and "DVC_STAGE" not in os.environ


def described_stages() -> dict[str, Any]:
    """dvc.yaml's stages; empty for an empty file. A file DVC could not read raises DvcYamlError."""
    try:
        described = yaml.safe_load(DVC_YAML.read_text()) or {}
    except yaml.YAMLError as err:
        raise DvcYamlError(f"{DVC_YAML} is not YAML ({err})") from None
    stages = described.get("stages") if isinstance(described, dict) else None
    if not isinstance(stages or {}, dict):
        raise DvcYamlError(f"{DVC_YAML}'s `stages` is not a mapping of stage names")
    return stages or {}


class DvcYamlError(ValueError):
    """dvc.yaml cannot be read as DVC reads it: nothing is recorded, and the log says why."""


def params_file_of(entry: Any) -> str | None:
    """The params file a stage entry as `forgeline stages` renders it reads (`params: [{FILE:
    [keys]}]`); None for any other form (DVC's usual `params: [lr]`, none at all)."""
    params = entry.get("params") if isinstance(entry, dict) else None
    first = params[0] if isinstance(params, list) and params else None
    return next(iter(first)) if isinstance(first, dict) and len(first) == 1 else None


def why_not_described(name: str, cfg: Config, listed: dict[str, Any]) -> str | None:
    """Why dvc.yaml's stage `name` is not this run's (None: it is): its entry differs from the
    one rendered for `cfg`, or the params file's values of its params differ from `cfg`'s."""
    if name not in listed:
        return f"dvc.yaml has no stage {name}"
    params_file = params_file_of(listed[name])
    if params_file is None or dvc_stages(params_file, Paths(cfg)).get(name) != listed[name]:
        return f"dvc.yaml's stage {name} is not this run's (its paths, deps or params differ)"
    described = load_config(params_file)
    keys = listed[name]["params"][0][params_file]
    differing = [key for key in keys if cfg.value(key) != described.value(key)]
    if differing:
        return (f"this run's {', '.join(differing)} differ from {params_file}'s, which dvc.yaml's stage "
                f"{name} reads")
    return None


# The stage this process first said was not recorded: the stages of one run share the reason
# (another config's dvc.yaml), said once a run, not after each stage.
_told_not_described: list[str] = []


def tell_not_recorded(name: str, reason: str) -> None:
    """Say once a process (a run) that dvc.lock does not record this run, and how to make it; the
    later stages' reasons go to the log file."""
    if _told_not_described:
        log.debug("dvc.lock: stage %s not recorded: %s", name, reason)
        return
    _told_not_described.append(name)
    log.info("dvc.lock: this run's stages are not recorded, from %s on: %s. `forgeline stages --dvc CONFIG "
             "> dvc.yaml` describes a config's run (said once a run)", name, reason)


def record_in_dvc_lock(stage: Stage, cfg: Config, base_identity: dict[str, Any] | None) -> None:
    """Commit the DVC stages of `stage` (`dvc_stage_names`) that dvc.yaml describes for `cfg` to
    dvc.lock and DVC's cache, after it ran or was skipped. `base_identity`: the base's identity its
    cache key resolved, written to the base stamp first (only if it changed)."""
    if not in_dvc_repository():
        return
    try:
        listed = described_stages()
    except (DvcYamlError, OSError) as err:  # a warning: see the module docstring
        log.warning("dvc.lock: stage %s not recorded: %s", stage.name, err)
        return
    names = []
    for name in dvc_stage_names(stage):
        reason = why_not_described(name, cfg, listed)
        if reason is None:
            names.append(name)
        else:
            tell_not_recorded(name, reason)
    if not names:
        return
    if BASE.name in names:
        write_base_stamp(cfg, base_identity)
    from dvc.exceptions import DvcException  # DVC is slow to import: only where it records something

    started = time.monotonic()
    try:
        commit(names)
    except (DvcException, OSError) as err:  # a warning: see the module docstring
        log.warning("dvc.lock: stages %s not recorded (%s: %s); `dvc status` may list them as changed until "
                    "`dvc commit -f %s`", ", ".join(names), type(err).__name__, err, " ".join(names))
        return
    log.info("dvc.lock: recorded stages %s (%.1f s)", ", ".join(names), time.monotonic() - started)


def write_base_stamp(cfg: Config, identity: dict[str, Any] | None = None) -> bool:
    """Write the base's identity (resolved here unless given) to its stamp (dvc.yaml's `base`
    stage), only if it changed: an unchanged base leaves the file as it was, and the stages that
    depend on it are not rerun. Whether it was written."""
    path = BASE.path(cfg)
    text = json.dumps(identity or resolve(BASE.identity)(cfg), indent=2, sort_keys=True) + "\n"
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
    return True


def commit(names: list[str]) -> None:
    """`dvc commit --force` of the stages `names`, under DVC's repository lock, waiting up to
    LOCK_WAIT_S for another writer to let it go."""
    from dvc.lock import LockError
    from dvc.repo import Repo

    deadline = time.monotonic() + LOCK_WAIT_S
    with Repo(".") as repo, dvc_infos_unprinted():
        while True:
            try:
                for name in names:
                    repo.commit(f"{DVC_YAML}:{name}", force=True)
                return
            except LockError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)


@contextmanager
def dvc_infos_unprinted() -> Iterator[None]:
    """DVC's logger at WARNING meanwhile: importing DVC gives it handlers of its own that print its
    INFO lines ("Updating lock file 'dvc.lock'") on stdout, among forgeline's console lines, which
    say what was recorded."""
    dvc_log = logging.getLogger("dvc")
    level = dvc_log.level
    dvc_log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        dvc_log.setLevel(level)
