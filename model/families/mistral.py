"""Mistral: Llama with sliding-window attention in every layer."""

from __future__ import annotations

from forgeline.model.families.family import (
    Family,
    attention_weights,
    llama_norms,
    mlp_weights,
    read_rope,
    read_sliding_window,
    require,
)


def read_config(config) -> dict:
    require(config, "hidden_act", "silu", "the gated feed-forward block is SwiGLU")
    theta, scaling = read_rope(config)
    return {"rope_theta": theta, "rope_scaling": scaling} | read_sliding_window(config)


def write_config(shape) -> dict:
    return {"hidden_act": "silu", "sliding_window": shape.sliding_window}


FAMILY = Family(
    model_type="mistral",
    architecture="MistralForCausalLM",
    read_config=read_config,
    write_config=write_config,
    layer_weights=lambda shape: llama_norms() | attention_weights(shape) | mlp_weights(),
)
