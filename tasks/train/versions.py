"""Operating on the checkpoint versions of a train stage's output: list, verify, roll back,
export. Plain functions over its `TrainOutputs`; `forgeline checkpoints ...` calls them."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from forgeline.model.checkpoint.manager import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointInfo,
    committed_checkpoints,
    step_dir_name,
    verify_checkpoint,
)
from forgeline.model.checkpoint.tiers import PersistentTier
from forgeline.model.hf import export_hf
from forgeline.model.inference import load_from_checkpoint, save_bundle
from forgeline.model.training.outputs import TrainOutputs
from forgeline.tasks.atomic import replace_dir, staging_dir

ROLLED_BACK_PREFIX = "rolled-back-"


@dataclass(frozen=True)
class CheckpointRow:
    step: int
    tokens_seen: int
    loss: float
    layout: str
    created: str
    size_mb: float
    path: str


def list_checkpoints(root: Path) -> list[CheckpointRow]:
    """Committed checkpoints, newest first (rolled-back ones are not listed)."""
    rows = []
    for info in committed_checkpoints(root):
        m = info.manifest
        layout = m["layout"]
        rows.append(CheckpointRow(
            step=info.step, tokens_seen=m["tokens_seen"], loss=m["loss"],
            layout=(f"pp{layout['pp']} x dp{layout['dp_replicate'] * layout['dp_shard']} x tp{layout['tp']}"
                    f" ({layout['world_size']} ranks)"),
            created=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m["created_unix"])),
            size_mb=sum(p.stat().st_size for p in info.path.iterdir()) / 2**20,
            path=str(info.path),
        ))
    return rows


def verify(root: Path, step: int | None = None) -> dict[int, list[str]]:
    """Problems per checkpoint (all, or one step); an empty list means every file verifies."""
    return {info.step: verify_checkpoint(info.path) for info in _select(root, step)}


def rollback(root: Path, step: int, persistent_url: str = "") -> Path:
    """Make `step` the latest checkpoint again: newer committed and partial ones move, intact,
    into `rolled-back-<time>/` (returned), so the next train run resumes from `step` -- here and,
    with `persistent_url` (checkpoint.persistent_url), on a node that pulls from the persistent
    tier, whose newer copies move into a directory of the same name there. Also clears what
    pointed past it: the train summary and an instability report of the run."""
    [target] = _select(root, step)
    problems = verify_checkpoint(target.path)
    if problems:
        raise CheckpointError(f"cannot roll back to {target.path}: {'; '.join(problems)}")
    newer = [info.path for info in committed_checkpoints(root) if info.step > step]
    newer += sorted(root.glob(".step-*.partial"))
    archive = root / f"{ROLLED_BACK_PREFIX}{time.strftime('%Y%m%dT%H%M%S')}"
    if newer:
        archive.mkdir()
    for path in newer:
        path.rename(archive / path.name)
    if persistent_url:
        _roll_back_tier(persistent_url, step, archive.name)
    outputs = TrainOutputs(root.parent)  # root is its `checkpoints`
    for stale in (outputs.summary, outputs.unstable_report):
        stale.unlink(missing_ok=True)
    return archive


def _roll_back_tier(url: str, step: int, archive: str) -> None:
    # Else the tier's newest copy is a discarded step: a node without local copies would resume
    # from it, and the retrained step of the same name would never be uploaded over it.
    tier = PersistentTier(url, MANIFEST_NAME)
    try:
        tier.set_aside([name for name in tier.steps() if name > step_dir_name(step)], archive)
    finally:
        tier.close()


def export(root: Path, step: int, tokenizer_dir: Path, out_dir: Path, fmt: str = "bundle") -> Path:
    """One version, from a checkpoint of any layout, as a forgeline inference bundle (weights as
    safetensors, architecture, tokenizer) or a Hugging Face directory of its family (`hf`);
    never overwrites `out_dir`."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty: choose another --out")
    [info] = _select(root, step)
    model = load_from_checkpoint(info.path)
    if fmt == "hf":
        return export_hf(model, tokenizer_dir, out_dir)
    with staging_dir(out_dir) as tmp:
        save_bundle(model, tmp)
        shutil.copytree(tokenizer_dir, tmp / "tokenizer")
        replace_dir(tmp, out_dir)
    return out_dir


def _select(root: Path, step: int | None) -> list[CheckpointInfo]:
    found = committed_checkpoints(root)
    if step is None:
        return found
    chosen = [info for info in found if info.step == step]
    if not chosen:
        steps = ", ".join(str(info.step) for info in found) or "none"
        raise CheckpointError(f"no committed checkpoint {step_dir_name(step)} in {root}; committed: {steps}")
    return chosen
