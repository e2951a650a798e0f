"""What a model family is, and the parts of its Hugging Face format that families share.

A family (one module beside this one) says how its Hugging Face config maps to a `ModelConfig`
and back, and how its weights are named: each Hugging Face tensor of a decoder layer is one or
more forgeline parameters of a block, several concatenated by rows where the family fuses them
(Phi-3's qkv_proj). Whatever the config cannot hold is refused by name before any weight is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from forgeline.configs.schema import ModelConfig, RopeScaling

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Hugging Face tensor name within a decoder layer -> forgeline parameter names within a block.
LayerWeights = dict[str, tuple[str, ...]]


class UnsupportedArchitecture(ValueError):
    """A Hugging Face config that forgeline cannot represent; the message names the field."""


@dataclass(frozen=True)
class Family:
    model_type: str
    """Hugging Face's `model_type`, also `ModelConfig.family`."""

    architecture: str
    """The `*ForCausalLM` class exports name in config.json."""

    read_config: Callable[[PretrainedConfig], dict[str, Any]]
    """The ModelConfig keys of this family's config beyond `common_fields`; raises
    UnsupportedArchitecture naming a field it cannot represent."""

    write_config: Callable[[ModelConfig], dict[str, Any]]
    """The Hugging Face config fields of this family beyond `common_config`."""

    layer_weights: Callable[[ModelConfig], LayerWeights]
    """Its decoder layer's tensors as forgeline parameters."""


def common_fields(config: PretrainedConfig) -> dict[str, Any]:
    """The ModelConfig keys every family's config gives the same way."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {
        "family": config.model_type,
        "vocab_size": config.vocab_size,
        "dim": config.hidden_size,
        "n_layers": config.num_hidden_layers,
        "n_heads": config.num_attention_heads,
        "n_kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "attention_head_dim": None if head_dim * config.num_attention_heads == config.hidden_size
        else head_dim,
        "ffn_dim": config.intermediate_size,
        "norm_eps": config.rms_norm_eps,
        "max_seq_len": config.max_position_embeddings,
        "tie_embeddings": bool(config.tie_word_embeddings),
        "rope_layout": "half",
    }


def common_config(shape: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config fields every family writes the same way."""
    return {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_dim,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_seq_len,
        "rms_norm_eps": shape.norm_eps,
        "tie_word_embeddings": shape.tie_embeddings,
        "rope_parameters": rope_parameters(shape.rope_theta, shape.rope_scaling),
    }


def require(config: PretrainedConfig, field: str, allowed: object, why: str) -> None:
    value = getattr(config, field, allowed)
    if value != allowed:
        raise UnsupportedArchitecture(f"{config.model_type} with {field}={value!r} is not supported: {why}")


