"""Llama (1, 2, 3.x; also SmolLM2): the plain decoder, with `llama3` or `linear` rope scaling."""

from __future__ import annotations

from forgeline.model.families.family import (
    Family,
    UnsupportedArchitecture,
    llama_layer_weights,
    read_swiglu_rope,
    require,
)


def read_config(config) -> dict:
    if getattr(config, "attention_bias", False):
        raise UnsupportedArchitecture("llama with attention_bias=True is not supported (a bias on o_proj "
                                      "too); a Qwen2 base is model_type qwen2")
    require(config, "mlp_bias", False, "the feed-forward projections have no bias")
    return read_swiglu_rope(config)


def write_config(shape) -> dict:
    return {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


FAMILY = Family(
    model_type="llama",
    architecture="LlamaForCausalLM",
    read_config=read_config,
    write_config=write_config,
    layer_weights=llama_layer_weights(),
)
