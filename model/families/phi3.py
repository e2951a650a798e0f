"""Phi-3 (and Phi-3.5/4 of the same layout): Llama with q, k and v in one fused projection
(qkv_proj) and gate and up in another (gate_up_proj), concatenated by rows; sliding windows
in every layer where the config sets one."""

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
    return {"hidden_act": "silu", "sliding_window": shape.sliding_window,
            "original_max_position_embeddings": shape.max_seq_len}


FAMILY = Family(
    model_type="phi3",
    architecture="Phi3ForCausalLM",
    read_config=read_config,
    write_config=write_config,
    layer_weights=lambda shape: (llama_norms() | attention_weights(shape, fused_qkv=True)
                                 | mlp_weights(fused_gate_up=True)),
)
