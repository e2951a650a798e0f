"""Sharded checkpoints with torch.distributed.checkpoint and a commit protocol.

A save goes to `.step-NNNNNNNN.partial/`; once every rank has written its shard, rank 0
records the sha256 of every file in `forgeline-checkpoint.json`, fsyncs, and renames the
directory to `step-NNNNNNNN/`. A directory without a verifying manifest is not a checkpoint:
resume skips it with a warning naming what is wrong.

State is saved under constant top-level keys -- "model", "optim", "train" -- through
`get_state_dict`-style helpers, so any parallel layout can load it (and eval can load just
"model" into a plain, unsharded module).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from forgeline.model.fileio import fsync_path, sha256_file

log = logging.getLogger(__name__)

MANIFEST_NAME = "forgeline-checkpoint.json"
STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used."""


# Optimizer state keyed by parameter name, not by position: merges across pipeline stages
# and loads into any other split.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelState(Stateful):
    """The weights of this rank's model parts (one module, or its pipeline stages), keyed by
    the unsplit model's parameter names."""

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        return {k: v for part in self.parts for k, v in get_model_state_dict(part).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class OptimizerState(Stateful):
    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        self.pairs = list(zip(parts, optimizers, strict=True))

    def state_dict(self) -> dict[str, Any]:
        return {k: v for part, optimizer in self.pairs
                for k, v in get_optimizer_state_dict(part, optimizer, options=_FLAT).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, optimizer in self.pairs:
            set_optimizer_state_dict(part, optimizer, state_dict, options=_FLAT)


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def read_checkpoint_manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST_NAME).read_text())


def verify_checkpoint(path: Path) -> list[str]:
    """Problems that make `path` unusable; empty when every file matches its manifest."""
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        return [f"{manifest_path} missing (save never committed)"]
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        return [f"{manifest_path} unreadable: {err}"]
    problems = []
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            problems.append(f"{file} missing")
        elif sha256_file(file) != expected:
            problems.append(f"{file} sha256 mismatch")
    return problems


def committed_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Checkpoints under root whose manifests exist, newest first (not yet verified)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / MANIFEST_NAME).is_file():
            found.append(CheckpointInfo(child, int(match.group(1)), read_checkpoint_manifest(child)))
    return sorted(found, key=lambda c: c.step, reverse=True)


def latest_valid_checkpoint(root: Path) -> CheckpointInfo | None:
    for info in committed_checkpoints(root):
        problems = verify_checkpoint(info.path)
        if not problems:
            return info
        log.warning("skipping checkpoint %s: %s", info.path, "; ".join(problems))
    return None


class CheckpointManager:
    """Saves and restores training state under `root`, called on every rank."""

    def __init__(self, root: Path, keep_last: int, rank: int, fingerprint: str):
        self.root = root
        self.keep_last = keep_last
        self.rank = rank
        self.fingerprint = fingerprint

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Collective: every rank writes its shard, rank 0 commits. Returns the final path."""
        final = self.root / step_dir_name(step)
        partial = self.root / f".{step_dir_name(step)}.partial"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # left over by a crash mid-save
        dist.barrier()
        started = time.perf_counter()
        dcp.save(state, checkpoint_id=partial)
        dist.barrier()
        if self.rank == 0:
            self._commit(partial, final, step, meta)
            self._prune()
        dist.barrier()
        log.info("checkpoint %s saved in %.2fs", final, time.perf_counter() - started)
        return final

    def load_latest(self, state: dict[str, Any]) -> CheckpointInfo | None:
        """Load the newest verifying checkpoint into `state` (in place); None when there is none.
        Every rank verifies and picks the same one (all see the same files)."""
        info = latest_valid_checkpoint(self.root)
        if info is None:
            return None
        if info.manifest["fingerprint"] != self.fingerprint:
            raise CheckpointError(
                f"{info.path} was written for another model/training/data configuration "
                f"(fingerprint {info.manifest['fingerprint'][:12]} != {self.fingerprint[:12]}); "
                "remove it or train into another train.out_dir"
            )
        dcp.load(state, checkpoint_id=info.path)
        log.info("resumed from %s (step %d)", info.path, info.step)
        return info

    def _commit(self, partial: Path, final: Path, step: int, meta: dict[str, Any]) -> None:
        files = {
            str(p.relative_to(partial)): sha256_file(p)
            for p in sorted(partial.rglob("*")) if p.is_file()
        }
        manifest = {"step": step, "fingerprint": self.fingerprint, "files": files,
                    "created_unix": time.time(), **meta}
        with open(partial / MANIFEST_NAME, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        for name in files:
            fsync_path(partial / name)
        fsync_path(partial)
        os.replace(partial, final)
        fsync_path(self.root)

    def _prune(self) -> None:
        for info in committed_checkpoints(self.root)[self.keep_last:]:
            shutil.rmtree(info.path)


def load_model_weights(model: nn.Module, checkpoint: Path) -> None:
    """Load only the weights of a checkpoint of any layout into a plain (unsharded) model,
    in a process without a process group."""
    problems = verify_checkpoint(checkpoint)
    if problems:
        raise CheckpointError(f"checkpoint {checkpoint} is not usable: {'; '.join(problems)}")
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        # no_dist=True is the intent here; DCP warns about it on every call.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    model.load_state_dict(state["model"])
