"""Dynamic loss scaling for fp16 training.

torch.amp.GradScaler does not take DTensor gradients (FSDP2, tensor parallel); this scaler
unscales each rank's local gradient shards in place and agrees across all ranks on whether any
of them overflowed, so every rank skips the same steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor


class DynamicLossScaler(Stateful):
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale = init_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0

    def unscale_(self, params: list[torch.nn.Parameter], device: torch.device) -> bool:
        """Divide every local gradient by the scale; True when any rank saw inf or NaN."""
        found_inf = torch.zeros(1, device=device)
        for param in params:
            if param.grad is None:
                continue
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            grad.mul_(1.0 / self.scale)
            if not torch.isfinite(grad).all():
                found_inf.fill_(1.0)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return bool(found_inf.item())

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after `growth_interval` clean steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = state["scale"], state["good_steps"]
