"""Conversion between forgeline's Transformer and Hugging Face's `*ForCausalLM` of each family
forgeline has (model/families/: Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3, Phi-3).

Both are the same network, its variations set by `ModelConfig` keys that a family reads from and
writes to the Hugging Face config. An output projection is tied to the embedding or not
(`ModelConfig.tie_embeddings`; tied, `lm_head.weight` is not written). Parameter names map as
the family's weight names say, for Llama:

    tok_embeddings.weight                 model.embed_tokens.weight
    layers.{i}.attention_norm.weight      model.layers.{i}.input_layernorm.weight
    layers.{i}.attention.w{q,k,v,o}       model.layers.{i}.self_attn.{q,k,v,o}_proj
    layers.{i}.ffn_norm.weight            model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.feed_forward.w1 / w3 / w2  model.layers.{i}.mlp.gate_proj / up_proj / down_proj
    norm.weight                           model.norm.weight
    output.weight                         lm_head.weight

A fused Hugging Face tensor (Phi-3's qkv_proj, gate_up_proj) is several forgeline weights
concatenated by rows.

The rotary embedding's channel pairing may differ (`ModelConfig.rope_layout`). Hugging Face
rotates channel k with channel k + head_dim/2 (rotate_half); a model imported from it keeps that
(`half`), so its weights load unchanged -- also straight into a sharded layout, each rank
reading only its slices (`load_hf_weights`). forgeline's own models rotate interleaved pairs (2k,
2k+1): export permutes the output rows of their wq and wk within each head, so that new row
a * head_dim/2 + k holds old row 2k + a (a in {0, 1}), as transformers'
convert_llama_weights_to_hf `permute` does. Attention scores are unchanged because q and k are
permuted alike.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor, distribute_tensor

from forgeline.configs.schema import ModelConfig
from forgeline.model.families import family_named
from forgeline.model.fileio import new_directory
from forgeline.model.init import canonical_name
from forgeline.model.transformer import Transformer

# transformers is imported where it is used: the ranks import this module for load_hf_weights
# alone, and transformers would add about 2 s to every rank's start (and to every restart).
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

HF_WEIGHTS = "model.safetensors"


def hf_weights(shape: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Hugging Face tensor name -> the forgeline parameters it holds (several: concatenated by
    rows), for a whole model. Tied, the output projection is the embedding and has no tensor."""
    layer = family_named(shape.family).layer_weights(shape)
    weights = {"model.embed_tokens.weight": ("tok_embeddings.weight",)}
    for i in range(shape.n_layers):
        weights |= {f"model.layers.{i}.{theirs}": tuple(f"layers.{i}.{name}" for name in ours)
                    for theirs, ours in layer.items()}
    weights["model.norm.weight"] = ("norm.weight",)
    if not shape.tie_embeddings:
        weights["lm_head.weight"] = ("output.weight",)
    return weights


def _hf_names(shape: ModelConfig) -> dict[str, str]:
    """forgeline parameter name -> Hugging Face name, for the parameters stored as a tensor of
    their own (not fused). Tied, the output projection is stored as the embedding."""
    names = {ours[0]: theirs for theirs, ours in hf_weights(shape).items() if len(ours) == 1}
    if shape.tie_embeddings:
        names["output.weight"] = "model.embed_tokens.weight"
    return names


