"""Qwen2 and Qwen2.5: Llama with biases on the q, k and v projections, sliding windows in the
layers from `max_window_layers` on when `use_sliding_window` is set."""

from __future__ import annotations

from forgeline.model.families.family import (
    Family,
    attention_weights,
    layer_types,
    llama_norms,
    mlp_weights,
    read_rope,
    read_sliding_window,
    require,
)


def read_config(config) -> dict:
    require(config, "hidden_act", "silu", "the gated feed-forward block is SwiGLU")
    theta, scaling = read_rope(config)
    window = read_sliding_window(config) if getattr(config, "use_sliding_window", False) else {}
    return {"rope_theta": theta, "rope_scaling": scaling, "qkv_bias": True} | window


def write_config(shape) -> dict:
    if not shape.qkv_bias:
        raise ValueError("a qwen2 model has q/k/v biases: set model.qkv_bias")
    window = {}
    if shape.sliding_window is not None:
        window = {"use_sliding_window": True, "sliding_window": shape.sliding_window,
                  "layer_types": layer_types(shape)}
    return {"hidden_act": "silu", "use_sliding_window": False} | window


FAMILY = Family(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    read_config=read_config,
    write_config=write_config,
    layer_weights=lambda shape: llama_norms() | attention_weights(shape) | mlp_weights(),
)
