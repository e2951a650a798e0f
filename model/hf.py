"""Conversion between forgeline's Transformer and Hugging Face `LlamaForCausalLM`.

Both are the same network: pre-norm blocks with RMSNorm (computed in fp32, the gain applied after
casting back), grouped-query attention scaled by head_dim**-0.5, SwiGLU feed-forward, an output projection
tied to the embedding or not (`ModelConfig.tie_embeddings`; tied, `lm_head.weight` is not
written). Parameter names map one to one:

    tok_embeddings.weight                 model.embed_tokens.weight
    layers.{i}.attention_norm.weight      model.layers.{i}.input_layernorm.weight
    layers.{i}.attention.w{q,k,v,o}       model.layers.{i}.self_attn.{q,k,v,o}_proj
    layers.{i}.ffn_norm.weight            model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.feed_forward.w1 / w3 / w2  model.layers.{i}.mlp.gate_proj / up_proj / down_proj
    norm.weight                           model.norm.weight
    output.weight                         lm_head.weight

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

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader

from forgeline.configs.schema import ModelConfig
from forgeline.model.fileio import new_directory
from forgeline.model.init import canonical_name
from forgeline.model.llama import Transformer

# transformers is imported where it is used: the ranks import this module for load_hf_weights
# alone, and transformers would add about 2 s to every rank's start (and to every restart).
if TYPE_CHECKING:
    from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

HF_WEIGHTS = "model.safetensors"
_LAYER_NAMES = {  # forgeline name within a block -> Hugging Face name within a decoder layer
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}


def _hf_names(shape: ModelConfig) -> dict[str, str]:
    """forgeline parameter name -> Hugging Face parameter name, for a whole model. Tied, the
    output projection is stored as the embedding."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight"}
    for i in range(shape.n_layers):
        names |= {f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in _LAYER_NAMES.items()}
    output = "model.embed_tokens.weight" if shape.tie_embeddings else "lm_head.weight"
    return names | {"norm.weight": "model.norm.weight", "output.weight": output}


def _interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of wq/wk (n_heads * head_dim, dim): pairs (2k, 2k+1) -> pairs (k, k + head_dim/2)."""
    return w.unflatten(0, (n_heads, -1, 2)).transpose(1, 2).reshape(w.shape)


def _half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `_interleaved_to_half`."""
    return w.unflatten(0, (n_heads, 2, -1)).transpose(1, 2).reshape(w.shape)


def _heads(name: str, shape: ModelConfig) -> int | None:
    """Number of heads whose rows need the rotary permutation, None for other parameters."""
    if shape.rope_layout == "half":
        return None
    if name.endswith("attention.wq.weight"):
        return shape.n_heads
    if name.endswith("attention.wk.weight"):
        return shape.n_kv_heads
    return None


def hf_name(name: str, shape: ModelConfig) -> str:
    """The Hugging Face name of the forgeline parameter `name`."""
    return _hf_names(shape)[name]


def rows_to_hf(name: str, w: torch.Tensor, shape: ModelConfig) -> torch.Tensor:
    """`w`, the weight `name` or a tensor whose rows are that weight's output rows (a LoRA B,
    model/lora.py), with its rows in the Hugging Face order."""
    heads = _heads(name, shape)
    return w if heads is None else _interleaved_to_half(w, heads)


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """A full (unsharded) forgeline model's weights under `LlamaForCausalLM` names."""
    ours, names = model.state_dict(), _hf_names(model.shape)
    if unplaced := [name for name in ours if name not in names]:
        raise ValueError(f"{unplaced[0]} has no place in a LlamaForCausalLM: merge LoRA adapters into "
                         "their weights first (model/lora.py merge_lora)")
    return {hf: rows_to_hf(name, ours[name], model.shape) for name, hf in names.items()}


