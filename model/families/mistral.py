"""Mistral: Llama with sliding-window attention in every layer."""

from __future__ import annotations

from forgeline.model.families.family import Family, llama_layer_weights, read_sliding_window, read_swiglu_rope

FAMILY = Family(
    model_type="mistral",
    architecture="MistralForCausalLM",
    read_config=lambda config: read_swiglu_rope(config) | read_sliding_window(config),
    write_config=lambda shape: {"hidden_act": "silu", "sliding_window": shape.sliding_window},
    layer_weights=llama_layer_weights(),
)
