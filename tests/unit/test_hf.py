"""Hugging Face export/import: a tiny random forgeline model against `LlamaForCausalLM`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

from forgeline.configs.schema import ModelConfig
from forgeline.model.hf import export_hf, from_hf_state_dict, import_hf, to_hf_state_dict
from forgeline.model.transformer import Transformer

SPECIALS = ["<|endoftext|>", "<|bos|>", "<|pad|>"]
TEXTS = [
    "To be, or not to be, that is the question.",
    "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune.",
    "Now is the winter of our discontent made glorious summer by this sun of York.",
]
SENTENCE = "Now is the question of our fortune."
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer of about 300 tokens, saved in the transformers layout."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXTS, trainer=trainer)
    directory = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIALS[0], bos_token=SPECIALS[1],
                            pad_token=SPECIALS[2]).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model(tokenizer_dir: Path) -> Transformer:
    vocab_size = len(PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir)))
    args = ModelConfig(vocab_size=vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                     norm_eps=1e-5, rope_theta=5000.0, max_seq_len=64)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    with torch.no_grad():
        # Norm gains start at 1: make them distinct so a swapped norm shows. q and k start small
        # (attention nearly uniform): scale them up so a wrong rotary pairing shows.
        generator = torch.Generator().manual_seed(1)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("wq.weight", "wk.weight")):
                param.mul_(10)
    return model.eval()


@pytest.fixture(scope="module")
def exported(model: Transformer, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf(model, tokenizer_dir, tmp_path_factory.mktemp("export") / "hf")


def tokens(tokenizer_dir: Path) -> torch.Tensor:
    ids = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir)).encode(SENTENCE)
    return torch.tensor([ids + ids])  # (1, T): long enough for rotary angles to matter


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_exported_model_loads_in_transformers_with_the_same_logits(
    model: Transformer, tokenizer_dir: Path, exported: Path
) -> None:
    hf_model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert isinstance(hf_model, LlamaForCausalLM)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids = tokens(tokenizer_dir)
    with torch.no_grad():
        diff = max_diff(hf_model(ids).logits, model(ids))
    assert diff <= 1e-4, diff


def test_exported_config_and_tokenizer(model: Transformer, tokenizer_dir: Path, exported: Path) -> None:
    original = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer.encode(SENTENCE) == original.encode(SENTENCE)
    config = LlamaConfig.from_pretrained(exported)
    ids = [original.convert_tokens_to_ids(t) for t in SPECIALS]
    assert [config.eos_token_id, config.bos_token_id, config.pad_token_id] == ids
    assert len(set(ids)) == 3
    assert not config.tie_word_embeddings
    assert (config.vocab_size, config.max_position_embeddings) == (model.shape.vocab_size, 64)
    assert sorted(p.name for p in exported.parent.iterdir()) == ["hf"]  # no temporary left


def test_round_trip_gives_identical_weights(model: Transformer, exported: Path, tokenizer_dir: Path) -> None:
    ours = model.state_dict()
    via_dict = from_hf_state_dict(to_hf_state_dict(model), model.shape)
    assert via_dict.keys() == ours.keys()
    for key in ours:
        assert torch.equal(via_dict[key], ours[key]), key
    # Imported from the directory, the model keeps Hugging Face's rotary pairing: the same
    # network, its q/k rows as stored there, every other weight unchanged.
    imported, args = import_hf(exported)
    assert args == model.shape.model_copy(update={"rope_layout": "half"})
    hf = to_hf_state_dict(model)
    for key, value in imported.state_dict().items():
        expected = ours[key]
        if key.endswith(("wq.weight", "wk.weight")):  # layers.{i}.attention.w{q,k}.weight
            _, layer, _, projection, _ = key.split(".")
            expected = hf[f"model.layers.{layer}.self_attn.{projection[1]}_proj.weight"]
        assert torch.equal(value, expected), key
    ids = tokens(tokenizer_dir)
    with torch.no_grad():
        assert max_diff(imported(ids), model(ids)) <= 1e-5


def test_qk_rows_are_permuted_within_each_head(model: Transformer) -> None:
    wq = model.state_dict()["layers.0.attention.wq.weight"]  # (4 heads * 16, 64)
    hf_wq = to_hf_state_dict(model)["model.layers.0.self_attn.q_proj.weight"]
    head, k = 2, 5  # the pair (2k, 2k+1) of head 2 becomes rows (k, k + 8) of that head
    assert torch.equal(hf_wq[head * 16 + k], wq[head * 16 + 2 * k])
    assert torch.equal(hf_wq[head * 16 + k + 8], wq[head * 16 + 2 * k + 1])


def test_export_refuses_to_overwrite(model: Transformer, tokenizer_dir: Path, exported: Path) -> None:
    before = {p.name: p.read_bytes() for p in exported.iterdir()}
    with pytest.raises(FileExistsError, match=str(exported)):
        export_hf(model, tokenizer_dir, exported)
    assert {p.name: p.read_bytes() for p in exported.iterdir()} == before


def test_export_into_an_existing_empty_directory(model: Transformer, tokenizer_dir: Path,
                                                 tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    assert (export_hf(model, tokenizer_dir, tmp_path / "out") / "model.safetensors").is_file()


def test_import_with_tied_embeddings() -> None:
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True)).eval()
    model, shape = import_hf(hf_model)
    assert shape.tie_embeddings and shape.num_params() == hf_model.num_parameters()
    assert model.output.weight is model.tok_embeddings.weight  # one matrix, as in transformers
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert max_diff(hf_model(ids).logits, model(ids)) <= 1e-4


def test_tied_export_writes_the_matrix_once_and_reloads_tied(tmp_path: Path, tokenizer_dir: Path) -> None:
    torch.manual_seed(0)
    vocab_size = len(PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir)))
    config = LlamaConfig(**TINY | {"vocab_size": vocab_size}, tie_word_embeddings=True)
    hf_model = LlamaForCausalLM(config).eval()
    model, _ = import_hf(hf_model)
    assert "lm_head.weight" not in to_hf_state_dict(model)
    reloaded = AutoModelForCausalLM.from_pretrained(export_hf(model, tokenizer_dir, tmp_path / "hf"))
    assert reloaded.config.tie_word_embeddings
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert max_diff(reloaded(ids).logits, hf_model(ids).logits) <= 1e-5


def test_half_rope_layout_is_transformers_rotate_half() -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from forgeline.model.transformer import apply_rope, rope_cache

    B, T, H, D = 2, 10, 3, 16
    q, k = torch.randn(2, B, H, T, D, generator=torch.Generator().manual_seed(0))
    config = LlamaConfig(**TINY | {"hidden_size": H * D, "num_attention_heads": H}, rope_theta=500.0)
    cos, sin = LlamaRotaryEmbedding(config)(q, torch.arange(T)[None])
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    rope = rope_cache(D, 32, 500.0)
    ours = [apply_rope(t.transpose(1, 2), rope, "half").transpose(1, 2) for t in (q, k)]
    assert max_diff(ours[0], hf_q) <= 1e-5 and max_diff(ours[1], hf_k) <= 1e-5


@pytest.mark.parametrize("field, config", [
    ("'gpt2' is not a family forgeline has \\(supported: llama, mistral, qwen2, qwen3, gemma2, "
     "gemma3_text, phi3",
     GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=64)),
    ("attention_bias", LlamaConfig(**TINY, attention_bias=True)),
    ("mlp_bias", LlamaConfig(**TINY, mlp_bias=True)),
    ("rope_type 'yarn'", LlamaConfig(**TINY, rope_scaling={"rope_type": "yarn", "factor": 2.0})),
    ("partial_rotary_factor", Phi3Config(**TINY, pad_token_id=0, partial_rotary_factor=0.5)),
])
def test_import_rejects_unsupported_configs(field: str, config: PretrainedConfig, tmp_path: Path) -> None:
    hf_model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=field):
        import_hf(hf_model)
    hf_model.save_pretrained(tmp_path)  # from a directory: rejected from the config alone
    with pytest.raises(ValueError, match=field):
        import_hf(tmp_path)
