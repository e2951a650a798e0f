"""The parallel layout: degrees, their validation, the named DeviceMesh, device and backend."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class LayoutError(ValueError):
    """A parallel layout that does not fit the world or the model."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel dimension. Mesh dims run outermost to innermost:
    ("dp", "tp") -- tp innermost, so a tensor-parallel group is consecutive ranks (one node)."""

    dp: int
    tp: int
    world_size: int

    def __post_init__(self) -> None:
        if self.dp * self.tp != self.world_size:
            raise LayoutError(
                f"dp*tp = {self.dp}*{self.tp} = {self.dp * self.tp} but WORLD_SIZE = "
                f"{self.world_size}; set parallel.dp and parallel.tp so their product is the "
                "number of ranks"
            )

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))


def device_and_backend() -> tuple[torch.device, str]:
    """CUDA with NCCL when a GPU is visible, else CPU with gloo."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def init_distributed() -> tuple[torch.device, int, int]:
    """Join the process group torchrun set up; returns (device, rank, world_size)."""
    device, backend = device_and_backend()
    dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    return device, dist.get_rank(), dist.get_world_size()
