"""The processes a test run started, found by an environment variable they inherit: set in
`os.environ`, it reaches every process started after it and every process those start, even one
that its parent left behind to be adopted by PID 1 (a server outliving its `forgeline`). Its
value names the run, and a run inside it appends to it ("RUN/gw0"), so that a run finds its own
processes and those of the runs it contains by prefix."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import psutil

# The variable every process of a pytest session carries (tests/conftest.py sets it).
SESSION_ENV = "FORGELINE_TEST_SESSION"


def carrying(name: str, value: str) -> list[psutil.Process]:
    """Live processes whose environment gives `name` the value `value`, or one under it
    (`value/...`). A process's environment as it was at its start (/proc/PID/environ): one that
    set the variable itself later does not count, nor does a forked child that did not exec."""
    found = []
    for process in psutil.process_iter():
        try:
            held = process.environ().get(name)
            if held is not None and (held == value or held.startswith(value + "/")) and alive(process):
                found.append(process)
        except psutil.Error:  # gone already, a zombie, or another user's
            continue
    return found


def descendants(pid: int) -> list[psutil.Process]:
    """Live children of `pid`, and theirs, as long as they are still attached to it."""
    try:
        return [child for child in psutil.Process(pid).children(recursive=True) if alive(child)]
    except psutil.NoSuchProcess:
        return []


def alive(process: psutil.Process) -> bool:
    """Running, not a zombie waiting for its parent to read its exit status."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def started_by_this_process(name: str, value: str) -> list[psutil.Process]:
    """What this process started, attached to it still or not: its descendants, and the processes
    carrying `name=value`; not this process itself, nor its multiprocessing resource tracker."""
    found = {process.pid: process for process in carrying(name, value) + descendants(os.getpid())
             if not own_resource_tracker(process)}
    found.pop(os.getpid(), None)
    return sorted(found.values(), key=lambda process: process.pid)


def own_resource_tracker(process: psutil.Process) -> bool:
    """Python's multiprocessing resource tracker of this process (started with its first spawned
    child, a Dask worker's say): it reads a pipe from this process, and ends with it."""
    try:
        command = " ".join(process.cmdline())
        return process.ppid() == os.getpid() and "multiprocessing.resource_tracker" in command
    except psutil.Error:
        return False


def still_there(find: Callable[[], list[psutil.Process]], grace_s: float) -> list[psutil.Process]:
    """What `find` returns once `grace_s` has passed, or sooner once it returns nothing: time for
    processes on their way out to go."""
    deadline = time.monotonic() + grace_s
    while (found := find()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def describe(process: psutil.Process) -> str:
    """'pid 42 (parent 1): python -m uvicorn ...'"""
    try:
        return f"pid {process.pid} (parent {process.ppid()}): {' '.join(process.cmdline())[:300]}"
    except psutil.Error:
        return f"pid {process.pid} (gone while being described)"


def stop(processes: list[psutil.Process], grace_s: float = 5) -> None:
    """SIGTERM each, SIGKILL those still there after `grace_s`."""
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, left = psutil.wait_procs(processes, timeout=grace_s)
    for process in left:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=grace_s)
