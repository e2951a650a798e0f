import logging
import os
import sys
import time
from pathlib import Path

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
