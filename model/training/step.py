"""What one optimizer step computes, apart from the loop around it: forward and backward over
`grad_accum_steps` micro-steps -- through the pipeline schedule when pp > 1 -- then (fp16)
unscaling, clipping by the global gradient norm over every rank, and the optimizer and LR
steps. An update whose gradient is not finite is skipped (the LR schedule still advances, so
step and learning rate stay in lockstep)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from forgeline.model.training.amp import DynamicLossScaler
from forgeline.model.training.optim import clip_grad_norm_


@dataclass
class StepResult:
    loss: float  # mean cross-entropy over the global batch
    grad_norm: float
    skipped: bool  # no update was applied (fp16 overflow, or non-finite)
    nonfinite: bool  # the loss or the gradient was inf/NaN -- not an fp16 overflow


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of (B, T, V) logits; vocabulary-sharded DTensor logits work
    inside a loss_parallel() context."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def scaled_loss(logits: torch.Tensor, targets: torch.Tensor, parts_per_step: int,
                scaler: DynamicLossScaler | None) -> torch.Tensor:
    """The loss whose backward adds this chunk's share to the step's gradients: the chunk's
    mean divided by the number of chunks in the step (gradients sum over them), times the
    fp16 loss scale. A chunk is a micro-step, or a pipeline microbatch of one (then
    parts_per_step = grad_accum_steps * pp_microbatches; this is the schedule's loss_fn)."""
    loss = cross_entropy(logits, targets) / parts_per_step
    return loss * scaler.scale if scaler is not None else loss


@dataclass
class TrainStep:
    """One optimizer step over this rank's model parts (one, or this rank's pipeline stages)."""

    parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler]
    grad_accum_steps: int
    grad_clip: float
    device: torch.device
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup | None = None  # set when pipeline parallel
    schedule: _PipelineSchedule | None = None
    is_first_stage: bool = True
    is_last_stage: bool = True
    loss_parallel: bool = False
    autocast_dtype: torch.dtype | None = None  # low precision without FSDP's MixedPrecisionPolicy
    scaler: DynamicLossScaler | None = None  # fp16

    def __call__(self, batch: torch.Tensor) -> StepResult:
        """`batch`: this rank's (B, T + 1) token ids for the whole step."""
        params = [p for part in self.parts for p in part.parameters()]
        loss_sum = torch.zeros((), device=self.device)
        for index, micro in enumerate(batch.chunk(self.grad_accum_steps)):
            self._set_gradient_sync(index == self.grad_accum_steps - 1)
            loss_sum += self._forward_backward(micro)
        overflow = self.scaler is not None and self.scaler.unscale_(params, self.device)
        # The norm is global (reduced over every rank), so every rank takes the same decision.
        grad_norm = clip_grad_norm_(params, self.grad_clip, self.pp_group).item()
        apply = math.isfinite(grad_norm) and not overflow
        if apply:
            for optimizer in self.optimizers:
                optimizer.step()
        if self.scaler is not None:
            self.scaler.update(overflow)
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        for scheduler in self.schedulers:
            scheduler.step()
        loss = self._global_mean(loss_sum / self.grad_accum_steps)
        nonfinite = not overflow and not (math.isfinite(grad_norm) and math.isfinite(loss))
        return StepResult(loss, grad_norm, skipped=not apply, nonfinite=nonfinite)

    def _forward_backward(self, micro: torch.Tensor) -> torch.Tensor:
        """The micro-step's mean loss (unscaled), after its backward."""
        inputs, targets = micro[:, :-1], micro[:, 1:]
        with self._compute_context():
            if self.schedule is not None:
                scaled = self._pipelined(inputs, targets)
            else:
                scaled = scaled_loss(self.parts[0](inputs), targets, self.grad_accum_steps, self.scaler)
                scaled.backward()
        if isinstance(scaled, DTensor):  # replicated loss of loss_parallel
            scaled = scaled.full_tensor()
        unscale = self.scaler.scale if self.scaler is not None else 1.0
        return scaled.detach() * self.grad_accum_steps / unscale

    def _pipelined(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule runs forward and backward of all microbatches; only the last stage
        sees their losses (scaled_loss of each, so their sum is the micro-step's scaled
        loss), other stages return 0."""
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets, "losses": losses} if self.is_last_stage else {}
        args = (inputs,) if self.is_first_stage else ()
        self.schedule.step(*args, **kwargs)
        return torch.stack(losses).sum() if self.is_last_stage else torch.zeros((), device=self.device)

    def _compute_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if self.loss_parallel:
            stack.enter_context(loss_parallel())
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype))
        return stack

    def _set_gradient_sync(self, last_micro_step: bool) -> None:
        """FSDP reduces gradients only on the last micro-step of an accumulation (pipeline
        stages manage this themselves per microbatch)."""
        if self.schedule is None:
            for part in self.parts:
                if isinstance(part, FSDPModule):
                    part.set_requires_gradient_sync(last_micro_step)

    def _global_mean(self, loss: torch.Tensor) -> float:
        """Average over data-parallel ranks; with pipeline parallelism only the last stage holds
        the loss, so it is summed over the pipeline (the other stages add 0)."""
        if self.pp_group is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.pp_group)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dp_group)
        return loss.item()
