"""The parallel layout: degrees, the named DeviceMesh, device, backend and precision."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from forgeline.configs.schema import ParallelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


class LayoutError(ValueError):
    """A parallel layout or precision that does not fit the world or the machine."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each mesh dimension, outermost to innermost ("pp", "dp_replicate",
    "dp_shard", "tp"): tp on consecutive ranks (the same node), pipeline stages furthest
    apart. "dp" is the flattened ("dp_replicate", "dp_shard"): the ranks that see different
    data."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    def __post_init__(self) -> None:
        product = self.pp * self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise LayoutError(
                f"pp*dp_replicate*dp_shard*tp = {self.pp}*{self.dp_replicate}*{self.dp_shard}*{self.tp}"
                f" = {product} but WORLD_SIZE = {self.world_size}; launch {product} ranks or change "
                "the parallel section"
            )

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        return cls(cfg.pp, cfg.dp_replicate, cfg.dp_shard, cfg.tp, world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The 4-D mesh, and its ("dp_replicate", "dp_shard") dims flattened into the 1-D "dp"
        mesh (kept here: torch deprecates slicing flattened dims back out of the root)."""
        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp),
                                mesh_dim_names=MESH_DIMS)
        return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """2-D (replicate, shard) for HSDP, else the 1-D shard mesh."""
        return mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else mesh["dp_shard"]


def device_and_backend() -> tuple[torch.device, str]:
    """CUDA with NCCL when a GPU is visible, else CPU with gloo."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))), "nccl"
    return torch.device("cpu"), "gloo"


def init_distributed() -> tuple[torch.device, int, int]:
    """Join the process group torchrun set up; returns (device, rank, world_size)."""
    device, backend = device_and_backend()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    return device, dist.get_rank(), dist.get_world_size()


def cpu_has_native_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_precision(requested: str, device_type: str) -> torch.dtype:
    """The compute dtype for train.precision on this machine; refuses bf16 where it would
    crawl (CPUs without native bf16 run bf16 matmuls 30-90x slower than fp32)."""
    if requested == "auto":
        cuda_bf16 = device_type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    if requested == "bf16" and device_type == "cpu" and not cpu_has_native_bf16():
        raise LayoutError("train.precision=bf16 on a CPU without native bf16 support (no AVX-512 "
                          "BF16/AMX): it would run 30-90x slower than fp32; use train.precision=fp32")
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[requested]
