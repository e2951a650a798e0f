"""`model.init_from` = a GGUF file, of each family transformers reads GGUF files of: a tiny random
model made offline with transformers, written as llama.cpp writes one (tests/gguf_files.py),
resolved as the train stage resolves a base (tasks/pretrained.py resolve_base: converted once
by transformers into a Hugging Face directory) and loaded as its ranks load one
(model/hf.py load_hf_weights) computes the original model's logits. A file forgeline cannot
start from is refused at resolution, naming its model_type, with nothing left in the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from forgeline.configs import Config
from forgeline.configs.schema import ConfigError
from forgeline.model.hf import load_hf_weights
from forgeline.model.transformer import Transformer
from forgeline.tasks.pretrained import CACHE_ENV, Base, resolve_base, unchanged_file_sha256
from tests.gguf_files import CONFIGS, tiny_model, write_gguf
from tests.unit.test_families import COMMON

pytest.importorskip("gguf")

# llama.cpp writes a Mistral as a Llama, and transformers reads it back as one: without its
# sliding window (a GGUF file carries none for a Llama), a Mistral is a Llama.
FAMILY_READ_BACK = {"mistral": "llama"}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def resolve(gguf_file: Path) -> Base:
    return resolve_base(Config().with_values({"model.init_from": str(gguf_file)}))


def loaded(base: Base) -> Transformer:
    with torch.device("meta"):
        model = Transformer(base.shape)
    model.to_empty(device="cpu")
    model.init_buffers()
    load_hf_weights([model], base.weights, base.shape)
    return model.eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_a_gguf_base_of_each_family_starts_with_the_original_models_logits(name: str, tmp_path: Path,
                                                                            cache: Path) -> None:
    original = tiny_model(name)
    base = resolve(write_gguf(original, tmp_path / f"{name}.gguf"))
    model_type = original.config.model_type
    assert base.shape.family == FAMILY_READ_BACK.get(model_type, model_type)
    assert (base.tokenizer / "tokenizer.json").is_file()
    # Plain fp32 weights: no quantization_config, with which transformers' Trainer refuses a model.
    assert "quantization_config" not in json.loads((base.weights / "config.json").read_text())
    # Rows as long as the model's context: Llama 3's rope scaling changes only the low frequencies.
    x = torch.randint(3, COMMON["vocab_size"], (2, COMMON["max_position_embeddings"]),
                      generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (loaded(base)(x) - original(x).logits).abs().max().item() <= 1e-5


def test_a_gguf_file_of_a_family_forgeline_lacks_is_refused_naming_it(tmp_path: Path, cache: Path) -> None:
    gguf_file = write_gguf(tiny_model("qwen2"), tmp_path / "moe.gguf", architecture="qwen2moe")
    with pytest.raises(ConfigError, match=r"init_from=.*moe.gguf: model_type 'qwen2_moe' is not a family "
                                          r"forgeline has \(supported: llama, .*qwen2"):
        resolve(gguf_file)
    assert not any(cache.glob("bases/*"))


def test_a_gguf_file_transformers_cannot_read_is_refused_naming_its_model_type(tmp_path: Path,
                                                                               cache: Path) -> None:
    """A Llama-architecture file named exactly "mistral" is read as a Mistral, whose tensors
    transformers 5 then cannot name (gguf has no "mistral" architecture)."""
    gguf_file = write_gguf(tiny_model("mistral"), tmp_path / "mistral.gguf", name="mistral")
    with pytest.raises(ConfigError, match=r"init_from=.*mistral.gguf: transformers cannot read this "
                                          r"GGUF file of model_type 'mistral'"):
        resolve(gguf_file)
    assert not any(cache.glob("bases/*"))


@pytest.mark.parametrize(("name", "rope", "refusal"), [
    ("llama", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 32},
     r"rope scaling 'yarn' \(model_type 'llama'\) is not read back by transformers"),
    ("llama", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 2.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
     r"rope_freqs \(model_type 'llama'\) are not Llama 3's"),
    ("phi3", {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 32,
              "long_factor": [1.0 + i for i in range(8)], "short_factor": [1.0] * 8},
     r"longrope scaling \(rope_factors_long.weight, rope_factors_short.weight; model_type 'phi3'\)"),
], ids=["yarn", "other-rope-freqs", "longrope"])
def test_a_gguf_file_whose_rope_scaling_transformers_drops_is_refused_naming_it(
        name: str, rope: dict, refusal: str, tmp_path: Path, cache: Path) -> None:
    """Read without it, the model would compute other logits than the file's."""
    gguf_file = write_gguf(tiny_model(name, rope_parameters=rope), tmp_path / "scaled.gguf")
    with pytest.raises(ConfigError, match=rf"init_from=.*scaled.gguf: the GGUF file's {refusal}"):
        resolve(gguf_file)
    assert not any(cache.glob("bases/*"))


def test_a_gguf_file_converted_before_its_dropped_fields_were_set_is_converted_again(tmp_path: Path,
                                                                                      cache: Path) -> None:
    """The cache of a base converted before (keyed by the file's sha256 alone) lacks Gemma 2's
    soft-capping: it is not reused."""
    original = tiny_model("gemma2")
    gguf_file = write_gguf(original, tmp_path / "gemma2.gguf")
    stale = cache / "bases" / f"gguf-{unchanged_file_sha256(gguf_file)[:16]}"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    base = resolve(gguf_file)
    assert base.weights != stale and base.shape.final_logit_softcap == 3.0
