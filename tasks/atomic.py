"""All-or-nothing directory outputs: build under a temporary name, then swap in whole."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from forgeline.model.fileio import fsync_path


@contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """A fresh temporary directory beside `final` (same filesystem, so the swap is a rename);
    removed if the block fails or does not call `replace_dir`."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would outlive the swap
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(tmp: Path, final: Path) -> None:
    """Swap `tmp` in as `final`; the previous `final`, if any, is removed only afterwards."""
    fsync_tree(tmp)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `path` whole or not at all; concurrent writers (launchers of several nodes on a
    shared filesystem) each rename their own temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fsync_path(Path(dirpath, name))
        fsync_path(Path(dirpath))
