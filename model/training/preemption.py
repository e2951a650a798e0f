"""Preemption: a scheduler that takes the machines back (Slurm's time limit or `--signal`, a
Kubernetes eviction, a spot reclaim) sends SIGTERM or SIGUSR1 and kills the job a grace period
later. Each rank notes the signal; at the end of the step it is in, all ranks agree on it (the
signal reaches them at slightly different times), save that step, wait for the commit, record
the preemption and end the loop (the end-of-training hooks still run: the persistent tier's
upload, the metrics' flush); the rank program then exits with PREEMPTED_EXIT_CODE. The launcher
turns that into a Slurm requeue or a Prefect retry (tasks/train/job.py), which resumes from the
checkpoint -- bit-exact in deterministic mode, as from any other.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from forgeline.model.training.alerts import emit_alert
from forgeline.model.training.callbacks import CheckpointCallback
from forgeline.model.training.loop import Callback, Trainer

log = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: try again later


class PreemptionNotice:
    """Notes the first preemption signal. Installed first thing in the rank program, so a signal
    that comes while the model is still being built or loaded is not lost either."""

    def __init__(self) -> None:
        self.signum = 0
        self.received = 0.0

    def install(self) -> None:
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the handler runs between two bytecodes of the step, which goes on.
        if not self.signum:
            self.signum, self.received = signum, time.monotonic()


@dataclass
class PreemptionCallback(Callback):
    """Installed after the CheckpointCallback it saves through, so a step that was due for a
    periodic save is not saved twice. `record`: the file rank 0 writes the preemption to (the
    launcher reads it); `grace_s`: only to report the margin that was left."""

    notice: PreemptionNotice
    checkpoints: CheckpointCallback
    record: Path
    grace_s: float
    device: torch.device
    rank: int

    def post_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        signum = self._agreed_signal()
        if not signum:
            return
        step = trainer.state.step
        received = self.notice.received or time.monotonic()  # another rank had it first
        self.checkpoints.save(trainer, metrics)
        self.checkpoints.manager.wait()
        waited = time.monotonic() - received
        name = signal.Signals(signum).name
        if self.rank == 0:
            self.record.write_text(json.dumps({
                "signal": name, "step": step, "host": socket.gethostname(),
                "seconds_to_commit": round(waited, 3), "grace_s": self.grace_s,
            }) + "\n")
            log.warning("%s: saved step %d %.1f s after the signal (grace %.0f s); exiting for the requeue "
                        "or retry to resume from it", name, step, waited, self.grace_s)
            emit_alert("preemption", f"{name}: step {step} saved {waited:.1f} s after the signal (grace "
                                     f"{self.grace_s:.0f} s); the job exits to be requeued or retried", step)
        trainer.stopped_early = f"preempted by {name} after step {step}"

    def _agreed_signal(self) -> int:
        """Collective: the signal any rank has received (0: none), the same on every rank."""
        flag = torch.tensor([self.notice.signum], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
