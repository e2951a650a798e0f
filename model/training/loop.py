"""The training loop: the Trainer decides *when* things happen, TrainStep (step.py) *what* a
step does; side concerns -- metrics, checkpoints, stability, the hang watchdog, user code --
hang off the loop as callbacks (callbacks.py)."""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from forgeline.model.training.amp import DynamicLossScaler
from forgeline.model.training.loader import ShardedSampleLoader
from forgeline.model.training.step import StepResult, TrainStep


@dataclass(frozen=True)
class ValResult:
    """One validation (callbacks.ValidationCallback)."""

    step: int
    loss: float  # mean nats per target token
    bpb: float  # bits per UTF-8 byte of the text


class TrainerState(Stateful):
    """Everything besides model, optimizer and RNGs that a resume must restore -- also the last
    and the best validation, so that a resumed run keeps the best from before."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LRScheduler],
                 loader: ShardedSampleLoader, scaler: DynamicLossScaler | None):
        self.step = 0
        self.tokens_seen = 0
        self.schedulers = schedulers
        self.loader = loader
        self.scaler = scaler
        self.val_last: ValResult | None = None
        self.val_best: ValResult | None = None

    def state_dict(self) -> dict[str, Any]:
        # Validations as [step, loss, bpb] or []: lists of scalars are single DCP entries.
        val = {"last": list(astuple(self.val_last)) if self.val_last else [],
               "best": list(astuple(self.val_best)) if self.val_best else []}
        state = {"step": self.step, "tokens_seen": self.tokens_seen,
                 "scheduler": self.schedulers[0].state_dict(), "loader": self.loader.state_dict(), "val": val}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        last, best = state["val"]["last"], state["val"]["best"]
        self.val_last = ValResult(*last) if last else None
        self.val_best = ValResult(*best) if best else None


class Callback:
    """A side concern of the loop; every hook is a no-op unless overridden. Hooks run on every
    rank in the same order, so a hook may issue collectives."""

    def on_train_start(self, trainer: Trainer) -> None:
        pass

    def pre_step(self, trainer: Trainer) -> None:
        pass

    def post_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        pass

    def on_train_end(self, trainer: Trainer) -> None:
        pass


@dataclass
class Trainer:
    total_steps: int
    state: TrainerState
    train_step: TrainStep
    device: torch.device
    tokens_per_step: int
    callbacks: list[Callback] = field(default_factory=list)
    last_result: StepResult | None = None
    # Why the loop ends before total_steps (a callback sets it: a preemption); None: it does not.
    stopped_early: str | None = None

    @property
    def loader(self) -> ShardedSampleLoader:
        return self.state.loader

    def fit(self) -> None:
        for callback in self.callbacks:
            callback.on_train_start(self)
        while self.state.step < self.total_steps and self.stopped_early is None:
            for callback in self.callbacks:
                callback.pre_step(self)
            started = time.perf_counter()
            batch = self.loader.next_batch().to(self.device)
            data_wait = time.perf_counter() - started
            lr = self.state.schedulers[0].get_last_lr()[0]
            self.last_result = result = self.train_step(batch)
            step_time = time.perf_counter() - started
            self.state.step += 1
            self.state.tokens_seen += self.tokens_per_step
            metrics = {"loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                       "tokens_per_s": self.tokens_per_step / step_time, "step_time_s": step_time,
                       "data_wait_s": data_wait, "skipped": float(result.skipped), **result.metrics}
            if self.train_step.scaler is not None:
                metrics["loss_scale"] = self.train_step.scaler.scale
            for callback in self.callbacks:
                callback.post_step(self, metrics)
        for callback in self.callbacks:
            callback.on_train_end(self)
