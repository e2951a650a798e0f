"""Qwen2 and Qwen2.5: Llama with biases on the q, k and v projections, sliding windows in the
layers from `max_window_layers` on when `use_sliding_window` is set."""

from __future__ import annotations

from forgeline.model.families.family import (
    Family,
    llama_layer_weights,
    read_swiglu_rope,
    read_switched_window,
    write_switched_window,
)


def read_config(config) -> dict:
    return read_swiglu_rope(config) | {"qkv_bias": True} | read_switched_window(config)


def write_config(shape) -> dict:
    if not shape.qkv_bias:
        raise ValueError("a qwen2 model has q/k/v biases: set model.qkv_bias")
    return {"hidden_act": "silu"} | write_switched_window(shape)


FAMILY = Family(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    read_config=read_config,
    write_config=write_config,
    layer_weights=llama_layer_weights(),
)
