"""Directory outputs swapped in whole and files renamed in whole: what a SIGKILLed writer leaves
behind is named after its owner and removed by the next writer, never another host's or a live
process's."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from forgeline.tasks.atomic import replace_dir, staging_dir, write_text_atomic
from tests.conftest import REPO_ROOT

HOST = socket.gethostname()


def killed_mid_write(final: Path) -> tuple[Path, int]:
    """A real process that enters staging_dir(final), writes a file and is SIGKILLed there."""
    script = ("import sys, time; from pathlib import Path; from forgeline.tasks.atomic import staging_dir\n"
              "with staging_dir(Path(sys.argv[1])) as tmp:\n"
              "    (tmp / 'part').write_text('half')\n"
              "    print(tmp, flush=True)\n"
              "    time.sleep(600)\n")
    writer = subprocess.Popen([sys.executable, "-c", script, str(final)], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        tmp = Path(writer.stdout.readline().strip())
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
    return tmp, writer.pid


def test_a_killed_writers_directory_is_named_after_it_and_removed_by_the_next(tmp_path: Path) -> None:
    final = tmp_path / "out"
    stale, pid = killed_mid_write(final)
    assert stale.parent == tmp_path and stale.name.startswith(f".out.tmp-{HOST}-{pid}-")
    assert (stale / "part").read_text() == "half"  # SIGKILL runs no cleanup
    # Not this writer's to remove: another host's (on a shared filesystem) and a live process's.
    # The other host's name extends this one's, with its "pid" that of the killed writer.
    other_host = tmp_path / f".out.tmp-{HOST}-{pid}-{os.getpid()}-abcd1234"
    live = tmp_path / f".out.tmp-{HOST}-{os.getpid()}-abcd1234"
    other_output = tmp_path / f".outer.tmp-{HOST}-{pid}-abcd1234"
    for path in (other_host, live, other_output):
        path.mkdir()
    with staging_dir(final) as tmp:
        assert not stale.exists()
        (tmp / "done").write_text("whole")
        replace_dir(tmp, final)
    assert (final / "done").read_text() == "whole"
    assert other_host.is_dir() and live.is_dir() and other_output.is_dir()


def test_a_replaced_directory_left_behind_goes_only_once_the_output_is_back(tmp_path: Path) -> None:
    final = tmp_path / "out"
    _, pid = killed_mid_write(final)
    old = tmp_path / f".out.old-{HOST}-{pid}"
    old.mkdir()  # killed between the two renames of replace_dir: the previous output, only copy
    with staging_dir(final) as tmp:
        assert old.is_dir()
        replace_dir(tmp, final)
    with staging_dir(final):  # killed after the swap, before removing the old one: garbage
        assert not old.exists()


def test_a_file_write_leaves_no_temporary_file_behind(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    write_text_atomic(summary, "{}\n")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(summary, "a lone surrogate \udcff")  # fails mid-write
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"] and summary.read_text() == "{}\n"

    _, dead = killed_mid_write(tmp_path / "elsewhere" / "out")
    stale = tmp_path / f".summary.json.tmp-{HOST}-{dead}-abcd1234"
    live = tmp_path / f".summary.json.tmp-{HOST}-{os.getpid()}-abcd1234"
    for path in (stale, live):
        path.write_text("half")
    write_text_atomic(summary, "{\"done\": true}\n")
    assert not stale.exists() and live.exists() and summary.read_text() == "{\"done\": true}\n"
