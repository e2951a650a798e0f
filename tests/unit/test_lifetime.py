"""A child tied to its parent's lifetime (model/lifetime.py), with real processes: the in-training
evaluation (eval/periodic.py) runs in a session of its own, so no signal to the job's group reaches
it, and the kernel kills it when rank 0 is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.unit.test_sandbox import processes_with

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

# Started by the parent below as rank 0 starts the evaluation: in a session of its own.
CHILD = ("import sys, time\nfrom forgeline.model.lifetime import die_with_parent\ndie_with_parent()\n"
         "open(sys.argv[1], 'w').close()\ntime.sleep(120)\n")
PARENT = ("import subprocess, sys, time\n"
          "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2], sys.argv[3]],"
          " start_new_session=True)\nprint(child.pid, flush=True)\ntime.sleep(120)\n")


def gone_within(marker: str, seconds: float) -> bool:
    """Whether no process carries `marker` (a zombie's command line is empty) within `seconds`."""
    deadline = time.monotonic() + seconds
    while processes_with(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_child_in_a_session_of_its_own_dies_with_its_sigkilled_parent(tmp_path: Path) -> None:
    armed, marker = tmp_path / "armed", f"forgeline-lifetime-child-{uuid.uuid4().hex}"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(armed), marker],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 60  # the child's interpreter start-up, on a loaded machine
    while not armed.exists():
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.1)
    assert os.getpgid(child) == child  # out of the parent's group: a group kill would miss it
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    # The kernel's signal is immediate; the margin is for a loaded machine.
    assert gone_within(marker, 30), processes_with(marker)
