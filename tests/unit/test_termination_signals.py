"""The CLI's termination signals: the first SIGTERM or SIGHUP raises `Terminated` where the main
thread is, later ones leave the stopping alone; the process's own handlers come back after a
block no signal interrupted. (`forgeline run` stopped mid-train: tests/integration/test_termination.py.)"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forgeline.flows.cli import TERMINATION_SIGNALS, Terminated, termination_signals_stop_the_work


@pytest.fixture(autouse=True)
def own_handlers_restored() -> Iterator[None]:
    """A block a signal interrupted keeps its handlers (its process is on its way out): not this one."""
    saved = {signum: signal.getsignal(signum) for signum in TERMINATION_SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("signum", TERMINATION_SIGNALS, ids=lambda signum: signal.Signals(signum).name)
def test_the_first_signal_raises_in_the_main_thread_and_later_ones_are_only_logged(
        signum: int, caplog: pytest.LogCaptureFixture) -> None:
    stopped_in_order = False
    with pytest.raises(Terminated) as raised, termination_signals_stop_the_work():
        try:
            os.kill(os.getpid(), signum)
            pytest.fail("the signal did not stop the work")
        finally:
            with caplog.at_level(logging.WARNING):
                os.kill(os.getpid(), signal.SIGTERM)  # a second signal while stopping
            stopped_in_order = True
    assert stopped_in_order
    assert raised.value.code == 128 + signum  # as the signal's default action would exit
    assert str(raised.value).startswith(f"stopped by {signal.Signals(signum).name}")
    assert "SIGTERM received while stopping" in caplog.text


def test_the_previous_handlers_come_back_after_a_block_no_signal_interrupted() -> None:
    def previous(signum: int, frame: object) -> None:
        pass

    for signum in TERMINATION_SIGNALS:
        signal.signal(signum, previous)
    with termination_signals_stop_the_work():
        assert all(signal.getsignal(signum) is not previous for signum in TERMINATION_SIGNALS)
    assert all(signal.getsignal(signum) is previous for signum in TERMINATION_SIGNALS)


def test_ctrl_c_stops_the_work_as_sigterm_does_and_reaches_this_process_alone() -> None:
    """SIGINT raises `Terminated` (exit 130) through the thread that takes it; a process started
    in the block has it blocked, so a terminal's Ctrl-C to the whole group leaves it running."""
    saved = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(Terminated) as raised, termination_signals_stop_the_work(ctrl_c=True):
            child = subprocess.Popen(["sleep", "30"])
            blocked = int(re.search(r"SigBlk:\s*(\w+)", Path(f"/proc/{child.pid}/status").read_text())[1], 16)
            child.kill()
            child.wait()
            assert blocked & 1 << (signal.SIGINT - 1)
            os.kill(os.getpid(), signal.SIGINT)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the relaying thread raises it here, soon
                time.sleep(0.01)
            pytest.fail("SIGINT did not stop the work")
        assert raised.value.code == 128 + signal.SIGINT
        assert str(raised.value).startswith("stopped by SIGINT: the work was stopped in order")
    finally:
        signal.signal(signal.SIGINT, saved)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_is_unblocked_after_a_block_no_signal_interrupted() -> None:
    with termination_signals_stop_the_work(ctrl_c=True):
        assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
