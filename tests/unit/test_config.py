from pathlib import Path

import pytest

from forgeline.configs import Config, ConfigError, load_config, shipped_configs
from forgeline.configs.loader import config_docs
from forgeline.configs.schema import (
    CleaningConfig,
    LoraConfig,
    PairsConfig,
    PreferenceConfig,
    Section,
    SFTConfig,
    SourceConfig,
)


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.parallel.world_size >= 1


def test_default_is_the_embedded_tiny_config() -> None:
    assert load_config() == load_config("tiny.yaml")


def test_every_field_is_documented() -> None:
    optional = ("sft", "preference", "pairs")  # SFTConfig | None and the like: below
    sections = [Config] + [Config.model_fields[name].annotation for name in Config.model_fields
                           if name not in optional]
    sections += [SourceConfig, CleaningConfig, SFTConfig, LoraConfig, PreferenceConfig, PairsConfig]
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
    shipped = ("corpus-docs.yaml, debug.yaml, smollm2-cpt.yaml, smollm2-dpo.yaml, smollm2-sft.yaml, "
               "tiny-single.yaml, tiny.yaml")
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


def test_a_null_in_the_child_removes_the_inherited_value(tmp_path: Path) -> None:
    child = tmp_path / "child.yaml"
    child.write_text("inherit: tiny.yaml\nparallel:\n  pp: null\n  pp_schedule: null\n"
                     "  dp_shard: 2\nmodel:\n  init_from: null\nsft: null\n")
    cfg = load_config(child)
    assert (cfg.parallel.pp, cfg.parallel.pp_schedule) == (1, Config().parallel.pp_schedule)
    assert cfg.parallel.pp_microbatches == load_config("tiny.yaml").parallel.pp_microbatches  # kept
    assert "init_from" not in cfg.model.model_fields_set and cfg.model.dim == 256


