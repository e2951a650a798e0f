"""Pipeline parallelism with torch.distributed.pipelining: split a (meta) Transformer into
stages and build the schedule that runs them.

Split rule: the n_layers blocks go in contiguous chunks to the pp * stages_per_rank stages in
order, chunk sizes differing by at most one with the earlier stages taking the extra blocks;
the first stage also holds the embeddings, the last the final norm and output projection.
Stages are placed on pipeline ranks in a loop (rank r holds r, r + pp, ...) or, for the V
schedules, in a V (rank r holds r and 2 * pp - 1 - r).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _PipelineSchedule,
    get_schedule_class,
)

from forgeline.configs.schema import V_SCHEDULES, ParallelConfig
from forgeline.model.transformer import Transformer


def layer_ranges(n_layers: int, num_stages: int) -> list[range]:
    base, extra = divmod(n_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_ids_of_rank(pp_rank: int, pp: int, stages_per_rank: int, v_style: bool) -> list[int]:
    if v_style:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def pipeline_split(model: Transformer, pp_rank: int, layout: ParallelConfig) -> list[tuple[int, Transformer]]:
    """This rank's stages as (stage index, stage module), each a copy of the meta model with
    the other stages' parts removed. Parameter names are kept, so checkpoints and
    initialization line up with the unsplit model."""
    ranges = layer_ranges(model.shape.n_layers, layout.num_stages)
    stages = []
    v_style = layout.pp_schedule in V_SCHEDULES
    for stage_id in stage_ids_of_rank(pp_rank, layout.pp, layout.pp_stages_per_rank, v_style):
        stage = copy.deepcopy(model)
        for key in list(stage.layers):
            if int(key) not in ranges[stage_id]:
                del stage.layers[key]
        if stage_id != 0:
            stage.tok_embeddings = None
        if stage_id != layout.num_stages - 1:
            stage.norm = None
            stage.output = None
        stages.append((stage_id, stage))
    return stages


def build_schedule(stages: list[tuple[int, Transformer]], layout: ParallelConfig, pp_mesh: DeviceMesh,
                   device: torch.device, loss_fn: Callable) -> _PipelineSchedule:
    """The configured schedule over this rank's (already parallelized and materialized)
    stages. `loss_fn` must already divide by the microbatch count: the schedule's own
    scale_grads would divide the whole accumulated gradient again on every step() of a
    gradient accumulation."""
    pipeline_stages = [
        PipelineStage(module, stage_id, layout.num_stages, device, group=pp_mesh.get_group())
        for stage_id, module in stages
    ]
    schedule_cls = get_schedule_class(layout.pp_schedule)
    if issubclass(schedule_cls, PipelineScheduleSingle):
        [only] = pipeline_stages
        return schedule_cls(only, n_microbatches=layout.pp_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_cls(pipeline_stages, n_microbatches=layout.pp_microbatches, loss_fn=loss_fn,
                        scale_grads=False)
