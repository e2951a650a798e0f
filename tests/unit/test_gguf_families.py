"""`model.init_from` = a GGUF file, of each family transformers reads GGUF files of: a tiny random
model made offline with transformers, written as llama.cpp writes one (tests/gguf_files.py),
resolved as the train stage resolves a base (tasks/pretrained.py resolve_base: converted once
by transformers into a Hugging Face directory) and loaded as its ranks load one
(model/hf.py load_hf_weights) computes the original model's logits. A file forgeline cannot
start from is refused at resolution, naming its model_type, with nothing left in the cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forgeline.configs import Config
from forgeline.configs.schema import ConfigError
from forgeline.model.hf import load_hf_weights
from forgeline.model.llama import Transformer
from forgeline.tasks.pretrained import CACHE_ENV, Base, resolve_base
from tests.gguf_files import CONFIGS, tiny_model, write_gguf
from tests.unit.test_families import tokens

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


@pytest.mark.parametrize("model_type", CONFIGS)
def test_a_gguf_base_of_each_family_starts_with_the_original_models_logits(model_type: str, tmp_path: Path,
                                                                            cache: Path) -> None:
    original = tiny_model(model_type)
    base = resolve(write_gguf(original, tmp_path / f"{model_type}.gguf"))
    assert base.shape.family == FAMILY_READ_BACK.get(model_type, model_type)
    assert (base.tokenizer / "tokenizer.json").is_file()
    x = tokens()
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
