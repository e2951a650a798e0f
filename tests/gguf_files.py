"""Tiny random models of each family transformers reads GGUF files of, made offline with
transformers and written as a GGUF file the way llama.cpp's convert_hf_to_gguf.py lays one out:
its metadata keys (those transformers' GGUF_CONFIG_MAPPING reads), gguf's tensor names
(TensorNameMap), the transforms llama.cpp applies to a family's tensors and transformers undoes
on reading (Llama's q/k rows permuted, Gemma's norm gains stored as 1 + w), and a tokenizer of the
kind that family's GGUF files carry. Unquantized fp32: quantization is the SmolLM2 GGUF's test.

A GGUF file carries fewer fields than config.json: what it does not carry comes back as
transformers' default. Each config here sets only what the file carries, so that the model read
back from the file is the model written.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.unit.test_families import COMMON, WINDOW, randomize_gains_and_biases

# One config per family and rope scaling a GGUF file carries, each delta the file can carry on
# (q/k/v biases, q/k norms, a head_dim that is not hidden / heads, sliding windows, soft-capping,
# fused projections, tied embeddings).
CONFIGS = {
    "llama": dict(tie_word_embeddings=False),
    # Llama 3.2's rope scaling, which llama.cpp writes as a rope_freqs tensor.
    "llama-llama3-rope": dict(model_type="llama", tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-linear-rope": dict(model_type="llama", rope_parameters={"rope_type": "linear", "rope_theta": 1e4,
                                                                   "factor": 2.0}),
    "mistral": dict(head_dim=24),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=24, tie_word_embeddings=False),
    "phi3": dict(sliding_window=WINDOW),
    "phi3-untied-full": dict(model_type="phi3", sliding_window=None, tie_word_embeddings=False),
    # Gemma 2 2B/9B scale queries by head_dim, the 27B (46 layers) by hidden / heads: neither is in
    # a GGUF file, both as llama.cpp computes them.
    "gemma2": dict(head_dim=24, query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0),
    "gemma2-27b-depth": dict(model_type="gemma2", head_dim=24, query_pre_attn_scalar=16, num_hidden_layers=46,
                             sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    # Gemma 3 4B's global rope scaling; a GGUF file carries no rope theta of the sliding layers, nor
    # which layers slide (transformers and llama.cpp: five in six, so the sixth is the first global).
    "gemma3_text": dict(head_dim=24, query_pre_attn_scalar=24, sliding_window=WINDOW, num_hidden_layers=6,
                        rope_parameters={
                            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                 "gemma2": "gemma2", "gemma3_text": "gemma3"}
"""general.architecture by model_type: llama.cpp writes Mistral as a Llama (transformers reads
one back as a Llama, unless general.name is exactly "mistral")."""
SENTENCEPIECE = {"phi3", "gemma2", "gemma3_text"}
"""The families whose GGUF files carry a sentencepiece ("llama") tokenizer; the others a
byte-level BPE ("gpt2") one, as Llama 3, Mistral's tekken and Qwen do."""
PAD, BOS, EOS, UNK = 0, 1, 2, 3
ROPE_FREQS = f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS]}.weight"
ROPE_FACTORS = {"long": f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG]}.weight",
                "short": f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT]}.weight"}


def tiny_model(name: str, **fields) -> torch.nn.Module:
    """The model of CONFIGS[name], `fields` changed."""
    fields = CONFIGS[name] | fields
    model_type = fields.pop("model_type", name)
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **(COMMON | fields))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_gains_and_biases(model)
    return model


def write_gguf(model: torch.nn.Module, path: Path, name: str | None = None,
               architecture: str | None = None) -> Path:
    """`model` (one of CONFIGS' families) and a tokenizer of its vocabulary size as a GGUF file,
    its general.name `name` (default "Tiny <model_type>", as llama.cpp names a file after the
    model's directory), its general.architecture `architecture` (default the family's)."""
    config = model.config
    architecture = architecture or ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name or f"Tiny {config.model_type}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_hyperparameters(writer, config)
    if config.model_type in SENTENCEPIECE:
        add_sentencepiece_tokenizer(writer, config.vocab_size)
    else:
        add_byte_level_tokenizer(writer, config.vocab_size)
    names = gguf.get_tensor_name_map(gguf_arch(ARCHITECTURES[config.model_type]), config.num_hidden_layers)
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied output projection is the embedding: llama.cpp writes no output.weight
        stem, suffix = key.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(stem)}.{suffix}", as_stored(config, key, tensor).numpy())
    rope = rope_parameters(config)
    if rope["rope_type"] == "llama3":
        writer.add_tensor(ROPE_FREQS, llama3_rope_freqs(model))
    if rope["rope_type"] == "longrope":
        for kind in ("long", "short"):
            writer.add_tensor(ROPE_FACTORS[kind], np.array(rope[f"{kind}_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_arch(architecture: str) -> gguf.MODEL_ARCH:
    return next(arch for arch, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)


def add_hyperparameters(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = rope_parameters(config)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] not in ("default", "llama3", "longrope"):  # those two: tensors
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
    if config.model_type == "phi3" or getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window or 0)  # llama.cpp: 0, a Phi-3 without a window
    if getattr(config, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def rope_parameters(config: PretrainedConfig) -> dict:
    """Those of the global layers (Gemma 3 keeps them per layer type)."""
    parameters = config.rope_parameters
    return parameters.get("full_attention", parameters)


def llama3_rope_freqs(model: torch.nn.Module) -> np.ndarray:
    """What Llama 3's rope scaling divides each frequency by."""
    scaled = model.model.rotary_emb.inv_freq
    dims = 2 * scaled.numel()
    theta = rope_parameters(model.config)["rope_theta"]
    unscaled = 1.0 / theta ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    return (unscaled / scaled.double()).float().numpy()


def as_stored(config: PretrainedConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as llama.cpp stores it: Llama's q and k rows from rotate-half order into
    interleaved pairs, Gemma's norm gains as the 1 + w they multiply by."""
    if ARCHITECTURES[config.model_type] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
        halves = tensor.reshape(heads, 2, tensor.size(0) // heads // 2, -1)  # (heads, 2, head_dim/2, dim)
        return halves.transpose(1, 2).reshape(tensor.shape)
    if config.model_type.startswith("gemma") and name.endswith("norm.weight"):
        return tensor + 1
    return tensor


def add_byte_level_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """Single bytes spelled in GPT-2's byte alphabet, and a few merges of them as the last tokens."""
    alphabet = list(bytes_to_unicode().values())
    merged = [alphabet[i] + alphabet[i + 1] for i in range(4, 10, 2)]
    tokens = alphabet[:vocab_size - len(merged)] + merged
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab_size)
    writer.add_token_merges([f"{token[0]} {token[1]}" for token in merged])
    add_special_ids(writer)


def add_sentencepiece_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """Control tokens, an unknown token, then word pieces scored by rank."""
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    letters = [chr(c) for c in (*range(ord("a"), ord("z") + 1), *range(ord("A"), ord("Z") + 1))]
    pieces = ["\u2581"] + letters + ["\u2581" + letter for letter in letters]
    tokens = specials + pieces[:vocab_size - len(specials)]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(specials) + [-float(i) for i in range(vocab_size - len(specials))])
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN]
                           + [gguf.TokenType.NORMAL] * (vocab_size - len(specials)))
    writer.add_unk_token_id(UNK)
    add_special_ids(writer)


def add_special_ids(writer: gguf.GGUFWriter) -> None:
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_pad_token_id(PAD)
