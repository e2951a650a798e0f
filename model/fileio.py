"""Durable file helpers shared by the data format and checkpoints."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (the latter makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def new_directory(out_dir: Path) -> Iterator[Path]:
    """`out_dir` written whole or not at all: the block fills the temporary sibling it is given,
    which is renamed into place when the block ends (and removed if it raises). An existing
    non-empty `out_dir` is refused before the block runs, and never touched."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; remove it or write elsewhere")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp's 0o700 would make the directory private to this user
    try:
        yield tmp
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); rmdir fails if something appeared since
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(out_dir.parent)