def fused_weights(shape: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The Hugging Face tensors that hold several forgeline parameters."""
    return {theirs: ours for theirs, ours in hf_weights(shape).items() if len(ours) > 1}


def _interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of wq/wk (n_heads * head_dim, dim): pairs (2k, 2k+1) -> pairs (k, k + head_dim/2)."""
    return w.unflatten(0, (n_heads, -1, 2)).transpose(1, 2).reshape(w.shape)


def _half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `_interleaved_to_half`."""
    return w.unflatten(0, (n_heads, 2, -1)).transpose(1, 2).reshape(w.shape)


def _heads(name: str, shape: ModelConfig) -> int | None:
    """Number of heads whose rows need the rotary permutation, None for other parameters: the
    q and k projections and their biases, and the per-head q and k norms' channels."""
    if shape.rope_layout == "half":
        return None
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return shape.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return shape.n_kv_heads
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1
    return None


def rows_to_hf(name: str, w: torch.Tensor, shape: ModelConfig) -> torch.Tensor:
    """`w`, the weight `name` or a tensor whose rows are that weight's output rows (a LoRA B,
    model/lora.py), with its rows in the Hugging Face order."""
    heads = _heads(name, shape)
    return w if heads is None else _interleaved_to_half(w, heads)


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """A full (unsharded) forgeline model's weights under its family's Hugging Face names."""
    ours, weights = model.state_dict(), hf_weights(model.shape)
    placed = {name for names in weights.values() for name in names} | {"output.weight"}
    if unplaced := [name for name in ours if name not in placed]:
        raise ValueError(f"{unplaced[0]} has no place in a {family_named(model.shape.family).architecture}: "
                         "merge LoRA adapters into their weights first (model/lora.py merge_lora)")
    return {hf: torch.cat([rows_to_hf(name, ours[name], model.shape) for name in names])
            for hf, names in weights.items()}


def parameter_sizes(shape: ModelConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        return {name: t.shape for name, t in Transformer(shape).state_dict().items()}


def from_hf_state_dict(sd: dict[str, torch.Tensor], shape: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face weights of `shape`'s family -> a forgeline state dict of a model of `shape`.
    Tied, the output projection is the embedding (transformers may list `lm_head.weight` too: the
    same tensor)."""
    sd = dict(sd)
    if shape.tie_embeddings:
        sd.pop("lm_head.weight", None)
    sizes, weights, out = parameter_sizes(shape), hf_weights(shape), {}
    for hf, names in weights.items():
        parts = sd[hf].split([sizes[name][0] for name in names]) if len(names) > 1 else [sd[hf]]
        for name, part in zip(names, parts, strict=True):
            heads = _heads(name, shape)
            out[name] = part if heads is None else _half_to_interleaved(part, heads)
    if shape.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    leftover = [k for k in sd if k not in weights and not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ValueError(f"Hugging Face weights forgeline has no place for: {leftover[:5]}")
    return out


def hf_config(shape: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The config.json of `shape` as its family's Hugging Face config."""
    from transformers import CONFIG_MAPPING

    from forgeline.model.families.family import common_config

    family = family_named(shape.family)
    return CONFIG_MAPPING[family.model_type](
        **common_config(shape) | family.write_config(shape),  # the family's fields win
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        architectures=[family.architecture],
    )


def export_hf(model: Transformer, tokenizer_dir: str | Path, out_dir: Path) -> Path:
    """Write `out_dir` so that `AutoModelForCausalLM` and `AutoTokenizer` load it offline:
    config.json, generation_config.json, model.safetensors and the tokenizer files. Written to a
    temporary sibling and renamed into place; an existing non-empty `out_dir` is never touched."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    if len(tokenizer) > model.shape.vocab_size:
        raise ValueError(f"tokenizer {tokenizer_dir} has {len(tokenizer)} tokens but the model's "
                         f"vocab_size is {model.shape.vocab_size}")
    config = hf_config(model.shape, tokenizer)
    with new_directory(out_dir) as tmp:
        weights = {k: v.detach().float().cpu().contiguous() for k, v in to_hf_state_dict(model).items()}
        save_file(weights, tmp / HF_WEIGHTS, metadata={"format": "pt"})
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    log.info("exported Hugging Face %s model to %s", family_named(model.shape.family).architecture, out_dir)
    return out_dir


def model_shape_from_hf(config: PretrainedConfig) -> ModelConfig:
    """The shape of a Hugging Face config of a family forgeline has; UnsupportedArchitecture (a
    ValueError) names the family or the field it cannot represent."""
    from forgeline.model.families.family import common_fields

    family = family_named(config.model_type)
    return ModelConfig(**common_fields(config), **family.read_config(config))


def import_hf(source: str | Path | PreTrainedModel, device: torch.device | str = "cpu",
              **from_pretrained_kwargs) -> tuple[Transformer, ModelConfig]:
    """A Hugging Face checkpoint of a family forgeline has -> a forgeline Transformer (fp32, eval
    mode) computing the same logits, and its shape.

    Args:
        source: a loaded `*ForCausalLM`, or a directory `from_pretrained` loads.
        device: where the forgeline model's weights go.
        from_pretrained_kwargs: passed to `from_pretrained` for a directory, e.g. `gguf_file`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

    if isinstance(source, PreTrainedModel):
        hf_model = source
        shape = model_shape_from_hf(hf_model.config)
    else:
        # Validate the config before loading any weights.
        shape = model_shape_from_hf(AutoConfig.from_pretrained(str(source), **from_pretrained_kwargs))
        hf_model = AutoModelForCausalLM.from_pretrained(str(source), **from_pretrained_kwargs)
    with torch.device("meta"):
        model = Transformer(shape)
    model.to_empty(device=device)
    model.init_buffers()
    model.load_state_dict(from_hf_state_dict(hf_model.state_dict(), shape))
    return model.eval(), shape


def hf_weight_files(directory: Path) -> list[Path]:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory} (forgeline reads safetensors only: "
                                "save the model with save_pretrained(..., safe_serialization=True))")
    return files


def check_hf_weights(directory: Path, shape: ModelConfig) -> None:
    """Fail naming the file unless the safetensors in `directory` hold every weight of `shape`
    at its size; reads the headers only."""
    sizes = parameter_sizes(shape)
    expected = {hf: (sum(sizes[name][0] for name in names), *sizes[names[0]][1:])
                for hf, names in hf_weights(shape).items()}
    found: dict[str, tuple[int, ...]] = {}
    for path in hf_weight_files(directory):
        try:
            with safe_open(str(path), framework="pt") as f:
                found |= {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        except Exception as err:  # safetensors raises its own error types for a damaged header
            raise ValueError(f"{path} is not a readable safetensors file: {err}") from err
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ValueError(f"the weights in {directory} lack {missing[:5]} (of {len(missing)} missing)")
    wrong = [f"{key} is {found[key]}, expected {size}" for key, size in expected.items()
             if found[key] != size]
    if wrong:
        raise ValueError(f"the weights in {directory} do not fit config.json: " + "; ".join(wrong[:5]))


@torch.no_grad()
def load_hf_weights(parts: list[nn.Module], directory: Path, shape: ModelConfig) -> None:
    """Fill each model part -- materialized, parallelized or not -- with the Hugging Face weights
    of `shape`'s family from the safetensors in `directory`, through torch.distributed.checkpoint's
    HuggingFaceStorageReader: each rank reads only the slices of its shards (DTensors) from the
    memory-mapped files. A fused tensor (Phi-3's qkv_proj) is read whole and each rank keeps its
    shard of each part. Collective when torch.distributed is initialized: every rank calls it
    with as many parts. A tied output projection on its own pipeline stage (no embedding there)
    reads the embedding's rows, so both copies start equal."""
    names, fused = _hf_names(shape), fused_weights(shape)
    for part in parts:
        # named_parameters lists a shared (tied) parameter once, under the embedding's name.
        # LoRA adapters (model/lora.py) are no weights of the base: they keep their initialization.
        params = {canonical_name(name): param for name, param in part.named_parameters()}
        state = {names[name]: param for name, param in params.items() if name in names}
        whole = {hf: torch.empty(sum(params[name].shape[0] for name in ours), *params[ours[0]].shape[1:],
                                 dtype=params[ours[0]].dtype)
                 for hf, ours in fused.items() if ours[0] in params}
        dcp.load(state | whole, storage_reader=HuggingFaceStorageReader(str(directory)))
        for hf, tensor in whole.items():
            rows = tensor.split([params[name].shape[0] for name in fused[hf]])
            for name, part_rows in zip(fused[hf], rows, strict=True):
                _copy_into(params[name], part_rows)


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """`param` (a DTensor shard or a plain tensor) = its part of the full tensor `full`."""
    if isinstance(param, DTensor):
        # Every rank holds the full tensor: each keeps its own shard, with no collective.
        full = distribute_tensor(full.to(param.device), param.device_mesh, param.placements,
                                 src_data_rank=None)
    param.copy_(full)


# Fields a GGUF file carries that transformers 5 does not read back into the config (its
# GGUF_CONFIG_MAPPING has no entry for them), by the GGUF key after "<architecture>.". Left out,
# a Qwen3 whose head_dim is not Qwen3Config's 128 fails to load, and a Gemma 2's soft-capping or
# a Phi-3's sliding window silently becomes the config class's default.
GGUF_FIELDS_TRANSFORMERS_DROPS = {"attention.key_length": "head_dim",
                                  "attention.sliding_window": "sliding_window",
                                  "attn_logit_softcapping": "attn_logit_softcapping",
                                  "final_logit_softcapping": "final_logit_softcapping"}
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
"""Where llama.cpp writes a longrope scaling (Phi-3 128k, Phi-3.5, Phi-4-mini), unread by transformers."""


def convert_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """A GGUF file (quantized or not) -> a Hugging Face directory: config.json, fp32
    model.safetensors and the tokenizer, dequantized by transformers (`gguf` package). Written
    to a temporary sibling and renamed into place. A family forgeline does not have, or a file
    transformers cannot read, fails with a ValueError naming its model_type."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    config = gguf_config(gguf_file)
    shape = model_shape_from_hf(config)
    with new_directory(out_dir) as tmp:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                         config=config, torch_dtype=torch.float32)
        except (NotImplementedError, RuntimeError, ValueError) as err:
            raise ValueError(f"transformers cannot read this GGUF file of model_type {config.model_type!r}: "
                             f"{err}") from err
        # The weights are dequantized: saved as plain fp32, without the GGUF quantization_config that
        # from_pretrained set (with it transformers' Trainer, TRL's too, refuses the directory as a
        # "purely quantized" model it cannot train).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name).save_pretrained(tmp)
        check_hf_weights(tmp, shape)
    return out_dir


def gguf_config(gguf_file: Path) -> PretrainedConfig:
    """The config transformers reads from `gguf_file`, with the fields it drops set from the file:
    those of GGUF_FIELDS_TRANSFORMERS_DROPS and the rope scaling (gguf_rope_scaling)."""
    import gguf
    from transformers import AutoConfig

    reader = gguf.GGUFReader(gguf_file)
    prefix = reader.fields["general.architecture"].contents() + "."
    fields = {key.removeprefix(prefix): field.contents() for key, field in reader.fields.items()
              if key.startswith(prefix)}
    config = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    for key, name in GGUF_FIELDS_TRANSFORMERS_DROPS.items():
        if key in fields and hasattr(config, name):
            setattr(config, name, fields[key] or None)  # llama.cpp writes a Phi-3 without a window as 0
    if config.model_type in GEMMA_27B_DEPTH:
        config.query_pre_attn_scalar = gemma_query_pre_attn_scalar(config)
    tensors = {tensor.name: tensor.data for tensor in reader.tensors if not tensor.name.startswith("blk.")}
    if any(name in tensors for name in ROPE_FACTOR_TENSORS):
        raise ValueError(f"the GGUF file's longrope scaling ({', '.join(ROPE_FACTOR_TENSORS)}; model_type "
                         f"{config.model_type!r}) is not read back by transformers: start from the model's "
                         "Hugging Face directory")
    rope_freqs = tensors.get("rope_freqs.weight")
    scaling = gguf_rope_scaling(config, fields.get("rope.scaling.type"), fields.get("rope.scaling.factor"),
                                rope_freqs)
    if scaling:
        # Gemma 3 keeps rope parameters per layer type and scales its global layers only.
        parameters = config.rope_parameters
        parameters.get("full_attention", parameters).update(scaling)
    return config


GEMMA_27B_DEPTH = {"gemma2": 46, "gemma3_text": 62}
"""The depth by which llama.cpp knows a Gemma 27B: it scales that model's queries by
1 / sqrt(hidden / heads) (query_pre_attn_scalar 144 for Gemma 2, 168 for Gemma 3), every other
Gemma 2 and 3 by 1 / sqrt(head_dim) (256). A GGUF file carries neither; transformers' default
is 256 for all."""


def gemma_query_pre_attn_scalar(config: PretrainedConfig) -> int:
    """The query_pre_attn_scalar llama.cpp computes a Gemma 2 or 3 with (GEMMA_27B_DEPTH)."""
    if config.num_hidden_layers == GEMMA_27B_DEPTH[config.model_type]:
        return config.hidden_size // config.num_attention_heads
    return config.head_dim


LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""What every Llama 3.1, 3.2 and 3.3 scales rope by, besides its factor (8 or 32)."""


def gguf_rope_scaling(config: PretrainedConfig, kind: str | None, factor: float | None,
                      rope_freqs: np.ndarray | None) -> dict | None:
    """The rope scaling a GGUF file carries, which transformers does not read back: llama.cpp
    writes linear scaling as metadata, and Llama 3's as the per-frequency factors it divides by
    (the rope_freqs tensor), recognized here as LLAMA3_ROPE with their largest as the factor.
    Any other is refused naming it: read without it, the model would compute other logits."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind not in (None, "none"):
        raise ValueError(f"the GGUF file's rope scaling {kind!r} (model_type {config.model_type!r}) is not "
                         "read back by transformers: start from the model's Hugging Face directory")
    if rope_freqs is None:
        return None
    scaling = {"rope_type": "llama3", "factor": float(rope_freqs.max()), **LLAMA3_ROPE}
    parameters = config.rope_parameters
    scaled = copy.deepcopy(config)
    scaled.rope_parameters = parameters | scaling
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](scaled, "cpu")
    dims = 2 * inv_freq.numel()
    unscaled = 1.0 / parameters["rope_theta"] ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    if not np.allclose(unscaled.numpy() / inv_freq.double().numpy(), rope_freqs, rtol=1e-5):
        raise ValueError(f"the GGUF file's rope_freqs (model_type {config.model_type!r}) are not Llama 3's "
                         f"rope scaling {LLAMA3_ROPE} with any factor, and transformers does not read them "
                         "back: start from the model's Hugging Face directory")
    return scaling
