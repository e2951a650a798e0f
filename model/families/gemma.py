"""Gemma 2 and Gemma 3 (text): RMSNorm gains applied as 1 + w, GeGLU with tanh-approximated
GELU, embeddings scaled by sqrt(hidden_size), norms after attention and the feed-forward block
too (sandwich), scores scaled by query_pre_attn_scalar**-0.5, sliding-window layers alternating
with global ones. Gemma 2 soft-caps attention scores and logits; Gemma 3 normalizes q and k per
head instead and gives its sliding layers rotary frequencies of their own."""

from __future__ import annotations

from forgeline.model.families.family import (
    Family,
    LayerWeights,
    UnsupportedArchitecture,
    attention_weights,
    layer_types,
    mlp_weights,
    read_rope,
    read_sliding_window,
    require,
    rope_parameters,
)


def read_common(config) -> dict:
    activation = getattr(config, "hidden_activation", None) or config.hidden_act
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedArchitecture(f"{config.model_type} with hidden_activation={activation!r} is not "
                                      "supported (GeGLU with gelu_pytorch_tanh)")
    require(config, "attention_bias", False, "the attention projections have no bias")
    return {"activation": "gelu_tanh", "norm_offset": True, "sandwich_norms": True, "embedding_scale": True,
            "query_pre_attn_scalar": config.query_pre_attn_scalar,
            "attn_logit_softcap": getattr(config, "attn_logit_softcapping", None),
            "final_logit_softcap": getattr(config, "final_logit_softcapping", None),
            **read_sliding_window(config)}


def read_gemma2(config) -> dict:
    theta, scaling = read_rope(config)
    return read_common(config) | {"rope_theta": theta, "rope_scaling": scaling}


def read_gemma3(config) -> dict:
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedArchitecture("gemma3_text with use_bidirectional_attention=True (an embedding "
                                      "model) is not supported: forgeline trains causal language models")
    parameters = config.rope_parameters
    theta, scaling = read_rope(config, parameters["full_attention"])
    local_theta, local_scaling = read_rope(config, parameters["sliding_attention"])
    if local_scaling is not None:
        raise UnsupportedArchitecture("gemma3_text with rope scaling on its sliding layers is not supported")
    return read_common(config) | {"rope_theta": theta, "rope_scaling": scaling,
                                  "local_rope_theta": local_theta, "qk_norm": True}


def write_common(shape) -> dict:
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": shape.query_pre_attn_scalar,
            "sliding_window": shape.sliding_window, "layer_types": layer_types(shape),
            "attn_logit_softcapping": shape.attn_logit_softcap,
            "final_logit_softcapping": shape.final_logit_softcap}


def write_gemma3(shape) -> dict:
    local = rope_parameters(shape.local_rope_theta or shape.rope_theta, None)
    return write_common(shape) | {"rope_parameters": {"full_attention": rope_parameters(shape.rope_theta,
                                                                                         shape.rope_scaling),
                                                      "sliding_attention": local}}


def layer_weights(shape) -> LayerWeights:
    norms = {"input_layernorm.weight": ("attention_norm.weight",),
             "post_attention_layernorm.weight": ("attention_out_norm.weight",),
             "pre_feedforward_layernorm.weight": ("ffn_norm.weight",),
             "post_feedforward_layernorm.weight": ("ffn_out_norm.weight",)}
    return norms | attention_weights(shape) | mlp_weights()


GEMMA2 = Family(model_type="gemma2", architecture="Gemma2ForCausalLM", read_config=read_gemma2,
                write_config=write_common, layer_weights=layer_weights)
GEMMA3 = Family(model_type="gemma3_text", architecture="Gemma3ForCausalLM", read_config=read_gemma3,
                write_config=write_gemma3, layer_weights=layer_weights)
