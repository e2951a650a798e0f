"""Parallelism applied to a Transformer (or one pipeline stage of it) from outside, one
function per technique, in this order -- each step assumes the previous ones:

    build on meta -> pipeline_split (pipelining.py) -> apply_tp -> apply_ac -> apply_compile
    -> apply_fsdp -> to_empty() + init_weights(seed)

TP comes first so activation checkpointing and compile see the tensor-parallel modules; FSDP2
comes last so it shards the tensor-parallel DTensors (2-D, ("dp_shard", "tp")).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from forgeline.configs.schema import ParallelConfig
from forgeline.model.lora import AdapterColwiseParallel, AdapterRowwiseParallel, freeze_base, has_adapters
from forgeline.model.parallel.mesh import fsdp_mesh
from forgeline.model.transformer import Transformer


def parallelize(model: Transformer, layout: ParallelConfig, mesh: DeviceMesh,
                param_dtype: torch.dtype) -> None:
    if layout.tp > 1:
        apply_tp(model, mesh["tp"], layout.sequence_parallel, layout.loss_parallel)
    if layout.activation_checkpoint != "none":
        apply_ac(model, layout.activation_checkpoint)
    if layout.compile:
        apply_compile(model)
    if layout.dp > 1:
        # Under pipeline parallelism every microbatch would re-gather the parameters if they
        # were resharded after each forward.
        apply_fsdp(model, fsdp_mesh(layout, mesh), param_dtype, reshard_after_forward=layout.pp == 1)


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Megatron-style tensor parallelism: q/k/v (with their biases) and w1/w3 split by output
    column, wo and w2 by input row -- one collective per sub-layer; every family's plan, since
    a family's variations are modules the plan finds or not (q/k norms, sandwich norms). With
    sequence parallelism the norms and the residual stream are sharded along the sequence
    (all-gather before attention/FFN, reduce-scatter after). With loss parallelism the logits
    stay sharded over the vocabulary."""
    residual = Shard(1) if sequence_parallel else Replicate()
    root_plan: dict[str, object] = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if model.norm is not None and sequence_parallel:
        root_plan["norm"] = SequenceParallel()
    if model.output is not None:
        root_plan["output"] = ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, root_plan)
    if model.shape.tie_embeddings:
        # Each was distributed on its own; both are sharded by vocabulary row (Shard(0)), so the
        # embedding's DTensor serves the output projection as it is.
        model.tie_embeddings()
    colwise, rowwise = ColwiseParallel, RowwiseParallel
    if has_adapters(model):  # LoRA: the adapters split along with their weights
        colwise, rowwise = AdapterColwiseParallel, AdapterRowwiseParallel
    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.wo": rowwise(output_layouts=residual),
            "feed_forward.w1": colwise(),
            "feed_forward.w3": colwise(),
            "feed_forward.w2": rowwise(output_layouts=residual),
        }
        if block.attention.q_norm is not None:
            # Per-head norms see a rank's heads only (dimension 2 of (B, T, H, D)): their gains
            # become replicated DTensors, so each rank's partial gradient is summed over tp.
            plan |= {"attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                     "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)}
        if sequence_parallel:
            plan |= {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                desired_input_layouts=(Replicate(), None)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),)),
            }
            if block.attention_out_norm is not None:  # sandwich norms: their outputs join the local residual
                plan |= {"attention_out_norm": SequenceParallel(use_local_output=True),
                         "ffn_out_norm": SequenceParallel(use_local_output=True)}
        parallelize_module(block, tp_mesh, plan)
    if has_adapters(model):  # SequenceParallel gives the norms new parameters, trainable
        freeze_base(model)


# Ops whose outputs selective activation checkpointing keeps: the expensive ones to recompute.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_expensive_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: Transformer, mode: str) -> None:
    """Wrap every block: `full` recomputes the whole block in backward, `selective` keeps the
    outputs of matmuls and attention and recomputes the cheap element-wise ops."""
    for key, block in list(model.layers.items()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            context = partial(create_selective_checkpoint_contexts, _keep_expensive_ops)
            wrapped = checkpoint_wrapper(block, context_fn=context, preserve_rng_state=False)
        model.layers[key] = wrapped


def apply_compile(model: Transformer) -> None:
    """Compile each block separately: blocks are identical, so one graph serves them all."""
    for key, block in list(model.layers.items()):
        model.layers[key] = torch.compile(block, fullgraph=True)


def apply_fsdp(model: nn.Module, fsdp_mesh: DeviceMesh, param_dtype: torch.dtype,
               reshard_after_forward: bool) -> None:
    """FSDP2 (or HSDP on a 2-D mesh): one unit per block plus the root. Parameters are
    gathered in `param_dtype` for compute, gradients reduced in fp32, and the sharded fp32
    parameters -- and so the optimizer state -- stay fp32."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # A block's forward takes the residual stream, already in param_dtype (the root casts its
    # own inputs, the embedding computes in param_dtype), and the fp32 rotary table, which FSDP
    # must not cast: bf16 cannot be viewed as complex (apply_rope), fp16 would round cos and sin.
    block_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                        cast_forward_inputs=False)
    for block in model.layers.values():
        fully_shard(block, mesh=fsdp_mesh, mp_policy=block_policy,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
