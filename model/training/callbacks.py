"""The loop's side concerns as callbacks, in the order worker.py installs them: the hang
watchdog, validation, metrics, stability (skip / roll back), checkpoints, then user callbacks."""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from forgeline.configs.schema import CallbackSpec, InTrainingEvalConfig, TrainConfig
from forgeline.model.checkpoint.manager import MANIFEST_NAME, CheckpointManager, step_dir_name
from forgeline.model.training.alerts import AlertKind, emit_alert
from forgeline.model.training.loader import (
    DocumentBatch,
    ShardedSampleLoader,
    num_validation_batches,
    token_byte_lengths,
    validation_batches,
)
from forgeline.model.training.loop import Callback, Trainer, ValResult
from forgeline.model.training.metrics import MetricsLogger, bits_per_byte
from forgeline.model.training.shards import split_shards

log = logging.getLogger(__name__)

STACKS_DIR_ENV = "FORGELINE_STACKS_DIR"  # where the hang watchdogs of a launch write their stacks


class TrainingUnstable(RuntimeError):
    """Instability that rollbacks could not cure; the message is the report of its events."""


@dataclass
class MetricsCallback(Callback):
    logger: MetricsLogger

    def post_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.logger.log_step(trainer.state.step, metrics)

    def on_train_end(self, trainer: Trainer) -> None:
        self.logger.close()


def target_ids(batch: torch.Tensor | DocumentBatch) -> torch.Tensor:
    """The (B, T) target token ids of a validation batch."""
    return (batch.tokens if isinstance(batch, DocumentBatch) else batch)[:, 1:]


def target_mask(batch: torch.Tensor | DocumentBatch) -> torch.Tensor:
    """Which targets the loss counts: the masked ones of a batch with a loss mask, else all."""
    if isinstance(batch, DocumentBatch) and batch.loss_mask is not None:
        return batch.loss_mask[:, 1:]
    return torch.ones_like(target_ids(batch), dtype=torch.bool)


@dataclass
class ValidationCallback(Callback):
    """Every `every` steps and at the last step, all ranks compute the loss of the same fixed
    validation batches (TrainStep.validation_loss: forward only, no gradients) and add
    `val/loss` and `val/bpb` to the step's metrics -- installed before MetricsCallback, so they
    reach MLflow and the progress line with the step's other metrics. The trainer's state keeps
    the last and the best validation (checkpointed with it). The RNG states are restored after
    it and neither the loader nor the optimizer is touched: training is bit-identical with
    validation on or off."""

    every: int
    batches: list[torch.Tensor]  # this rank's slices of the validation batches
    tokens: int  # target tokens of the whole validation set, all ranks
    text_bytes: int  # UTF-8 bytes of the text those tokens encode

    @classmethod
    def from_data(cls, cfg: TrainConfig, data_dir: Path, manifest: dict, loader: ShardedSampleLoader,
                  dp_group: dist.ProcessGroup, device: torch.device,
                  reference: np.ndarray | None = None) -> ValidationCallback:
        """The validation set of the data stage's output, its batches cut as the training
        `loader` cuts its own (preference pairs with their `reference` log-probabilities).
        Collective: the byte count is summed over the data-parallel ranks."""
        num_batches = num_validation_batches(manifest, loader.global_batch_size, cfg.val_batches)
        batches = validation_batches(split_shards(data_dir, manifest, "val"), num_batches, loader, reference)
        lengths = torch.from_numpy(token_byte_lengths(data_dir / manifest["tokenizer"]["dir"]))
        # Of masked targets (fine-tuning: the answers), only they count: the loss is theirs.
        masks = [target_mask(batch) for batch in batches]
        mine = sum(lengths[target_ids(batch)][mask].sum() for batch, mask in zip(batches, masks, strict=True))
        counted = sum(int(mask.sum()) for mask in masks)
        totals = torch.stack([torch.as_tensor(mine), torch.as_tensor(counted)]).to(device)
        dist.all_reduce(totals, group=dp_group)
        text_bytes, tokens = totals[0], int(totals[1].item())
        log.info("validation every %d steps: %d global batches%s, %d tokens, %d bytes of text",
                 cfg.val_every, num_batches,
                 f" (all the validation split holds of train.val_batches={cfg.val_batches})"
                 if num_batches < cfg.val_batches else "", tokens, text_bytes.item())
        return cls(cfg.val_every, batches, tokens, int(text_bytes.item()))

    def post_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        state = trainer.state
        if state.step % self.every and state.step != trainer.total_steps:
            return
        started = time.perf_counter()
        cuda = [trainer.device] if trainer.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, device_type=trainer.device.type):
            loss = trainer.train_step.validation_loss(self.batches)
            objective = trainer.train_step.objective_metrics()  # preference tuning's rewards
        # Bits per byte of the text are the next-token loss's; a preference loss is not one.
        bpb = bits_per_byte(loss, self.tokens, self.text_bytes) if not objective else math.nan
        state.val_last = ValResult(state.step, loss, bpb)
        if state.val_best is None or loss < state.val_best.loss:
            state.val_best = state.val_last
        metrics.update({"val/loss": loss, **({f"val/{name}": value for name, value in objective.items()}
                                             if objective else {"val/bpb": bpb})})
        log.info("validation at step %d in %.2f s: val/loss %.4f, %s; best %.4f at step %d", state.step,
                 time.perf_counter() - started, loss,
                 f"val/rewards/accuracies {objective['rewards/accuracies']:.4f}" if objective
                 else f"val/bpb {bpb:.4f}", state.val_best.loss, state.val_best.step)