def from_hf_state_dict(sd: dict[str, torch.Tensor], shape: ModelConfig) -> dict[str, torch.Tensor]:
    """`LlamaForCausalLM` weights -> a forgeline state dict of a model of `shape`. Tied, the
    output projection is the embedding (transformers may list `lm_head.weight` too: the same
    tensor)."""
    sd = dict(sd)
    if shape.tie_embeddings:
        sd.pop("lm_head.weight", None)
    out = {}
    for name, hf_name in _hf_names(shape).items():
        heads = _heads(name, shape)
        out[name] = sd[hf_name] if heads is None else _half_to_interleaved(sd[hf_name], heads)
    used = set(_hf_names(shape).values())
    leftover = [k for k in sd if k not in used and not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ValueError(f"Hugging Face weights forgeline has no place for: {leftover[:5]}")
    return out


def hf_config(shape: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.dim,
        intermediate_size=shape.ffn_dim,
        num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_heads,
        num_key_value_heads=shape.n_kv_heads,
        head_dim=shape.head_dim,
        hidden_act="silu",
        max_position_embeddings=shape.max_seq_len,
        rms_norm_eps=shape.norm_eps,
        rope_theta=shape.rope_theta,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=shape.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        architectures=["LlamaForCausalLM"],
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
    log.info("exported Hugging Face Llama model to %s", out_dir)
    return out_dir


def _check_supported(config: PretrainedConfig) -> float:
    """Raise ValueError naming the first config field forgeline cannot represent; returns
    rope_theta."""
    if config.model_type != "llama":
        raise ValueError(f"model_type is {config.model_type!r}; only 'llama' can be imported")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(config, field, False):
            raise ValueError(f"{field}=True is not supported (forgeline's linear layers have no bias)")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (SwiGLU uses 'silu')")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        raise ValueError(f"head_dim={head_dim} is not hidden_size / num_attention_heads = "
                         f"{config.hidden_size} / {config.num_attention_heads}")
    # transformers 5 keeps rope_type and rope_theta in rope_parameters; 4 has rope_scaling + rope_theta.
    rope = getattr(config, "rope_parameters", None)
    if rope is None:
        if config.rope_scaling is not None:
            raise ValueError(f"rope_scaling={config.rope_scaling} is not supported (only None)")
        return config.rope_theta
    if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"rope_parameters={rope} is not supported: only plain RoPE (rope_type 'default', "
                         "no rope_scaling)")
    return rope["rope_theta"]


def model_shape_from_hf(config: PretrainedConfig) -> ModelConfig:
    rope_theta = _check_supported(config)
    return ModelConfig(
        vocab_size=config.vocab_size,
        dim=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads,
        ffn_dim=config.intermediate_size,
        norm_eps=config.rms_norm_eps,
        rope_theta=rope_theta,
        max_seq_len=config.max_position_embeddings,
        tie_embeddings=bool(config.tie_word_embeddings),
        rope_layout="half",
    )


def import_hf(source: str | Path | PreTrainedModel, device: torch.device | str = "cpu",
              **from_pretrained_kwargs) -> tuple[Transformer, ModelConfig]:
    """A Hugging Face Llama checkpoint -> a forgeline Transformer (fp32, eval mode) computing the
    same logits, and its shape.

    Args:
        source: a loaded `LlamaForCausalLM`, or a directory `from_pretrained` loads.
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
    with torch.device("meta"):
        sizes = {name: tuple(t.shape) for name, t in Transformer(shape).state_dict().items()}
    expected = {hf_name: sizes[name] for name, hf_name in _hf_names(shape).items()}
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
    """Fill each model part -- materialized, parallelized or not -- with a Hugging Face Llama's
    weights from the safetensors in `directory`, through torch.distributed.checkpoint's
    HuggingFaceStorageReader: each rank reads only the slices of its shards (DTensors) from the
    memory-mapped files. Collective when torch.distributed is initialized: every rank calls it
    with as many parts. A tied output projection on its own pipeline stage (no embedding there)
    reads the embedding's rows, so both copies start equal."""
    names = _hf_names(shape)
    for part in parts:
        # named_parameters lists a shared (tied) parameter once, under the embedding's name.
        # LoRA adapters (model/lora.py) are no weights of the base: they keep their initialization.
        state = {names[canonical_name(name)]: param for name, param in part.named_parameters()
                 if canonical_name(name) in names}
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(directory)))


def convert_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """A GGUF file (quantized or not) -> a Hugging Face directory: config.json, fp32
    model.safetensors and the tokenizer, dequantized by transformers (`gguf` package). Written
    to a temporary sibling and renamed into place."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    shape = model_shape_from_hf(AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name))
    with new_directory(out_dir) as tmp:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                     torch_dtype=torch.float32)
        model.hf_quantizer = None  # the weights are dequantized: save them as plain fp32
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name).save_pretrained(tmp)
        check_hf_weights(tmp, shape)
    return out_dir
