"""Tied input and output embeddings (`ModelConfig.tie_embeddings`) under pipeline parallelism.

Without pipeline parallelism the output projection *is* the embedding's parameter (one tensor,
one gradient; tensor parallelism and FSDP keep it shared). A pipeline puts the two ends on
different stages, usually different ranks, so each end holds its own copy: both start equal
(the same initialization, or the same base weights), and after every backward each copy's
gradient is replaced by the sum of both (Megatron's "embedding group"). Equal gradients and
equal optimizer states keep the copies equal, bit for bit; the gradient norm counts the matrix
once (the output copy is clipped but not counted), as for the single tensor of an unsplit model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from forgeline.configs.schema import MESH_DIMS, V_SCHEDULES, ParallelConfig


class TiedEmbeddingCopies:
    """This rank's copies of the tied matrix (none, one, or both ends) and the group of the two
    ranks that hold the ends of its pipeline."""

    def __init__(self, parts: list[tuple[int, nn.Module]], layout: ParallelConfig, mesh: DeviceMesh):
        last = layout.num_stages - 1
        self.embedding = [m.tok_embeddings.weight for sid, m in parts if sid == 0]
        self.output = [m.output.weight for sid, m in parts if sid == last]
        self.group = _end_pair_group(layout, mesh)

    @property
    def duplicates(self) -> list[nn.Parameter]:
        """The copies the gradient norm leaves out: the output projection's."""
        return self.output

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Give each copy the sum of both copies' gradients (collective over the pair)."""
        grads = [p.grad for p in self.embedding + self.output if p.grad is not None]
        if not grads:
            return
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        total = torch.stack(local).sum(0) if len(local) > 1 else local[0].clone()
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for grad in local:
            grad.copy_(total)


def _end_pair_group(layout: ParallelConfig, mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group of this rank's pipeline's first and last stage ranks, or None where one rank
    holds both ends (V schedules: rank 0 holds stages 0 and 2 * pp - 1). Every rank creates
    every pair's group, as torch.distributed requires, and keeps its own."""
    if layout.pp_schedule in V_SCHEDULES:
        return None
    if layout.pp == 2:
        return mesh["pp"].get_group()
    ranks = mesh.mesh.movedim(MESH_DIMS.index("pp"), -1).reshape(-1, layout.pp)
    mine = None
    for pipeline in ranks.tolist():
        group = dist.new_group([pipeline[0], pipeline[-1]])
        if dist.get_rank() in (pipeline[0], pipeline[-1]):
            mine = group
    return mine
