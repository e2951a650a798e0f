"""Durable file helpers shared by the data format and checkpoints."""

from __future__ import annotations

import hashlib
import os
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
