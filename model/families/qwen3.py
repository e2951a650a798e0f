"""Qwen3: Llama with q and k RMS-normalized per head before the rotary embedding, and a head
width of its own (head_dim is not hidden_size / heads)."""

from __future__ import annotations

from forgeline.model.families.family import (
    Family,
    llama_layer_weights,
    read_swiglu_rope,
    read_switched_window,
    require,
    write_switched_window,
)


def read_config(config) -> dict:
    require(config, "attention_bias", False, "the attention projections have no bias")
    return read_swiglu_rope(config) | {"qk_norm": True} | read_switched_window(config)


def write_config(shape) -> dict:
    if not shape.qk_norm or shape.qkv_bias:
        raise ValueError("a qwen3 model has q/k norms and no biases: set model.qk_norm, unset model.qkv_bias")
    return {"hidden_act": "silu", "attention_bias": False} | write_switched_window(shape)


FAMILY = Family(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    read_config=read_config,
    write_config=write_config,
    layer_weights=llama_layer_weights(),
)
