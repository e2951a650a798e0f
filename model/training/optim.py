"""AdamW and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from forgeline.configs.schema import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Matrices and embeddings decay; norm gains (1-D) do not. The fused kernel updates every
    tensor in one pass over its parameter, gradient and moments; torch's default on the CPU is
    the per-tensor loop, a dozen passes (bench/cpt.py)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    # LoRA trains matrices only: an empty group would not load back from a checkpoint (DCP's
    # flattened optimizer state names each group by its first parameter).
    groups = [group for group in groups if group["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                             fused=fused_adamw_supported(params))


def fused_adamw_supported(params: list[nn.Parameter]) -> bool:
    """Whether torch has a fused AdamW for these parameters' device and dtypes."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return all(p.device.type in _get_fused_kernels_supported_devices() and p.is_floating_point()
               for p in params)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR multiplier for the update of `step` (1-based): linear warmup from 1/warmup to 1,
    then cosine decay to `min_ratio` at `total_steps`."""
    if step <= warmup_steps:
        return step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> LambdaLR:
    # LambdaLR evaluates the lambda at its internal epoch, which starts at 0 and is advanced
    # after each optimizer step; +1 makes epoch e the LR of update e + 1.
    return LambdaLR(
        optimizer,
        lambda epoch: warmup_cosine(epoch + 1, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio),
    )


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None,
                    duplicates: Collection[nn.Parameter] = ()) -> torch.Tensor:
    """Clip gradients in place to a global L2 norm of `max_norm` (0: only measure); returns
    the norm before clipping.

    Unlike torch.nn.utils.clip_grad_norm_, the norm covers the whole model: gradients may be
    a mix of plain tensors and DTensors on different meshes (tensor parallel without sequence
    parallel; FSDP x TP gives 1-D and 2-D meshes) -- the norm is taken per group and the groups
    combined -- and under pipeline parallelism each rank holds only its stages' gradients, so
    the squared norms are summed over the pipeline group. `duplicates` are copies of a parameter
    another stage holds (a tied embedding's): clipped, but not counted twice in the norm.
    """
    parameters = list(parameters)
    groups: dict[object, list[nn.Parameter]] = defaultdict(list)
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups[mesh].append(param)
    squares = [torch.zeros((), device=parameters[0].device)]  # a rank may hold only duplicates
    duplicate_ids = {id(p) for p in duplicates}
    for params in groups.values():
        counted = [p.grad for p in params if id(p) not in duplicate_ids]
        if not counted:
            continue
        norm = torch.nn.utils.get_total_norm(counted)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float().square())
    total_squared = torch.stack(squares).sum()
    if pp_group is not None:
        dist.all_reduce(total_squared, op=dist.ReduceOp.SUM, group=pp_group)
    total = total_squared.sqrt()
    if max_norm > 0:
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What clipping to `max_norm` multiplies every gradient by: torch's clip_grads_with_norm_'s
    factor (1 when the norm is within)."""
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
