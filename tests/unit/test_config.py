from pathlib import Path

import pytest

from forgeline.configs import Config, ConfigError, load_config, shipped_configs
from forgeline.configs.loader import config_docs
from forgeline.configs.schema import CleaningConfig, Section, SourceConfig


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.parallel.world_size >= 1


def test_default_is_the_embedded_tiny_config() -> None:
    assert load_config() == load_config("tiny.yaml")


def test_every_field_is_documented() -> None:
    sections = [Config] + [Config.model_fields[name].annotation for name in Config.model_fields]
    sections += [SourceConfig, CleaningConfig]
    for section in sections:
        assert issubclass(section, Section)
        for name, field in section.model_fields.items():
            if section is Config:
                continue
            assert field.description, f"{section.__name__}.{name} has no docstring"
    docs = config_docs()
    assert "global_batch_size" in docs and "Sequences per optimizer step" in docs
    assert "near_dedup_threshold: 0.85" in docs and "kind: '(required)'" in docs


def test_override_sets_typed_values() -> None:
    cfg = load_config("tiny.yaml", ["train.lr=3e-4", "parallel.dp_shard=2",
                                    "eval.during_training={every_steps: 100, tasks: [a, b]}"])
    assert cfg.train.lr == 3e-4 and cfg.parallel.dp == 2 and cfg.eval.during_training.tasks == ["a", "b"]


def test_unknown_key_names_the_key_and_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny.yaml", ["train.lrr=1"])
    message = str(err.value)
    assert "train.lrr: unknown key" in message
    assert "lr, " in message and "global_batch_size" in message


def test_unknown_section_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown section 'trian'; allowed: data, model"):
        load_config("tiny.yaml", ["trian.lr=1"])


def test_invalid_value_names_the_key_and_the_value() -> None:
    with pytest.raises(ConfigError, match=r"train\.lr: Input should be greater than 0 \(got -1\)"):
        load_config("tiny.yaml", ["train.lr=-1"])


def test_malformed_override() -> None:
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config("tiny.yaml", ["train.lr"])


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp=3"], "parallel.tp=3 must divide model.n_heads=8 and model.n_kv_heads=4"),
    (["train.global_batch_size=10", "parallel.dp_shard=4"],
     "global_batch_size=10 must be divisible by dp_replicate*dp_shard*grad_accum_steps = 1*4*1 = 4"),
    (["model.n_kv_heads=3"], "n_kv_heads=3 must divide n_heads=8"),
    (["model.max_seq_len=64"], "model.max_seq_len=64 must be >= data.seq_len=128"),
    (["train.warmup_steps=300"], "warmup_steps=300 must be smaller than steps=300"),
    (["data.sources=[{kind: files}]"], "kind 'files' needs a `path` glob"),
    (["data.sources=[{kind: hf}]"], "kind 'hf' needs exactly one of `dataset`"),
    (["data.sources=[{kind: stdlib}, {kind: stdlib, weight: 2}]"], "names ['stdlib'] more than once"),
    (["data.cleaning.boilerplate_patterns=['(unclosed']"], "'(unclosed' is not a valid regex"),
])
def test_inconsistent_values_fail_with_the_numbers(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny.yaml", overrides)
    assert message in str(err.value)


def test_missing_config_file_lists_the_shipped_ones(tmp_path: Path) -> None:
    shipped = "corpus-docs.yaml, debug.yaml, smollm2-cpt.yaml, tiny-single.yaml, tiny.yaml"
    with pytest.raises(ConfigError, match=f"not found; shipped configs: {shipped}"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_file_with_bad_value(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  dim: wide\n")
    with pytest.raises(ConfigError, match="model.dim: Input should be a valid integer"):
        load_config(path)


def test_section_hash_changes_only_with_its_section() -> None:
    base = load_config("tiny.yaml")
    other = load_config("tiny.yaml", ["eval.batch_size=5"])
    assert base.section_hash("data", "model") == other.section_hash("data", "model")
    assert base.section_hash("eval") != other.section_hash("eval")


def test_inherit_replaces_keys_section_by_section(tmp_path: Path) -> None:
    child = tmp_path / "child.yaml"
    child.write_text("inherit: tiny.yaml\ntrain:\n  steps: 7\n  warmup_steps: 2\n")
    cfg, base = load_config(child), load_config("tiny.yaml")
    assert cfg.train.steps == 7 and cfg.train.lr == base.train.lr and cfg.model == base.model
    assert load_config("tiny-single.yaml").parallel.world_size == 1


def test_inherit_loop_is_reported(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("inherit: b.yaml\n")
    (tmp_path / "b.yaml").write_text("inherit: a.yaml\n")
    with pytest.raises(ConfigError, match="loops back to itself"):
        load_config(tmp_path / "a.yaml")


def test_nested_settings_are_validated_and_flattened() -> None:
    cfg = load_config("tiny.yaml", ["eval.dimensions={math: {limit: 5}, code: {limit: 2, num_fewshot: 1}}"])
    assert list(cfg.eval.dimensions) == ["math", "code"]
    assert cfg.flat()["eval.dimensions.code.num_fewshot"] == "1"
    with pytest.raises(ConfigError, match="eval.dimensions.math.limt: unknown key; allowed here: tasks"):
        load_config("tiny.yaml", ["eval.dimensions={math: {limt: 5}}"])
    with pytest.raises(ConfigError, match="eval.dimensions.maths"):
        load_config("tiny.yaml", ["eval.dimensions={maths: {limit: 5}}"])


def test_nested_keys_can_be_overridden() -> None:
    cfg = load_config("tiny.yaml", ["data.cleaning.scrub_pii=true", "data.cleaning.min_chars=5"])
    assert cfg.data.cleaning.scrub_pii and cfg.data.cleaning.min_chars == 5
