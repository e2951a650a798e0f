"""`forgeline clean`: remove the outputs a user names -- a checkpoint directory, a stage's output
directory, a run's directory (`artifacts/<run.name>`) -- and nothing else. It is the only way
forgeline removes committed checkpoints: a run never clears a train directory that holds another
configuration's (tasks/train/job.py check_run_directory)."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from forgeline.configs import schema

ARTIFACTS_DIR = Path(schema.ARTIFACTS_DIR)  # where a config naming no directory writes (relative)


def clean(paths: Sequence[Path], outside_artifacts: bool = False) -> list[Path]:
    """Remove each of `paths`, a directory or a file, and return them. Every path is checked before
    any is removed, so a typo in the last one removes nothing: each must exist and, unless
    `outside_artifacts`, lie in the artifacts tree (a mistyped path elsewhere is no output)."""
    for path in paths:
        check_removable(path, outside_artifacts)
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return list(paths)


def check_removable(path: Path, outside_artifacts: bool) -> None:
    if not path.exists() and not path.is_symlink():
        raise FileNotFoundError(f"{path}: nothing there to remove; nothing was removed")
    where = path.resolve()
    if where in (Path.cwd(), *Path.cwd().parents):
        raise ValueError(f"{path} holds the working directory: name the output directories in it instead; "
                         "nothing was removed")
    if not outside_artifacts and not where.is_relative_to(ARTIFACTS_DIR.resolve()):
        raise ValueError(f"{path} is outside {ARTIFACTS_DIR.resolve()}, where forgeline writes its outputs: "
                         "pass --outside-artifacts if it is one (a config's out_dir elsewhere); "
                         "nothing was removed")
