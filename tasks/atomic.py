"""All-or-nothing outputs: a directory built under a temporary name, then swapped in whole; a
file written to a temporary file, then renamed over it.

Temporary files and directories and replaced directories are named after their owner,
`.NAME.tmp-<host>-<pid>-XXXX` and `.NAME.old-<host>-<pid>`, so that the ones a killed process
left behind can be told from those of a process still at work (on this host or, on a shared
filesystem, another one), and the next writer of NAME removes them.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from forgeline.model.fileio import fsync_path


@contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """A fresh temporary directory beside `final` (same filesystem, so the swap is a rename);
    removed if the block fails or does not call `replace_dir`. Those a dead process left beside
    `final` go first (`remove_stale_staging`)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{_owner()}-", dir=final.parent))
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
        old = final.with_name(f".{final.name}.old-{_owner()}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old)


def remove_stale_staging(final: Path) -> list[Path]:
    """Remove what a process killed mid-write left beside `final`: its temporary directories and,
    once `final` exists again, a replaced one it had not yet removed. Only this host's, and only
    those whose process is gone; returns what was removed."""
    if not final.parent.is_dir():
        return []
    # mkdtemp's random suffix has no '-', so another host named `<this host>-<digits>` never matches.
    name, host = re.escape(final.name), re.escape(socket.gethostname())
    owned = re.compile(rf"\.{name}\.(?:tmp-{host}-(?P<tmp>\d+)-[^-]+|old-{host}-(?P<old>\d+))")
    removed = []
    for path in final.parent.iterdir():
        match = owned.fullmatch(path.name)
        if match is None or _alive(int(match["tmp"] or match["old"])):
            continue
        if match["old"] and not final.exists():
            continue  # a swap cut short between its two renames: this is the only copy left
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:  # a file's temporary file (write_text_atomic)
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_text_atomic(path: Path, text: str) -> None:
    """Write `path` whole or not at all; concurrent writers (launchers of several nodes on a
    shared filesystem) each rename their own temporary file. A failed write removes its
    temporary file; a killed writer's goes with the next write (`remove_stale_staging`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{_owner()}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fsync_path(Path(dirpath, name))
        fsync_path(Path(dirpath))