def read_rope(config: PretrainedConfig, parameters: dict | None = None) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) of Hugging Face rope parameters (transformers 5's `rope_parameters`,
    or 4's `rope_theta` + `rope_scaling`)."""
    if parameters is None:
        parameters = getattr(config, "rope_parameters", None)
    if parameters is None:  # transformers 4
        parameters = {"rope_theta": config.rope_theta, **(config.rope_scaling or {})}
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedArchitecture(f"{config.model_type} with partial_rotary_factor="
                                      f"{parameters['partial_rotary_factor']} is not supported: the rotary "
                                      "embedding turns every channel of a head")
    theta = parameters["rope_theta"]
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling(type="linear", factor=parameters["factor"])
    if rope_type == "llama3":
        return theta, RopeScaling(type="llama3", factor=parameters["factor"],
                                  low_freq_factor=parameters["low_freq_factor"],
                                  high_freq_factor=parameters["high_freq_factor"],
                                  original_max_position_embeddings=parameters["original_max_position_embeddings"])
    raise UnsupportedArchitecture(f"{config.model_type} with rope_type {rope_type!r} is not supported "
                                  "(supported: default, linear, llama3)")


def rope_parameters(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    if scaling.type == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": scaling.factor}
    return {"rope_type": "llama3", "rope_theta": theta, **scaling.model_dump(exclude={"type"})}


def read_sliding_window(config: PretrainedConfig) -> dict[str, Any]:
    """sliding_window and sliding_layers from `sliding_window` and `layer_types` (absent: every
    layer slides)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return {}
    if layer_types is None:
        return {"sliding_window": window}
    sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if unknown := sorted(set(layer_types) - {"sliding_attention", "full_attention"}):
        raise UnsupportedArchitecture(f"{config.model_type} with layer_types {unknown} is not supported "
                                      "(supported: sliding_attention, full_attention)")
    if not sliding:
        return {}
    return {"sliding_window": window, "sliding_layers": None if len(sliding) == len(layer_types) else sliding}


def read_swiglu_rope(config: PretrainedConfig) -> dict[str, Any]:
    """rope_theta and rope_scaling of a Llama-like family, whose feed-forward block is SwiGLU."""
    require(config, "hidden_act", "silu", "the gated feed-forward block is SwiGLU")
    theta, scaling = read_rope(config)
    return {"rope_theta": theta, "rope_scaling": scaling}


def read_switched_window(config: PretrainedConfig) -> dict[str, Any]:
    """Qwen's sliding window, which applies only when `use_sliding_window` is set."""
    return read_sliding_window(config) if getattr(config, "use_sliding_window", False) else {}


def write_switched_window(shape: ModelConfig) -> dict[str, Any]:
    if shape.sliding_window is None:
        return {"use_sliding_window": False}
    return {"use_sliding_window": True, "sliding_window": shape.sliding_window,
            "layer_types": layer_types(shape)}


def layer_types(shape: ModelConfig) -> list[str]:
    return ["sliding_attention" if shape.window_of(i) else "full_attention" for i in range(shape.n_layers)]


def attention_weights(shape: ModelConfig, fused_qkv: bool = False) -> LayerWeights:
    """q, k, v, o projections (fused: one qkv_proj), their biases and q/k norms as the shape has them."""
    projections = {"q": "wq", "k": "wk", "v": "wv"}
    if fused_qkv:
        fused = tuple(f"attention.{ours}.weight" for ours in projections.values())
        weights = {"self_attn.qkv_proj.weight": fused}
    else:
        weights = {f"self_attn.{p}_proj.weight": (f"attention.{ours}.weight",)
                   for p, ours in projections.items()}
    weights["self_attn.o_proj.weight"] = ("attention.wo.weight",)
    if shape.qkv_bias:
        weights |= {f"self_attn.{p}_proj.bias": (f"attention.{ours}.bias",)
                    for p, ours in projections.items()}
    if shape.qk_norm:
        weights |= {"self_attn.q_norm.weight": ("attention.q_norm.weight",),
                    "self_attn.k_norm.weight": ("attention.k_norm.weight",)}
    return weights


def mlp_weights(fused_gate_up: bool = False) -> LayerWeights:
    if fused_gate_up:
        return {"mlp.gate_up_proj.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
                "mlp.down_proj.weight": ("feed_forward.w2.weight",)}
    return {"mlp.gate_proj.weight": ("feed_forward.w1.weight",),
            "mlp.up_proj.weight": ("feed_forward.w3.weight",),
            "mlp.down_proj.weight": ("feed_forward.w2.weight",)}


def llama_layer_weights(fused: bool = False) -> Callable[[ModelConfig], LayerWeights]:
    """A Llama-like decoder layer's tensors; `fused`: Phi-3's qkv_proj and gate_up_proj."""
    return lambda shape: (llama_norms() | attention_weights(shape, fused_qkv=fused)
                          | mlp_weights(fused_gate_up=fused))


def llama_norms() -> LayerWeights:
    return {"input_layernorm.weight": ("attention_norm.weight",),
            "post_attention_layernorm.weight": ("ffn_norm.weight",)}
