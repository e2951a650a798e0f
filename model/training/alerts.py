"""Alerts that name the place: a rank writes one line to stdout -- ALERT_PREFIX and a JSON object
with the kind, the rank and host it concerns, the step and a message -- and the train stage's
launcher, which reads every output line of the job, posts it to the configured Prefect
notification block (tasks/train/alerts.py). No Prefect here: the ranks only print."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal, get_args

ALERT_PREFIX = "FORGELINE-ALERT "
AlertKind = Literal["nonfinite", "rollback", "straggler", "hang", "preemption", "unstable"]
KINDS: tuple[str, ...] = get_args(AlertKind)
MAX_MESSAGE = 2000  # keeps a line under PIPE_BUF (4096 bytes): one write, never interleaved


@dataclass(frozen=True)
class Alert:
    kind: AlertKind
    rank: int  # the global rank it concerns
    host: str  # that rank's host
    step: int | None
    message: str
    time: float  # seconds since the epoch

    def line(self) -> str:
        return ALERT_PREFIX + json.dumps(asdict(self), separators=(",", ":"))


def make_alert(kind: AlertKind, message: str, step: int | None = None, rank: int | None = None,
               host: str | None = None) -> Alert:
    """An alert about `rank` on `host`; by default this process's global rank (RANK, as torchrun
    sets it) and host."""
    if kind not in KINDS:
        raise ValueError(f"alert kind {kind!r} is none of {', '.join(KINDS)}")
    return Alert(kind, int(os.environ.get("RANK", "0")) if rank is None else rank,
                 socket.gethostname() if host is None else host, step, message[:MAX_MESSAGE], time.time())


def emit_alert(kind: AlertKind, message: str, step: int | None = None, rank: int | None = None,
               host: str | None = None) -> None:
    """Print the alert line for the launcher (flushed at once: the rank may die next)."""
    sys.stdout.write(make_alert(kind, message, step, rank, host).line() + "\n")
    sys.stdout.flush()


def parse_alert(line: str) -> Alert | None:
    """The alert in an output line, if it holds one; a prefix before it (torchrun's or srun's
    `[rank]:`/`0:` labels) is ignored."""
    start = line.find(ALERT_PREFIX)
    if start < 0:
        return None
    try:
        fields = json.loads(line[start + len(ALERT_PREFIX):])
        alert = Alert(**fields)
    except (ValueError, TypeError):  # not JSON, or not an alert's fields
        return None
    return alert if alert.kind in KINDS else None
