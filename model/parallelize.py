"""Parallelism applied to a Transformer from outside, one function per technique.

Order (each step assumes the previous): build on meta -> apply_tp -> apply_fsdp ->
`to_empty()` + `init_weights()`. FSDP2 goes last so it shards the tensor-parallel DTensors.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from forgeline.model.llama import Transformer
from forgeline.model.parallel import ParallelDims


def parallelize(model: Transformer, dims: ParallelDims, mesh: DeviceMesh) -> None:
    if dims.tp_enabled:
        apply_tp(model, mesh["tp"])
    if dims.dp_enabled:
        apply_fsdp(model, mesh["dp"])


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism: q/k/v and w1/w3 split by output column, wo and w2
    by input row, so each block needs one all-reduce per sub-layer. Embeddings and the output
    projection stay replicated."""
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            },
        )


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh) -> None:
    """FSDP2: one unit per block plus the root, gradients reduced in fp32."""
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
