"""Phi-3 (and Phi-3.5/4 of the same layout): Llama with q, k and v in one fused projection
(qkv_proj) and gate and up in another (gate_up_proj), concatenated by rows; sliding windows
in every layer where the config sets one."""

from __future__ import annotations

from forgeline.model.families.family import Family, llama_layer_weights, read_sliding_window, read_swiglu_rope


def write_config(shape) -> dict:
    return {"hidden_act": "silu", "sliding_window": shape.sliding_window,
            "original_max_position_embeddings": shape.max_seq_len}


FAMILY = Family(
    model_type="phi3",
    architecture="Phi3ForCausalLM",
    read_config=lambda config: read_swiglu_rope(config) | read_sliding_window(config),
    write_config=write_config,
    layer_weights=llama_layer_weights(fused=True),
)