@dataclass
class CheckpointCallback(Callback):
    """Saves every `every_steps` and at the last step; commits finished async saves as soon as
    they are written."""

    manager: CheckpointManager
    state: dict[str, Stateful]
    every_steps: int
    meta: dict[str, Any]
    last_saved: int = -1

    def on_train_start(self, trainer: Trainer) -> None:
        self.last_saved = trainer.state.step  # a resumed step is already on disk

    def post_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.manager.poll()
        step = trainer.state.step
        if step % self.every_steps == 0 or step == trainer.total_steps:
            self.save(trainer, metrics)

    def save(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Start the save of the current step unless it is on disk already (a resumed step, a
        step saved before, or one a rollback returned to: checkpoints are never rewritten)."""
        step = trainer.state.step
        if step <= self.last_saved:
            return
        val = {f"val_{which}": asdict(result) for which, result in
               (("last", trainer.state.val_last), ("best", trainer.state.val_best)) if result}
        self.manager.save(step, self.state, self.meta | val | {"loss": metrics["loss"],
                                                               "tokens_seen": trainer.state.tokens_seen})
        self.last_saved = step

    def on_train_end(self, trainer: Trainer) -> None:
        self.manager.close()


@dataclass
class StabilityCallback(Callback):
    """Non-finite steps are skipped by the step itself; here, repeated ones or a loss spike
    (z-score against a moving window) roll back to the last committed checkpoint and skip the
    data consumed since. Too many rollbacks stop the run with a report (also written to
    `report_path`, so an automatic restart of the same configuration fails fast). Decisions use
    global values (the loss and gradient norm are reduced over all ranks), so every rank takes
    the same one."""

    cfg: TrainConfig
    manager: CheckpointManager
    state: dict[str, Stateful]
    metrics: MetricsLogger
    report_path: Path
    fingerprint: str
    rank: int
    events: list[str] = field(default_factory=list)
    rollbacks: int = 0
    nonfinite_in_a_row: int = 0

    def __post_init__(self) -> None:
        self.losses: deque[float] = deque(maxlen=self.cfg.spike_window)

    def post_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        step, result = trainer.state.step, trainer.last_result
        if result.nonfinite:
            self.nonfinite_in_a_row += 1
            self._event(step, "nonfinite", "non-finite loss or gradient: update skipped "
                                           f"({self.nonfinite_in_a_row} in a row)")
            if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
                self._roll_back(trainer, f"{self.nonfinite_in_a_row} consecutive non-finite steps")
            return
        self.nonfinite_in_a_row = 0
        if result.skipped:  # an fp16 overflow: the loss scaler deals with it
            return
        spike = self._spike(result.loss)
        if spike:
            self._roll_back(trainer, spike)
        else:
            self.losses.append(result.loss)

    def _spike(self, loss: float) -> str | None:
        if not self.cfg.spike_zscore or len(self.losses) < min(10, self.cfg.spike_window):
            return None
        mean, std = statistics.fmean(self.losses), statistics.pstdev(self.losses)
        zscore = (loss - mean) / max(std, 1e-8)
        if zscore > self.cfg.spike_zscore:
            return (f"loss spike: {loss:.4f} is {zscore:.1f} standard deviations above the mean "
                    f"{mean:.4f} of the last {len(self.losses)} steps")
        return None

    def _roll_back(self, trainer: Trainer, reason: str) -> None:
        step = trainer.state.step
        self.rollbacks += 1
        if self.rollbacks > self.cfg.max_rollbacks:
            self._give_up(step, f"{reason}; rollback limit train.max_rollbacks={self.cfg.max_rollbacks} "
                                "reached")
        bad_window_end = trainer.loader.state_dict()
        self.manager.wait()
        info = self.manager.load_latest(self.state)
        if info is None:
            self._give_up(step, f"{reason} before the first checkpoint: nothing to roll back to")
        trainer.loader.load_state_dict(bad_window_end)  # skip the data of the bad window
        skipped = trainer.loader.global_batch_size * (step - info.step)
        self._event(step, "rollback", f"rolled back to step {info.step} after {reason}; skipping the "
                                      f"{skipped} samples read since (rollback {self.rollbacks} of at most "
                                      f"{self.cfg.max_rollbacks})")
        self.losses.clear()
        self.nonfinite_in_a_row = 0

    def _event(self, step: int, kind: AlertKind, message: str) -> None:
        self.events.append(f"step {step}: {message}")
        self.metrics.log_event(step, message, {"rollbacks": self.rollbacks})
        if self.rank == 0:  # the decision is global: one alert, not one per rank
            emit_alert(kind, message, step)

    def _give_up(self, step: int, reason: str) -> None:
        self.events.append(f"step {step}: {reason}")
        report = "training is unstable:\n  " + "\n  ".join(self.events)
        if self.rank == 0:
            self.report_path.write_text(json.dumps({"fingerprint": self.fingerprint, "events": self.events},
                                                   indent=2) + "\n")
            emit_alert("unstable", f"training gave up: {reason}", step)
        raise TrainingUnstable(report)


@dataclass
class WatchdogCallback(Callback):
    """If a step does not finish within `timeout_s` -- a rank stuck in I/O, a collective that
    never completes -- dump every thread's stack and exit, so torchrun restarts the group (and
    the job resumes from its latest checkpoint). Each rank has its own watchdog: the stuck one
    and the ones waiting for it all dump their stacks, each to its own `stacks_file` (written
    byte by byte by faulthandler, the dumps of several ranks would interleave on one stream);
    the launcher logs them. None: to stderr."""

    timeout_s: int
    stacks_file: Path | None = None
    _stream: Any = None

    def on_train_start(self, trainer: Trainer) -> None:
        self._stream = open(self.stacks_file, "w") if self.stacks_file else sys.stderr
        faulthandler.dump_traceback_later(self.timeout_s, exit=True, file=self._stream)

    def post_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        faulthandler.dump_traceback_later(self.timeout_s, exit=True, file=self._stream)  # re-arm

    def on_train_end(self, trainer: Trainer) -> None:
        faulthandler.cancel_dump_traceback_later()
        if self.stacks_file:
            self._stream.close()
            self.stacks_file.unlink(missing_ok=True)


@dataclass
class InTrainingEvalCallback(Callback):
    """Every `every_steps`, once that step's checkpoint is committed, global rank 0 starts
    `python -m forgeline.eval.periodic` on it in the background, asking each task as the eval
    stage does; it logs `eval/<task>/<metric>` and its standard error
    `eval/stderr/<task>/<metric>` into the training run at that step. One
    evaluation runs at a time (later steps queue); the end of training waits for them."""

    cfg: InTrainingEvalConfig
    checkpoint_root: Path
    data_dir: Path
    run_id: str
    batch_size: int
    dimension_shots: dict[str, int]
    """The eval stage's few-shot count of each dimension that has one (eval.dimensions)."""
    dimension_chat: dict[str, bool]
    """The `chat` setting of each dimension that sets one (eval.dimensions)."""
    precision: str
    """The eval stage's (eval.precision), so that its scores on a checkpoint are the eval stage's."""
    _queue: list[int] = field(default_factory=list)
    _running: subprocess.Popen | None = None

    def post_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if trainer.state.step % self.cfg.every_steps == 0 and trainer.state.step not in self._queue:
            self._queue.append(trainer.state.step)
        self._start_next()

    def on_train_end(self, trainer: Trainer) -> None:
        if trainer.stopped_early:  # the grace period is for the checkpoint: the evaluations are dropped
            self._queue.clear()
            if self._running is not None:
                with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
                    os.killpg(self._running.pid, signal.SIGKILL)  # its session is its own
        while self._queue or self._running is not None:
            if self._running is not None:
                self._running.wait()
            self._start_next()

    def _start_next(self) -> None:
        if self._running is not None:
            if self._running.poll() is None:
                return
            if self._running.returncode:
                log.warning("in-training evaluation exited with code %d", self._running.returncode)
            self._running = None
        committed = [s for s in self._queue
                     if (self.checkpoint_root / step_dir_name(s) / MANIFEST_NAME).exists()]
        if not committed:
            return
        step = committed[0]
        self._queue.remove(step)
        cmd = [sys.executable, "-m", "forgeline.eval.periodic",
               "--checkpoint", str(self.checkpoint_root / step_dir_name(step)),
               "--data-dir", str(self.data_dir),
               "--tasks", *self.cfg.tasks, "--run-id", self.run_id, "--step", str(step),
               "--batch-size", str(self.batch_size), "--precision", self.precision,
               "--dimension-shots", *(f"{name}={shots}" for name, shots in self.dimension_shots.items()),
               "--dimension-chat", *(f"{name}={'true' if chat else 'false'}"
                                     for name, chat in self.dimension_chat.items())]
        if self.cfg.limit is not None:
            cmd += ["--limit", str(self.cfg.limit)]
        # One thread: the ranks keep the cores; the evaluation is not in a hurry. A session of its
        # own: a signal to the job's process group (a terminal's Ctrl-C, a preemption) is for the
        # ranks, which must not wait on an evaluation to save; it dies with rank 0 (eval/periodic.py).
        self._running = subprocess.Popen(cmd, env=os.environ | {"OMP_NUM_THREADS": "1"},
                                         start_new_session=True)


def load_callback(spec: CallbackSpec) -> Callback:
    module_name, _, class_name = spec.path.partition(":")
    callback_class = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(callback_class, type) and issubclass(callback_class, Callback)):
        raise TypeError(f"train.callbacks: {spec.path} is not a forgeline.model.training.loop.Callback")
    return callback_class(**spec.args)


def unstable_report(path: Path, fingerprint: str) -> str | None:
    """The report at `path` of a run of this configuration that gave up on instability, if any."""
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    if report["fingerprint"] != fingerprint:
        return None
    return ("training is unstable:\n  " + "\n  ".join(report["events"])
            + f"\n(change the configuration, or delete {path} to try the same one again)")
