"""Fault injection for the recovery tests: loop callbacks (set through `train.callbacks`) that
kill, hang or poison a rank at a given step. Each fires once per `once` marker file, so the
restarted or retried job runs clean."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from forgeline.model.training.loop import Callback, Trainer


class _Once(Callback):
    def __init__(self, step: int, once: str, rank: int = 0):
        self.step, self.marker, self.rank = step, Path(once), rank

    def _due(self, step: int) -> bool:
        if step != self.step or int(os.environ.get("RANK", "0")) != self.rank or self.marker.exists():
            return False
        self.marker.write_text(f"fired at step {step}\n")
        return True


class KillBefore(_Once):
    """SIGKILL this rank just before step `step` runs."""

    def pre_step(self, trainer: Trainer) -> None:
        if self._due(trainer.state.step + 1):
            os.kill(os.getpid(), signal.SIGKILL)


class KillAfterSaveStarts(_Once):
    """SIGKILL right after the (asynchronous) save of `step` started, before it is committed.
    Must come after the checkpoint callback, as train.callbacks entries do."""

    def post_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if self._due(trainer.state.step):
            os.kill(os.getpid(), signal.SIGKILL)


class HangBefore(_Once):
    """Sleep (for good, as far as the job is concerned) before step `step`."""

    def pre_step(self, trainer: Trainer) -> None:
        if self._due(trainer.state.step + 1):
            time.sleep(3600)


class ScaleWeightsBefore(_Once):
    """Multiply every weight by `factor` before step `step` (on every rank: `rank` is ignored):
    NaN poisons the model, a large factor makes the loss spike."""

    def __init__(self, step: int, once: str, factor: float):
        super().__init__(step, once)
        self.factor = factor
        self.fired_here = False

    def pre_step(self, trainer: Trainer) -> None:
        # Every rank must scale its shard: the marker is checked by all before any writes it.
        if trainer.state.step + 1 != self.step or self.fired_here or self.marker.exists():
            return
        self.fired_here = True
        torch.distributed.barrier()
        if int(os.environ.get("RANK", "0")) == 0:
            self.marker.write_text(f"fired at step {self.step}\n")
        with torch.no_grad():
            for part in trainer.train_step.parts:
                for param in part.parameters():
                    param.mul_(self.factor)


class WaitBefore(Callback):
    """Rank `rank` waits before step `step` until the file `until` exists (at most `timeout_s`):
    a test's cue that the world outside the job is ready (a server it restarted). The other ranks
    wait in the step's collectives."""

    def __init__(self, step: int, until: str, rank: int = 0, timeout_s: float = 600):
        self.step, self.until, self.rank, self.timeout_s = step, Path(until), rank, timeout_s

    def pre_step(self, trainer: Trainer) -> None:
        if trainer.state.step + 1 != self.step or int(os.environ.get("RANK", "0")) != self.rank:
            return
        deadline = time.monotonic() + self.timeout_s
        while not self.until.exists() and time.monotonic() < deadline:
            time.sleep(0.1)


class SignalLauncherBefore(_Once):
    """Send `signal` (a name: SIGUSR1, SIGTERM) to torchrun, the ranks' launcher, just before step
    `step` runs, as a scheduler preempting the job would; torchrun passes it on to every rank."""

    def __init__(self, step: int, once: str, signal: str, rank: int = 0):
        super().__init__(step, once, rank)
        self.signal = signal

    def pre_step(self, trainer: Trainer) -> None:
        if self._due(trainer.state.step + 1):
            os.kill(os.getppid(), getattr(signal, self.signal))


class SlowSteps(Callback):
    """Every rank sleeps `seconds` before each step: a job that takes longer than its limit."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def pre_step(self, trainer: Trainer) -> None:
        time.sleep(self.seconds)
