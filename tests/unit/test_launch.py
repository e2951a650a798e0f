import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from forgeline.tasks.train.launch import LaunchError, run_streaming

log = logging.getLogger("forgeline.test.launch")


def test_output_is_streamed_to_the_logger(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="forgeline.test.launch")
    run_streaming([sys.executable, "-c", "print('hello'); print('world')"], os.environ, 30, log)
    assert "hello" in caplog.text and "world" in caplog.text


def test_failure_carries_the_tail_of_the_output() -> None:
    with pytest.raises(LaunchError, match=r"exited with code 3(.|\n)*boom"):
        run_streaming([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], os.environ, 30, log)


def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    # The parent starts a grandchild that ignores SIGTERM; both must be gone afterwards.
    script = (
        "import os, signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    started = time.monotonic()
    with pytest.raises(LaunchError, match="timed out after 2s; process group killed"):
        run_streaming([sys.executable, "-c", script], os.environ, 2, log, grace_s=1)
    assert time.monotonic() - started < 20
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        for _ in range(50):  # the grandchild may take a moment to be reaped by init
            os.kill(child, 0)
            time.sleep(0.1)


def gone(pid: int) -> bool:
    """Exited (a zombie nobody reaped counts: it runs nothing)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_command_dies_with_its_caller_killed_outright(tmp_path: Path) -> None:
    """SIGKILL leaves the caller no `finally` to kill the group in: the kernel kills the command."""
    pid_file = tmp_path / "pid"
    command = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    caller = subprocess.Popen([sys.executable, "-c", (
        "import logging, os, sys\n"
        "from forgeline.tasks.train.launch import run_streaming\n"
        f"run_streaming([sys.executable, '-c', {command!r}], os.environ, 300, logging.getLogger())\n")])
    deadline = time.monotonic() + 60
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    command_pid = int(pid_file.read_text())
    assert not gone(command_pid)
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    deadline = time.monotonic() + 10
    while not gone(command_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(command_pid), "the launched command outlived its killed caller"
