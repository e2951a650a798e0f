"""A child process's lifetime tied to its parent's: the kernel's parent-death signal."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the one that started it dies, however it dies
    (SIGKILL included, which no handler of the parent sees). Linux only; elsewhere a no-op.

    The signal follows the thread that forked this process: the parent must start it from a
    thread that lives as long as it does (its main thread)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)
