"""Qwen3: Llama with q and k RMS-normalized per head before the rotary embedding, and a head
width of its own (head_dim is not hidden_size / heads)."""

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
    require(config, "attention_bias", False, "the attention projections have no bias")
    theta, scaling = read_rope(config)
    window = read_sliding_window(config) if getattr(config, "use_sliding_window", False) else {}
    return {"rope_theta": theta, "rope_scaling": scaling, "qk_norm": True} | window


def write_config(shape) -> dict:
    if not shape.qk_norm or shape.qkv_bias:
        raise ValueError("a qwen3 model has q/k norms and no biases: set model.qk_norm, unset model.qkv_bias")
    window = {}
    if shape.sliding_window is not None:
        window = {"use_sliding_window": True, "sliding_window": shape.sliding_window,
                  "layer_types": layer_types(shape)}
    return {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False} | window


FAMILY = Family(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    read_config=read_config,
    write_config=write_config,
    layer_weights=lambda shape: llama_norms() | attention_weights(shape) | mlp_weights(),
)
