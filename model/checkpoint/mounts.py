"""Whether the checkpoint root's flock reaches other machines.

The commit protocol (manager.py) fences a stale training attempt with an flock held across a
check of the generation token and the act it guards. On a network file system that keeps flock
on each client (NFS mounted `local_lock=flock|all` or `nolock`; Lustre `localflock`, or without
`flock`, where flock fails), an attempt on another machine -- a retry the scheduler placed
elsewhere while a rank of the old one lives on -- is fenced by the token check alone, which leaves
a window between check and act. That is said at the start of training, naming the mount.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    options: frozenset[str]
    """The mount's options and its file system's (super block) options together."""


def unescape(field: str) -> str:
    """mountinfo's octal escapes (a space is \\040)."""
    return re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 6 or len(tail) < 3:
            continue
        options = frozenset(fields[5].split(",") + tail[2].split(","))
        mounts.append(Mount(unescape(fields[4]), tail[0], options))
    return mounts


def mount_of(path: Path, mounts: list[Mount]) -> Mount | None:
    """The mount `path` lies on: the last-mounted of the longest mount points above it."""
    path = path.resolve()
    above = [mount for mount in mounts if path == Path(mount.point) or Path(mount.point) in path.parents]
    return max(reversed(above), key=lambda mount: len(mount.point), default=None)


def node_local_flock(mount: Mount) -> str | None:
    """Why flock on `mount` does not reach other machines, or None when it does or when the
    file system is this machine's own."""
    if mount.fstype in ("nfs", "nfs4"):
        if "nolock" in mount.options:
            return "NFS mounted nolock: locks are this client's only"
        for option in ("local_lock=flock", "local_lock=all"):
            if option in mount.options:
                return f"NFS mounted {option}: flock is this client's only"
    if mount.fstype == "lustre":
        if "localflock" in mount.options:
            return "Lustre mounted localflock: flock is this client's only"
        if "flock" not in mount.options:
            return "Lustre mounted without flock: flock is not supported"
    return None


def flock_warning(root: Path, mountinfo: str | None = None) -> str | None:
    """The warning to give when `root`'s flock does not fence other machines, else None."""
    mounts = parse_mountinfo(MOUNTINFO.read_text() if mountinfo is None else mountinfo)
    mount = mount_of(root, mounts)
    if mount is None or (why := node_local_flock(mount)) is None:
        return None
    return (f"checkpoints under {root} are on {mount.point} ({why}): a training attempt on another machine "
            "is fenced by the generation token check alone, not by the lock; mount it with cluster-wide "
            "flock (NFS with locking, Lustre -o flock) where a retry can run on another node")