def test_an_inheriting_config_registers_under_its_own_name(tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("inherit: tiny.yaml\ndata:\n  out_dir: artifacts/data-mine\n")
    assert load_config(mine).registry.model_name == "forgeline-mine"
    assert load_config(mine, ["train.steps=300"]).registry.model_name == "forgeline-mine"  # its own line
    named = tmp_path / "named.yaml"
    named.write_text("inherit: mine.yaml\nregistry:\n  model_name: shakespeare-v2\n")
    assert load_config(named).registry.model_name == "shakespeare-v2"
    assert load_config("tiny.yaml").registry.model_name == "forgeline-tiny"
    assert load_config("tiny-single.yaml").registry.model_name == "forgeline-tiny"  # says so itself


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


SECRET = "s3cr3tvalue"


@pytest.mark.parametrize("override, field, hint", [
    (f"checkpoint.persistent_url=s3://AKIAEXAMPLE:{SECRET}@127.0.0.1:9/bucket", "checkpoint.persistent_url",
     "AWS_SECRET_ACCESS_KEY"),
    (f"registry.tracking_uri=https://ml:{SECRET}@mlflow.internal", "registry.tracking_uri",
     "MLFLOW_TRACKING_PASSWORD"),
    (f"registry.tracking_uri=postgresql://ml:{SECRET}@db:5432/mlflow", "registry.tracking_uri",
     "$MLFLOW_TRACKING_URI"),
    (f"registry.artifact_location=s3://AKIAEXAMPLE:{SECRET}@bucket/mlartifacts", "registry.artifact_location",
     "AWS_ACCESS_KEY_ID"),
    (f"data.tokenizer_path=https://user:{SECRET}@host/tokenizer.json", "data.tokenizer_path", "environment"),
    (f"model.init_from=hf://:{SECRET}@org/model", "model.init_from", "environment"),
    (f"data.sources=[{{kind: hf, path: 'gcs://key:{SECRET}@bucket/ds'}}]", "data.sources.0.path",
     "GOOGLE_APPLICATION_CREDENTIALS"),
    (f"data.sources=[{{kind: hf, dataset: json, data_files: ['s3://k:{SECRET}@b/x.jsonl']}}]",
     "data.sources.0.data_files", "AWS_SECRET_ACCESS_KEY"),
    (f"train.callbacks=[{{path: 'pkg.mod:Hook', args: {{url: 'https://u:{SECRET}@hook'}}}}]",
     "train.callbacks.0.args", "environment"),
])
def test_a_url_with_a_password_is_refused_naming_the_field_not_the_secret(override: str, field: str,
                                                                         hint: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("debug.yaml", [override])
    message = str(err.value)
    assert f"{field}: the URL holds a password" in message and hint in message
    assert SECRET not in message and SECRET not in repr(err.value.__context__)


def test_a_url_password_in_a_config_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(f"inherit: debug.yaml\ncheckpoint:\n  persistent_url: s3://AKIAEXAMPLE:{SECRET}@h/b\n")
    with pytest.raises(ConfigError, match=r"checkpoint\.persistent_url: the URL holds a password") as err:
        load_config(path)
    assert SECRET not in str(err.value) and "s3://AKIAEXAMPLE:***@h/b" in str(err.value)


@pytest.mark.parametrize("override", [
    "checkpoint.persistent_url=s3://bucket/prefix",
    "checkpoint.persistent_url=s3://bucket/run@v2/checkpoints",  # `@` in the path, no password
    "checkpoint.persistent_url=file:///data/user:name@host/ckpt",
    "registry.tracking_uri=http://127.0.0.1:5000",
    "registry.tracking_uri=https://ml@mlflow.internal:5000",  # a user name alone is no secret
    "model.init_from=models:/forgeline-tiny@candidate",
    "data.tokenizer_path=/data/tokenizers/bpe@4096/tokenizer.json",
])
def test_urls_and_paths_without_a_password_are_accepted(override: str) -> None:
    dotted, _, value = override.partition("=")
    assert load_config("debug.yaml", [override]).value(dotted) == value


@pytest.mark.parametrize("override", [
    f"checkpont.persistent_url=s3://AKIAEXAMPLE:{SECRET}@h/b",  # unknown section
    f"checkpoint.persistent_url=[s3://AKIAEXAMPLE:{SECRET}@h/b",  # not YAML
    f"checkpoint.persistent_ur=s3://AKIAEXAMPLE:{SECRET}@h/b",  # unknown key
])
def test_no_config_error_quotes_a_url_password(override: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("debug.yaml", [override])
    assert SECRET not in str(err.value) and err.value.__context__ is None and err.value.__cause__ is None


def test_a_validation_error_of_a_resolved_config_quotes_no_value() -> None:
    """The path of a config a flow gets as a dict: pydantic's own error text, without its input."""
    raw = load_config("debug.yaml").model_dump()
    raw["checkpoint"]["persistent_url"] = f"s3://AKIAEXAMPLE:{SECRET}@h/b"
    with pytest.raises(ValueError) as err:
        Config.model_validate(raw)
    assert "checkpoint.persistent_url" in str(err.value) and SECRET not in str(err.value)
    with pytest.raises(ValueError) as err:
        load_config("debug.yaml").with_values({"registry.tracking_uri": f"https://u:{SECRET}@h"})
    assert "registry.tracking_uri" in str(err.value) and SECRET not in str(err.value)


def test_the_log_scrubber_masks_url_passwords_in_messages_and_tracebacks() -> None:
    import io
    import logging

    from forgeline.configs.redaction import install_log_scrubber

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("forgeline.test_scrubber")
    logger.addHandler(handler)
    try:
        install_log_scrubber()
        install_log_scrubber()  # once per handler
        assert len(handler.filters) == 1
        logger.warning("MLflow runs in %s", f"postgresql://ml:{SECRET}@db/mlflow")
        try:
            raise RuntimeError(f"cannot reach redis://:{SECRET}@cache:6379")
        except RuntimeError:
            logger.exception("upload to s3://bucket/run@v2 failed")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert SECRET not in text
    assert "postgresql://ml:***@db/mlflow" in text and "redis://:***@cache:6379" in text
    assert "s3://bucket/run@v2 failed" in text


def test_a_checkpoint_tier_of_a_scheme_forgeline_does_not_upload_to_is_refused_up_front() -> None:
    """It passed `config show` and failed at the first checkpoint's upload."""
    with pytest.raises(ConfigError, match=r"checkpoint\.persistent_url: ftp:// is not a checkpoint tier .* "
                                          r"use file:// or s3://"):
        load_config("debug.yaml", ["checkpoint.persistent_url=ftp://x/y"])
