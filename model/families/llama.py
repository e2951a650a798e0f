"""Llama (1, 2, 3.x; also SmolLM2): the plain decoder, with `llama3` or `linear` rope scaling."""

from __future__ import annotations

from forgeline.model.families.family import (
    Family,
    UnsupportedArchitecture,
    attention_weights,
    llama_norms,
    mlp_weights,
    read_rope,
    require,
)


def read_config(config) -> dict:
    if getattr(config, "attention_bias", False):
        raise UnsupportedArchitecture("llama with attention_bias=True is not supported (a bias on o_proj "
                                      "too); a Qwen2 base is model_type qwen2")
    require(config, "mlp_bias", False, "the feed-forward projections have no bias")
    require(config, "hidden_act", "silu", "the gated feed-forward block is SwiGLU")
    theta, scaling = read_rope(config)
    return {"rope_theta": theta, "rope_scaling": scaling}


def write_config(shape) -> dict:
    return {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


FAMILY = Family(
    model_type="llama",
    architecture="LlamaForCausalLM",
    read_config=read_config,
    write_config=write_config,
    layer_weights=lambda shape: llama_norms() | attention_weights(shape) | mlp_weights(),
)
