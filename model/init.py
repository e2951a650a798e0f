"""Layout-independent parameter initialization.

Each parameter is drawn at its full (global) shape from a generator seeded by the run seed and
the parameter's canonical name, then the rank keeps only its shard. The values therefore depend
on the seed and the name alone: the same for one process, FSDP, tensor parallel, any pipeline
split, and any order in which parameters are visited.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

InitFn = Callable[[torch.Tensor, torch.Generator], object]

# Segments that wrappers (activation checkpointing, torch.compile) insert into parameter names.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def param_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    # 32 bits: the CPU generator (mt19937) only uses the low 32 bits of its seed.
    return torch.Generator(device=device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))


@torch.no_grad()
def init_param_(param: torch.Tensor, init: InitFn, seed: int, name: str) -> None:
    """Fill `param` (a plain tensor or a DTensor shard) with its part of the full tensor that
    `init` draws from the generator of (seed, canonical name)."""
    name = canonical_name(name)
    if not isinstance(param, DTensor):
        init(param, param_generator(seed, name, param.device))
        return
    local = param.to_local()
    full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
    init(full, param_generator(seed, name, local.device))
    # Every rank drew the same full tensor, so each can slice its own shard: no communication.
    param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))
