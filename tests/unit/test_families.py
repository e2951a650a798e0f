"""Every model family forgeline has, on a tiny random model made offline with transformers:
imported with transformers' logits, exported back as the same family with the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from forgeline.model.families import FAMILIES
from forgeline.model.hf import export_hf, import_hf, to_hf_state_dict
from forgeline.model.transformer import KVCache, Transformer

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
# A window shorter than the test's rows, so that the sliding layers differ from the global ones.
WINDOW = 5
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# One tiny config per family and per variant that changes the network: each delta of a family is on.
CONFIGS = {
    "llama": dict(tie_word_embeddings=False),
    "llama-tied-llama3-rope": dict(model_type="llama", tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    "llama-linear-rope": dict(model_type="llama", rope_parameters={"rope_type": "linear", "rope_theta": 1e4,
                                                                   "factor": 2.0}),
    "mistral": dict(sliding_window=WINDOW, head_dim=24),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen2-sliding": dict(model_type="qwen2", use_sliding_window=True, sliding_window=WINDOW,
                          max_window_layers=1,
                          layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    "qwen3": dict(head_dim=24, tie_word_embeddings=False),
    "qwen3-tied": dict(model_type="qwen3", head_dim=16, tie_word_embeddings=True),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention",
                                                             "sliding_attention"]),
    "gemma3_text": dict(head_dim=24, query_pre_attn_scalar=24, sliding_window=WINDOW,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                        rope_parameters={
                            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "phi3": dict(sliding_window=WINDOW),
    "phi3-untied-full": dict(model_type="phi3", sliding_window=None, tie_word_embeddings=False),
}


def hf_model(name: str) -> torch.nn.Module:
    fields = dict(CONFIGS[name])
    model_type = fields.pop("model_type", name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **COMMON, **fields),
                                             dtype=torch.float32).eval()
    randomize_gains_and_biases(model)
    return model


@torch.no_grad()
def randomize_gains_and_biases(model: torch.nn.Module) -> None:
    """Norm gains start at 1 (0 in Gemma's 1 + w) and biases at 0: make each distinct, so that a
    swapped or dropped one shows."""
    offset = "gemma" in model.config.model_type
    for name, param in model.named_parameters():
        if name.endswith(".bias") or (offset and name.endswith("norm.weight")):
            param.uniform_(-0.5, 0.5)
        elif name.endswith("norm.weight"):
            param.uniform_(0.5, 1.5)


def tokens() -> torch.Tensor:
    return torch.randint(3, COMMON["vocab_size"], (2, 14), generator=torch.Generator().manual_seed(1))


def test_every_family_is_tested() -> None:
    assert {CONFIGS[name].get("model_type", name) for name in CONFIGS} == set(FAMILIES)


@pytest.mark.parametrize("name", CONFIGS)
def test_an_imported_model_computes_transformers_logits(name: str) -> None:
    theirs = hf_model(name)
    ours, shape = import_hf(theirs)
    assert shape.family == theirs.config.model_type
    x = tokens()
    with torch.no_grad():
        expected = theirs(x).logits
        assert (ours(x) - expected).abs().max().item() <= 1e-5
        # Incremental decoding with the KV cache, a token at a time past the window: the same logits.
        cache = KVCache(shape, x.size(0), x.size(1), x.device, torch.float32)
        decoded = [ours.logits(ours.hidden_states(x[:, :8], cache))]
        decoded += [ours.logits(ours.hidden_states(x[:, t:t + 1], cache)) for t in range(8, x.size(1))]
        assert (torch.cat(decoded, dim=1) - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", CONFIGS)
def test_an_export_is_the_same_family_with_the_same_weights(name: str, tmp_path: Path) -> None:
    theirs = hf_model(name)
    ours, shape = import_hf(theirs)
    tokenizer = tmp_path / "tokenizer"
    vocabulary = {f"t{i}": i for i in range(COMMON["vocab_size"])}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocabulary, unk_token="t0")),
                            pad_token="t0", bos_token="t1", eos_token="t2").save_pretrained(tokenizer)
    export_hf(ours, tokenizer, tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    assert reloaded.config.model_type == theirs.config.model_type
    assert type(reloaded) is type(theirs)
    expected = theirs.state_dict()
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    x = tokens()
    with torch.no_grad():
        assert (reloaded(x).logits - theirs(x).logits).abs().max().item() <= 1e-6


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "phi3"])
def test_a_model_of_a_family_trained_from_scratch_exports_with_its_rotary_pairs_permuted(name: str) -> None:
    """forgeline's own init rotates interleaved pairs: export permutes q/k rows, biases and norms."""
    theirs = hf_model(name)
    _, shape = import_hf(theirs)
    interleaved = shape.model_copy(update={"rope_layout": "interleaved"})
    with torch.device("meta"):
        scratch = Transformer(interleaved)
    scratch.to_empty(device="cpu")
    scratch.init_weights(seed=3)
    theirs.load_state_dict(to_hf_state_dict(scratch), strict=False)
    x = tokens()
    with torch.no_grad():
        assert (scratch(x) - theirs(x).logits).abs().max().item() <= 1e-5


def test_a_sliding_window_counts_positions_in_a_row_of_branches() -> None:
    """The eval class packs a context with several continuations after it (each attending to the
    context, not to the others): a window counts positions, not offsets in the row."""
    theirs = hf_model("mistral")
    ours, _ = import_hf(theirs)
    context, first, second = tokens()[0, :10], tokens()[1, :4], tokens()[1, 4:8]
    row = torch.cat([context, first, second])[None]  # (1, 18)
    positions = torch.cat([torch.arange(10), torch.arange(10, 14), torch.arange(10, 14)])[None]
    branch = torch.tensor([0] * 10 + [1] * 4 + [2] * 4)
    index = torch.arange(18)
    same_branch = (branch[:, None] == branch[None, :]) | (branch[None, :] == 0)  # the context is everyone's
    visible = (index[:, None] >= index[None, :]) & same_branch
    with torch.no_grad():
        packed = ours.logits(ours.hidden_states(row, positions=positions, mask=visible[None, None]))
        alone = theirs(torch.cat([context, second])[None]).logits
    assert (packed[:, 14:] - alone[:, 10:]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", ["llama", "gemma2", "phi3"])
def test_the_logits_of_some_positions_are_those_of_the_whole_row(name: str) -> None:
    """`outputs` (the train step's counted targets): the logits of those positions only, in row
    order, as the whole rows' (soft-capping included), packed documents and all."""
    ours, _ = import_hf(hf_model(name))
    x = tokens()
    documents = (torch.arange(x.size(1)) >= 6).int().expand_as(x)  # two documents a row
    keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(2)) < 0.4
    with torch.no_grad():
        some, whole = ours(x, documents=documents, outputs=keep), ours(x, documents=documents)
        assert some.shape == (int(keep.sum()), COMMON["vocab_size"])
        assert (some - whole[keep]).abs().max().item() <= 1e-6
