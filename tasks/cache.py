"""Stage caching: a stage is skipped when its inputs are unchanged and its outputs still
verify -- the decision `dvc repro` makes, taken without a DVC repository, so `forgeline run`
and the Prefect deployments get it too.

A stage's inputs are its config sections (`Config.section_hash`: where outputs go is not an
input), the content hashes of the upstream outputs it reads (for data: the raw snapshot, taken
before on every run like dvc.yaml's always-changed `sources` stage, which has no stamp), and
its code (the source files dvc.yaml lists as its deps). When a stage finishes, a stamp next to
its output directory, `<out_dir>.stage.json`, records those inputs, the hash of what it wrote
and its result. It lives outside the output so that DVC's hash of the output stays the stage's
own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from forgeline.configs import Config
from forgeline.tasks.atomic import write_text_atomic
from forgeline.tasks.tracking import PACKAGE_ROOT, RunTracker, dvc_hash, resolve_tracking_uri

log = logging.getLogger(__name__)

Result = TypeVar("Result")

CACHE_TAG = "forgeline.cache"
CACHE_SOURCE_TAG = "forgeline.cache.source_run"

# The same sections and code as each stage's params and deps in dvc.yaml.
STAGE_SECTIONS = {"data": ("data",), "train": ("model", "parallel", "train", "checkpoint"),
                  "eval": ("eval",), "register": ("registry",)}
STAGE_CODE = {"data": ("tasks/data.py", "tasks/raw.py", "tasks/clean.py", "model/data.py"),
              "train": ("model", "tasks/train.py"),
              "eval": ("eval", "tasks/evaluate.py"), "register": ("tasks/register.py", "model/hf.py")}
STAGE_UPSTREAM = {"data": (), "train": ("data",), "eval": ("data", "train"),
                  "register": ("data", "train", "eval")}


def output_dir(stage: str, cfg: Config) -> Path:
    return Path({"data": cfg.data.out_dir, "train": cfg.train.out_dir, "eval": cfg.eval.out_dir,
                 "register": cfg.registry.out_dir}[stage])


def stamp_path(stage: str, cfg: Config) -> Path:
    out = output_dir(stage, cfg).resolve()
    return out.with_name(out.name + ".stage.json")


def code_hash(stage: str) -> str:
    """sha256 over the stage's source files (relative path and bytes, in sorted order)."""
    digest = hashlib.sha256()
    for entry in STAGE_CODE[stage]:
        root = PACKAGE_ROOT / entry
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()
                                                      and "__pycache__" not in p.parts)
        for path in files:
            digest.update(str(path.relative_to(PACKAGE_ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def stage_inputs(stage: str, cfg: Config) -> dict[str, Any]:
    inputs: dict[str, Any] = {
        "config": cfg.section_hash(*STAGE_SECTIONS[stage]),
        "code": code_hash(stage),
        "upstream": {up: dvc_hash(output_dir(up, cfg)) for up in STAGE_UPSTREAM[stage]},
    }
    if stage == "data":  # the raw snapshot it builds from (dvc.yaml: a dep of the data stage)
        inputs["raw"] = dvc_hash(cfg.data.raw_dir)
    if stage == "register":  # the registry it wrote to is part of what it did
        inputs["tracking_uri"] = resolve_tracking_uri(cfg)
    return inputs


@dataclass(frozen=True)
class Stamp:
    inputs: dict[str, Any]
    outputs: str  # dvc_hash of the output directory
    result: dict[str, Any]
    run_id: str  # the MLflow run that computed it

    @classmethod
    def read(cls, path: Path) -> Stamp | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


def why_not_cached(stage: str, cfg: Config, inputs: dict[str, Any], stamp: Stamp | None) -> str | None:
    """Why the stage has to run (None: it may be skipped)."""
    if stamp is None:
        return "no record of an earlier run"
    changed = [key for key in inputs if stamp.inputs.get(key) != inputs[key]]
    if changed:
        return f"changed: {', '.join(changed)}"
    out = output_dir(stage, cfg)
    if not out.is_dir() or dvc_hash(out) != stamp.outputs:
        return f"its output {out} is missing or was modified"
    if stage == "register" and not _version_exists(cfg, stamp.result):
        name, version = stamp.result["model_name"], stamp.result["version"]
        return f"model version {name}/{version} is gone from the registry"
    return None


def _version_exists(cfg: Config, result: dict[str, Any]) -> bool:
    try:
        MlflowClient(resolve_tracking_uri(cfg)).get_model_version(result["model_name"], result["version"])
    except MlflowException:
        return False
    return True


def run_cached(stage: str, cfg: Config, run: RunTracker, parent: RunTracker | None,
               result_type: type[Result], compute: Callable[[], Result], force: bool = False) -> Result:
    """`compute()` unless an earlier run with the same inputs left outputs that still verify; then
    that run's result. `run` is tagged with the decision, and it and `parent` with where the
    outputs are and their hash (what a later run's `upstream_run` reuse checks)."""
    inputs = stage_inputs(stage, cfg)
    stamp = Stamp.read(stamp_path(stage, cfg))
    reason = "--force" if force else why_not_cached(stage, cfg, inputs, stamp)
    if reason is None:
        log.info("stage %s: inputs unchanged and outputs verified; reusing run %s", stage, stamp.run_id)
        run.set_tags({CACHE_TAG: "hit", CACHE_SOURCE_TAG: stamp.run_id})
    else:
        log.info("stage %s runs (%s)", stage, reason)
        run.set_tags({CACHE_TAG: "miss", f"{CACHE_TAG}.reason": reason})
        result = compute()
        stamp = Stamp(inputs, dvc_hash(output_dir(stage, cfg)), dataclasses.asdict(result), run.run_id)
        write_text_atomic(stamp_path(stage, cfg), json.dumps(dataclasses.asdict(stamp), indent=2) + "\n")
    outputs = {out_dir_tag(stage): str(output_dir(stage, cfg).resolve()), outputs_tag(stage): stamp.outputs}
    for tracker in (run, parent):
        if tracker is not None:
            tracker.set_tags(outputs)
    return result_type(**stamp.result)


def out_dir_tag(stage: str) -> str:
    return f"forgeline.{stage}.out_dir"


def outputs_tag(stage: str) -> str:
    return f"forgeline.{stage}.outputs_md5"
