"""The running job's side of the parallel layout: the named DeviceMesh, device, backend and
precision. The layout itself -- degrees, and every rule they must satisfy -- is
`ParallelConfig` (configs/schema.py); here it meets the launched world."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from forgeline.configs.schema import MESH_DIMS, LayoutError, ParallelConfig


def build_meshes(layout: ParallelConfig, world_size: int, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The 4-D mesh along MESH_DIMS -- tp on consecutive ranks (the same node), pipeline stages
    furthest apart -- and its ("dp_replicate", "dp_shard") dims flattened into the 1-D "dp" mesh
    of the ranks that see different data (kept here: torch deprecates slicing flattened dims back
    out of the root)."""
    layout.check_world_size(world_size)
    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIMS)
    return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")


def fsdp_mesh(layout: ParallelConfig, mesh: DeviceMesh) -> DeviceMesh:
    """2-D (replicate, shard) for HSDP, else the 1-D shard mesh."""
    return mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]


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


# A precision of evaluation and sampling: bf16 where the device runs it natively (a GPU that
# supports it, a CPU with AVX-512 BF16/AMX), else fp32 -- a shipped config that wants bf16 runs on
# any machine instead of being refused where bf16 would crawl.
BF16_WHERE_NATIVE = "bf16_where_native"


def native_bf16(device_type: str) -> bool:
    return torch.cuda.is_bf16_supported() if device_type == "cuda" else cpu_has_native_bf16()


def resolve_precision(requested: str, device_type: str, setting: str = "train.precision") -> torch.dtype:
    """The compute dtype for a precision setting (`setting`: train.precision, eval.precision) on
    this machine; refuses bf16 where it would crawl (CPUs without native bf16 run bf16 matmuls
    30-90x slower than fp32)."""
    if requested == "auto":
        return torch.bfloat16 if device_type == "cuda" and native_bf16(device_type) else torch.float32
    if requested == BF16_WHERE_NATIVE:
        return torch.bfloat16 if native_bf16(device_type) else torch.float32
    if requested == "bf16" and device_type == "cpu" and not cpu_has_native_bf16():
        raise LayoutError(f"{setting}=bf16 on a CPU without native bf16 support (no AVX-512 "
                          f"BF16/AMX): it would run 30-90x slower than fp32; use {setting}=fp32")
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[requested]


def local_device_type() -> str:
    """The device type the ranks of a job launched from this machine train on."""
    return "cuda" if torch.cuda.is_available() else "cpu"
