"""Stage caching: a stage is skipped when its inputs are unchanged and its outputs still
verify -- the decision `dvc repro` makes, taken without a DVC repository, so `forgeline run` and
the Prefect deployments get it too. tests/integration/test_dvc.py makes the same changes in a
real DVC repository and checks that both decide alike.

A stage's inputs are what its record (tasks/stage.py), and so its dvc.yaml entry, lists:
- `config`: its config sections, every key (`Config.section_hash`), as DVC's params;
- `params`: the single keys of other sections it lists;
- `code`: the files of the package it runs, derived from its imports (tasks/code_inputs.py);
- `upstream`: each upstream output it reads, by its path as the config names it and its DVC md5;
- the snapshot it builds from (the data stage's raw inputs, taken before it on every run like
  dvc.yaml's always-changed `sources` stage), by path and md5;
- `base`: the pretrained base of `model.init_from` by content (data, train and eval), resolved
  on every run as dvc.yaml's always-changed `base` stage writes it to the stamp they depend on;
- `external` inputs DVC does not see (the register stage: the model registry; the data stage:
  the tokenizer and chat template files the config names by path, by content);
- `packages`: the installed version of each third-party distribution its code imports, and
  `installed files`: the files of installed packages it reads (lm-eval's task YAMLs), by content.
Its outputs are verified as DVC verifies them: the md5 of each output the record lists.

When a stage finishes, a stamp next to its output directory, `<out_dir>.stage.json`, records
those inputs, the hashes of what it wrote and its result. It lives outside the output so that
DVC's hash of the output stays the stage's own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from forgeline.configs import Config
from forgeline.tasks.atomic import write_text_atomic
from forgeline.tasks.dvc_lock import record_in_dvc_lock
from forgeline.tasks.stage import BASE, Stage, resolve, stage_named
from forgeline.tasks.tracking import RunTracker, dvc_hash

log = logging.getLogger(__name__)

Result = TypeVar("Result")

CACHE_TAG = "forgeline.cache"
CACHE_SOURCE_TAG = "forgeline.cache.source_run"
PACKAGES = "packages"  # the installed version of each third-party distribution its code imports
INSTALLED_FILES = "installed files"  # files of installed packages it reads (lm-eval's task YAMLs)


def stamp_path(stage: Stage, cfg: Config) -> Path:
    out = stage.out_dir(cfg).resolve()
    return out.with_name(out.name + ".stage.json")


def stage_inputs(stage: Stage, cfg: Config) -> dict[str, Any]:
    inputs: dict[str, Any] = {
        "config": cfg.section_hash(*stage.sections),
        "code": stage.code_hash(),
        PACKAGES: stage.package_versions(),
        "upstream": {_dep_path(read.stage, read.path, cfg): dvc_hash(_dep_path(read.stage, read.path, cfg))
                     for read in stage.reads},
    }
    if installed := stage.installed_files():
        inputs[INSTALLED_FILES] = installed
    if params := stage.params_of(cfg):
        inputs["params"] = {key: cfg.value(key) for key in params}
    if stage.snapshot is not None:
        raw = cfg.value(stage.snapshot.output)
        inputs[stage.snapshot.name] = {raw: dvc_hash(raw)}
    if stage.reads_base:
        inputs[BASE.name] = resolve(BASE.identity)(cfg)
    if stage.external is not None:
        inputs["external"] = resolve(stage.external)(cfg)
    return inputs


def _dep_path(stage: str, path: str, cfg: Config) -> str:
    """An upstream output as dvc.yaml names it: the config's value of its directory, and the path
    inside it."""
    out_dir = cfg.value(stage_named(stage).output)
    return f"{out_dir}/{path}" if path else out_dir


def output_hashes(stage: Stage, cfg: Config) -> dict[str, str | None]:
    """The DVC md5 of each output the record lists (None: missing)."""
    hashes = {}
    for output in stage.outputs:
        path = stage.out_dir(cfg) / output.path
        hashes[output.path] = dvc_hash(path) if path.exists() else None
    return hashes


@dataclass(frozen=True)
class Stamp:
    inputs: dict[str, Any]
    outputs: dict[str, str | None]  # output_hashes
    result: dict[str, Any]
    run_id: str  # the MLflow run that computed it

    @classmethod
    def read(cls, path: Path) -> Stamp | None:
        try:
            stamp = cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None
        return stamp if isinstance(stamp.outputs, dict) else None  # older stamps: one hash


def why_not_cached(stage: Stage, cfg: Config, inputs: dict[str, Any], stamp: Stamp | None) -> str | None:
    """Why the stage has to run (None: it may be skipped)."""
    if stamp is None:
        return "no record of an earlier run"
    changed = [what_changed(key, stamp.inputs.get(key), now) for key, now in inputs.items()
               if stamp.inputs.get(key) != now]
    if changed:
        return f"changed: {', '.join(changed)}"
    if output_hashes(stage, cfg) != stamp.outputs:
        return f"its output {stage.out_dir(cfg)} is missing or was modified"
    if stage.still_valid is not None:
        return resolve(stage.still_valid)(cfg, stamp.result)
    return None


def what_changed(key: str, before: Any, now: Any) -> str:
    """The input that changed and, for third-party code and external inputs, what in it:
    `packages (transformers 5.25.0 -> 5.26.0)`, `installed files (lm_eval/tasks/arc/arc_easy.yaml)`,
    `external (data.chat_template)`."""
    if before is None:
        return f"{key} (not recorded by the earlier run)"
    if key == PACKAGES:
        moved = [f"{name} {_version(before, name)} -> {_version(now, name)}"
                 for name in sorted(before.keys() | now.keys())
                 if _version(before, name) != _version(now, name)]
        return f"{key} ({', '.join(moved)})"
    if key in (INSTALLED_FILES, "external"):
        edited = sorted(name for name in before.keys() | now.keys() if before.get(name) != now.get(name))
        return f"{key} ({', '.join(edited)})"
    return key


def _version(versions: dict[str, str | None], name: str) -> str:
    if name not in versions:
        return "not imported"
    return versions[name] or "not installed"


def decide(stage: Stage, cfg: Config) -> str | None:
    """Why the stage would run now (None: it would be skipped), without running it."""
    missing = [read.stage for read in stage.reads if not Path(_dep_path(read.stage, read.path, cfg)).exists()]
    if missing:
        return f"the output of {', '.join(dict.fromkeys(missing))} it reads is missing"
    if stage.snapshot is not None and not Path(cfg.value(stage.snapshot.output)).exists():
        return f"its inputs were never read here: no snapshot in {cfg.value(stage.snapshot.output)}"
    return why_not_cached(stage, cfg, stage_inputs(stage, cfg), Stamp.read(stamp_path(stage, cfg)))


def run_cached(stage: Stage, cfg: Config, run: RunTracker, parent: RunTracker | None,
               result_type: type[Result], compute: Callable[[], Result], force: bool = False) -> Result:
    """`compute()` unless an earlier run with the same inputs left outputs that still verify; then
    that run's result. `run` is tagged with the decision, and it and `parent` with where the
    outputs are and their hash (what a later run's `upstream_run` reuse checks). Either way, in a
    DVC repository whose dvc.yaml describes the run, the stage is recorded in dvc.lock
    (tasks/dvc_lock.py)."""
    inputs = stage_inputs(stage, cfg)
    stamp = Stamp.read(stamp_path(stage, cfg))
    reason = "--force" if force else why_not_cached(stage, cfg, inputs, stamp)
    if reason is None:
        log.info("stage %s: inputs unchanged and outputs verified; reusing run %s", stage.name, stamp.run_id)
        run.set_tags({CACHE_TAG: "hit", CACHE_SOURCE_TAG: stamp.run_id})
    else:
        log.info("stage %s runs (%s)", stage.name, reason)
        run.set_tags({CACHE_TAG: "miss", f"{CACHE_TAG}.reason": reason})
        result = compute()
        stamp = Stamp(inputs, output_hashes(stage, cfg), dataclasses.asdict(result), run.run_id)
        write_text_atomic(stamp_path(stage, cfg), json.dumps(dataclasses.asdict(stamp), indent=2) + "\n")
    out_dir = stage.out_dir(cfg)
    whole = stamp.outputs[""] if set(stamp.outputs) == {""} else dvc_hash(out_dir)  # hashed once
    outputs = {out_dir_tag(stage.name): str(out_dir.resolve()), outputs_tag(stage.name): whole}
    for tracker in (run, parent):
        if tracker is not None:
            tracker.set_tags(outputs)
    record_in_dvc_lock(stage, cfg, inputs.get(BASE.name))
    return result_type(**stamp.result)


def out_dir_tag(stage: str) -> str:
    return f"forgeline.{stage}.out_dir"


def outputs_tag(stage: str) -> str:
    return f"forgeline.{stage}.outputs_md5"
