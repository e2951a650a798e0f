"""The start of training says when the checkpoint root's flock does not reach other machines."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from forgeline.model.checkpoint import mounts
from forgeline.model.checkpoint.manager import claim_generation
from forgeline.model.checkpoint.mounts import flock_warning, mount_of, parse_mountinfo

# The root file system, then a shared one at /shared (options as the kernel writes them).
LOCAL = "27 1 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw"


def shared(fstype: str, options: str, point: str = "/shared") -> str:
    return f"{LOCAL}\n90 27 0:52 / {point} rw,relatime shared:40 - {fstype} server:/export {options}"


@pytest.mark.parametrize(("fstype", "options", "why"), [
    ("nfs4", "rw,vers=4.2,hard,proto=tcp,local_lock=flock,addr=10.0.0.2", "NFS mounted local_lock=flock"),
    ("nfs", "rw,vers=3,nolock,proto=tcp", "NFS mounted nolock"),
    ("lustre", "rw,localflock", "Lustre mounted localflock"),
    ("lustre", "rw,lazystatfs", "Lustre mounted without flock"),
])
def test_a_root_whose_flock_stays_on_this_machine_is_named_with_its_mount(fstype: str, options: str,
                                                                          why: str) -> None:
    warning = flock_warning(Path("/shared/runs/train"), shared(fstype, options))
    assert warning is not None and f"on /shared ({why}" in warning


@pytest.mark.parametrize(("fstype", "options"), [
    ("nfs4", "rw,vers=4.2,hard,proto=tcp,local_lock=none,addr=10.0.0.2"),  # flock reaches the server
    ("lustre", "rw,flock"),
    ("ext4", "rw"),
])
def test_a_root_whose_flock_fences_every_client_passes(fstype: str, options: str) -> None:
    assert flock_warning(Path("/shared/runs/train"), shared(fstype, options)) is None
    assert flock_warning(Path("/elsewhere/train"), shared("nfs4", "rw,local_lock=all")) is None


def test_the_mount_of_a_path_is_the_deepest_and_last_mounted() -> None:
    text = "\n".join([LOCAL, shared("nfs4", "rw,local_lock=all", point=r"/my\040runs").split("\n")[1],
                      "91 27 0:53 / /sharedx rw - tmpfs tmpfs rw"])
    mount = mount_of(Path("/my runs/a"), parse_mountinfo(text))
    assert (mount.point, mount.fstype) == ("/my runs", "nfs4")
    assert mount_of(Path("/sharedx/a"), parse_mountinfo(text)).fstype == "tmpfs"
    assert mount_of(Path("/shared/a"), parse_mountinfo(text)).fstype == "ext4"


def test_training_starts_by_saying_so(tmp_path: Path, process_group: None, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "train"
    assert flock_warning(root) is None  # this machine's own file system
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(shared("nfs4", "rw,local_lock=flock", point=str(tmp_path)))
    monkeypatch.setattr(mounts, "MOUNTINFO", mountinfo)
    with caplog.at_level(logging.WARNING, logger="forgeline.model.checkpoint.manager"):
        claim_generation(root, 0)
    assert f"checkpoints under {root} are on {tmp_path} (NFS mounted local_lock=flock" in caplog.text
