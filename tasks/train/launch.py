"""Run a command in its own process group, stream its output to a logger, and kill the whole
group when it times out or the caller is interrupted (Ctrl-C, Prefect cancellation); the command
also dies with the caller when the caller is killed outright (SIGKILL, OOM killer)."""

from __future__ import annotations

import collections
import contextvars
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence


class LaunchError(RuntimeError):
    """The launched job failed or timed out; the message carries the tail of its output."""


class LaunchTimeout(LaunchError):
    """The launched job ran past its wall-clock limit (train.timeout_s) and was stopped."""


def run_streaming(cmd: Sequence[str], env: Mapping[str, str], timeout_s: float,
                  logger: logging.Logger, grace_s: float = 10.0,
                  on_line: Callable[[str], None] | None = None) -> None:
    """Run `cmd`, each output line to `logger` (and `on_line`); raise LaunchError on failure."""
    logger.info("launching: %s", " ".join(cmd))
    proc = subprocess.Popen(
        dying_with_caller(cmd), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, bufsize=1, start_new_session=True,
    )
    tail: collections.deque[str] = collections.deque(maxlen=40)
    stopping = threading.Event()
    # The reader runs in the caller's context, so Prefect's log handler knows the task run.
    context = contextvars.copy_context()
    reader = threading.Thread(target=context.run, args=(_pump, proc, logger, tail, on_line, stopping),
                              daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                _kill_group(proc, grace_s)
                raise LaunchTimeout(f"{cmd[0]} timed out after {timeout_s:.0f}s; process group killed"
                                  + _format_tail(tail))
            time.sleep(0.2)
    finally:
        if proc.poll() is None:  # interrupted or cancelled while the job still runs
            logger.warning("stopping the launched job (process group %d)", proc.pid)
            stopping.set()
            _kill_group(proc, grace_s)
        reader.join(timeout=5)
    if proc.returncode != 0:
        raise LaunchError(f"{' '.join(cmd[:3])} ... exited with code {proc.returncode}"
                          + _format_tail(tail))


def dying_with_caller(cmd: Sequence[str]) -> list[str]:
    """`cmd` run so that the kernel SIGKILLs it when this process dies: the caller's `finally`
    kills the group on every exit it sees, but not on a SIGKILL of its own. util-linux's setpriv
    arms the parent-death signal and execs the command (it survives exec); without setpriv
    (not Linux) the command runs as it is."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *cmd] if setpriv else list(cmd)


def _pump(proc: subprocess.Popen, logger: logging.Logger, tail: collections.deque,
          on_line: Callable[[str], None] | None, stopping: threading.Event) -> None:
    """The job's lines to the log; once this process stops the job, torchrun's own (the
    traceback of the SignalException it ends in) to the stage's log file alone, under
    TORCHRUN_LOGGER, which the console leaves out: the console ends in one sentence."""
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            tail.append(line)
            relay_line(logging.getLogger(TORCHRUN_LOGGER) if stopping.is_set() else logger, line)
            if on_line is not None:
                on_line(line)


# A rank's log line (model/training/worker.py): "[rank0] 2026-12-03 20:58:51,713 INFO name: message".
RANK_LINE = re.compile(r"\[rank(\d+)\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "
                       r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): (.*)")
# The training progress line of model/training/metrics.py: "... step 5/20  loss 6.659 ...".
STEP_PROGRESS = re.compile(r"step (\d+)/(\d+)\s+(.*)")
METRICS_LOGGER = "forgeline.model.training.metrics"
TORCHRUN_LOGGER = "torchrun"  # not under "torch": torch gives that logger its own stderr handler


def relay_line(logger: logging.Logger, line: str) -> None:
    """A line of the launched job's output as a record of this process: a rank's log line to
    the logger that logged it there, at its level, stamped once ("[rank0] message": this
    process's handlers add the time), with its step as the record's `progress`
    (flows/console.py draws it); any other line (torchrun's own, a traceback) to `logger` as it is."""
    match = RANK_LINE.fullmatch(line)
    if match is None:
        logger.info("%s", line)
        return
    rank, level, name, message = match.groups()
    step = STEP_PROGRESS.search(message) if name == METRICS_LOGGER else None
    extra = {} if step is None else {"progress": (int(step[1]), int(step[2]), step[3])}
    logging.getLogger(name).log(logging.getLevelName(level), "[rank%s] %s", rank, message, extra=extra)


def _kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the group, give it `grace_s` to exit, then SIGKILL whatever is left of it. The
    ranks torchrun starts are in sessions of their own, out of the group's reach, but they die
    with torchrun (model/training/worker.py arms their parent-death signal). An interruption of
    the grace period (a second termination signal) cuts it short, never the SIGKILL."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _format_tail(tail: collections.deque) -> str:
    return ("\n--- last output ---\n" + "\n".join(tail)) if tail else ""
