"""The base of `model.init_from` (tasks/pretrained.py): what resolves, and every bad input failing
before any work with the file, field or registry entry named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, LlamaForCausalLM, PretrainedConfig

from forgeline.configs import Config, load_config
from forgeline.configs.schema import ConfigError
from forgeline.model.fileio import sha256_file
from forgeline.tasks import pretrained
from forgeline.tasks.pretrained import check_data_tokenizer, recorded_base, resolve_base, with_base
from tests.conftest import debug_config

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)


def save_base(directory: Path, config: PretrainedConfig | None = None) -> Path:
    torch.manual_seed(0)
    config = config or LlamaConfig(**TINY, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1}, unk_token="a"))
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def config_from(tmp_path: Path, init_from: str | Path, *overrides: str) -> Config:
    values = {"model.init_from": str(init_from),
              "registry.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    return Config().with_values(values | dict(override.split("=") for override in overrides))


def test_a_hugging_face_directory_gives_its_shape_tokenizer_and_weights_hash(tmp_path: Path) -> None:
    base = resolve_base(config_from(tmp_path, save_base(tmp_path / "base")))
    assert (base.shape.dim, base.shape.n_layers, base.shape.n_heads, base.shape.vocab_size) == (64, 2, 4, 64)
    assert base.shape.tie_embeddings and base.shape.rope_layout == "half" and not base.is_checkpoint
    assert base.tokenizer == tmp_path / "base" and len(base.sha256) == 64
    assert base.lineage()["weights_sha256"] == base.sha256 and "model_version" not in base.lineage()


def test_the_shape_comes_from_the_base_and_a_conflict_names_the_field_and_both_values(tmp_path: Path) -> None:
    directory = save_base(tmp_path / "base")
    cfg = config_from(tmp_path, directory)
    resolved = with_base(cfg, resolve_base(cfg))
    assert resolved.model.dim == 64 and resolved.model.init_from == str(directory)
    agreeing = config_from(tmp_path, directory, "model.n_heads=4")  # a key set to the base's value
    assert with_base(agreeing, resolve_base(cfg)).model.n_heads == 4
    with pytest.raises(ConfigError, match=rf"model.dim=128 but the base {directory} has 64.*"
                                          r"model.n_layers=3 .* has 2"):
        with_base(Config().with_values({"model.init_from": str(directory), "model.dim": 128,
                                        "model.n_layers": 3}), resolve_base(cfg))


def test_a_config_inheriting_tiny_takes_the_base_shape_over_the_inherited_keys(tmp_path: Path) -> None:
    directory = save_base(tmp_path / "base")

    def mine(own_model_keys: str = "") -> Path:
        path = tmp_path / "mine.yaml"
        path.write_text(f"inherit: tiny.yaml\nmodel:\n  init_from: {directory}\n{own_model_keys}"
                        f"registry:\n  tracking_uri: sqlite:///{tmp_path / 'mlflow.db'}\n")
        return path

    cfg = load_config(mine())
    assert with_base(cfg, resolve_base(cfg)).model.dim == 64  # tiny.yaml has dim 256, the base 64
    for asked in [load_config(mine("  n_layers: 3\n")), load_config(mine(), ["model.n_layers=3"])]:
        with pytest.raises(ConfigError, match=r"^model.n_layers=3 but the base .* has 2\. .*remove"):
            with_base(asked, resolve_base(cfg))


def test_a_layout_the_base_does_not_fit_fails_naming_it(tmp_path: Path) -> None:
    cfg = config_from(tmp_path, save_base(tmp_path / "base"), "parallel.tp=4")  # 2 KV heads
    with pytest.raises(ConfigError, match=r"base .*: parallel.tp=4 must divide model.n_heads=4 and "
                                          r"model.n_kv_heads=2$"):
        with_base(cfg, resolve_base(cfg))


@pytest.mark.parametrize("what, config", [
    ("model_type 'gpt2' is not a family forgeline has \\(supported: llama, mistral, qwen2, qwen3, gemma2, "
     "gemma3_text, phi3\\)", GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=64)),
    ("attention_bias", LlamaConfig(**TINY, attention_bias=True)),
    ("rope_type 'dynamic'", LlamaConfig(**TINY, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
])
def test_an_architecture_forgeline_cannot_represent_is_named(what: str, config: PretrainedConfig,
                                                             tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=what):
        resolve_base(config_from(tmp_path, save_base(tmp_path / "base", config)))


def test_a_missing_or_damaged_weights_file_is_named(tmp_path: Path) -> None:
    directory = save_base(tmp_path / "base")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ConfigError, match=str(weights)):
        resolve_base(config_from(tmp_path, directory))
    weights.unlink()
    with pytest.raises(ConfigError, match=rf"no \*.safetensors weights in {directory}"):
        resolve_base(config_from(tmp_path, directory))


def test_a_missing_path_or_tokenizer_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"init_from=.*nowhere: no such directory or .gguf file"):
        resolve_base(config_from(tmp_path, tmp_path / "nowhere"))
    directory = save_base(tmp_path / "base")
    (directory / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=rf"no tokenizer.json in {directory}"):
        resolve_base(config_from(tmp_path, directory))


def test_a_base_inside_an_installed_package_is_found_without_importing_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "site" / "shipped_models"
    save_base(package / "tiny")
    (package / "__init__.py").write_text("raise ImportError('needs packages forgeline does not install')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    base = resolve_base(config_from(tmp_path, "package:shipped_models/tiny"))
    assert base.weights == package / "tiny" and base.uri == "package:shipped_models/tiny"
    with pytest.raises(ConfigError, match=r"package 'shipped_models' has no nothing.gguf \(.*does not exist"):
        resolve_base(config_from(tmp_path, "package:shipped_models/nothing.gguf"))
    with pytest.raises(ConfigError, match=r"no Python package 'not_installed_anywhere' is installed"):
        resolve_base(config_from(tmp_path, "package:not_installed_anywhere/model.gguf"))


def test_a_hub_name_is_refused_while_the_hub_is_switched_off(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"HuggingFaceTB/SmolLM2-135M is no local file or directory, and "
                                          r"names a Hugging Face hub model, but the hub is switched off "
                                          r"\(HF_HUB_OFFLINE=1"):
        resolve_base(config_from(tmp_path, "HuggingFaceTB/SmolLM2-135M"))


@pytest.mark.parametrize("uri, which", [("models:/nobody/3", "version 3"), ("models:/nobody@champion",
                                                                            "alias @champion")])
def test_a_model_version_that_does_not_exist_names_the_registry_and_the_name(uri: str, which: str,
                                                                             tmp_path: Path) -> None:
    cfg = config_from(tmp_path, uri)
    MlflowClient(cfg.registry.tracking_uri).search_registered_models()  # an existing, empty registry
    with pytest.raises(ConfigError, match=rf"registered model 'nobody' has no {which} in the registry at "
                                          rf"sqlite:///{tmp_path}/mlflow.db"):
        resolve_base(cfg)


def test_data_of_another_tokenizer_is_refused_naming_both_hashes(tmp_path: Path) -> None:
    base = resolve_base(config_from(tmp_path, save_base(tmp_path / "base")))
    check_data_tokenizer(base, {"tokenizer": {"sha256": "x", "source_sha256": base.tokenizer_sha256}},
                         tmp_path)
    with pytest.raises(ConfigError, match=rf"tokenizer sha256 {'0' * 64}, but the base .* has tokenizer "
                                          rf"sha256 {sha256_file(tmp_path / 'base' / 'tokenizer.json')}"):
        check_data_tokenizer(base, {"tokenizer": {"sha256": "x", "source_sha256": "0" * 64}}, tmp_path)


def test_a_config_awaiting_its_base_defers_the_shape_checks() -> None:
    # tp=8 does not divide the default 4 heads: checked once the base's shape is known.
    assert Config().with_values({"model.init_from": "/base", "parallel.tp": 8}).model.awaits_base
    with pytest.raises(ValueError, match="parallel.tp=8 must divide"):
        Config().with_values({"parallel.tp": 8})
    assert debug_config(Path("/tmp/unused")).model.init_from is None


def test_the_weights_are_hashed_once_until_they_change(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config_from(tmp_path, save_base(tmp_path / "base"))
    hashed: list[Path] = []
    monkeypatch.setattr(pretrained, "sha256_file", lambda path: hashed.append(path) or sha256_file(path))
    first = resolve_base(cfg).sha256
    assert resolve_base(cfg).sha256 == first and len(hashed) == 1  # the one model.safetensors
    LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True)).save_pretrained(tmp_path / "base")
    assert resolve_base(cfg).sha256 != first and len(hashed) == 2


def test_eval_compares_with_the_base_the_run_trained_from_after_the_reference_moved(tmp_path: Path) -> None:
    """model.init_from names a link that moves from base A to base B after training, as an alias
    moves: the base recorded by train (its lineage) is still A; A rewritten in place is refused."""
    first = save_base(tmp_path / "a")
    torch.manual_seed(1)
    second = tmp_path / "b"
    LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True)).save_pretrained(second)
    (second / "tokenizer.json").write_bytes((first / "tokenizer.json").read_bytes())
    alias = tmp_path / "current"
    alias.symlink_to(first)
    cfg = config_from(tmp_path, alias)
    trained_from = resolve_base(cfg).lineage()  # what train records

    alias.unlink()
    alias.symlink_to(second)
    assert resolve_base(cfg).weights.resolve() == second
    base = recorded_base(trained_from)
    assert (base.weights, base.sha256) == (first, trained_from["weights_sha256"])

    LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True)).save_pretrained(first)
    with pytest.raises(ConfigError, match=rf"the base {alias} the run trained from was rewritten at {first}"):
        recorded_base(trained_from)


def test_lora_targets_the_base_family_lacks_are_refused_before_any_work(tmp_path: Path) -> None:
    """A Phi-3 base fuses q, k and v: the default targets (q_proj, ...) name no module of it."""
    from transformers import Phi3Config

    base = save_base(tmp_path / "base", Phi3Config(**TINY, pad_token_id=0))
    chats = {"data.sources": [{"kind": "chitchat"}]}
    cfg = config_from(tmp_path, base).with_values(chats | {"sft.lora": {"rank": 4}})
    with pytest.raises(ConfigError, match=r"sft.lora.targets \['q_proj', 'k_proj', 'v_proj'\] are not linear "
                                          r"layers of a phi3 model, whose are .*'qkv_proj'"):
        with_base(cfg, resolve_base(cfg))
    cfg = config_from(tmp_path, base).with_values(chats | {"sft.lora": {"rank": 4, "targets": ["qkv_proj"]}})
    assert with_base(cfg, resolve_base(cfg)).model.family == "phi3"
