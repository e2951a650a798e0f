"""The config the train stage hands its ranks: what they read, and nothing of the stages after it,
so that rerunning train leaves its output as it was when only those changed."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from forgeline.configs import Config, ConfigError, load_config
from forgeline.tasks.train.job import TrainResult, preflight_train, rank_config_yaml, read_train_summary


def test_the_ranks_config_holds_what_training_reads_and_nothing_else() -> None:
    cfg = load_config("debug.yaml")
    ranks = Config.model_validate(yaml.safe_load(rank_config_yaml(cfg)))
    for section in ("data", "model", "parallel", "train", "checkpoint"):
        assert getattr(ranks, section) == getattr(cfg, section), section
    assert ranks.eval.during_training == cfg.eval.during_training
    later = load_config("debug.yaml", ["eval.dimensions.math.limit=1", "registry.promotion_margin=0.5",
                                       "registry.model_name=other", "ops.notify_block=x/y"])
    assert rank_config_yaml(later) == rank_config_yaml(cfg)
    in_training = load_config("debug.yaml", ["eval.during_training.every_steps=10"])
    assert rank_config_yaml(in_training) != rank_config_yaml(cfg)
    # Its tasks (held-out text) are asked with their dimension's shots, as the eval stage asks them.
    shots = load_config("debug.yaml", ["eval.during_training.every_steps=10",
                                       "eval.dimensions.language_modeling.num_fewshot=1"])
    asked = yaml.safe_load(rank_config_yaml(shots))["eval"]["dimensions"]
    assert asked == {"language_modeling": {"num_fewshot": 1}}
    # ... and through the chat template or not, as the dimension's setting says.
    plain = load_config("debug.yaml", ["eval.during_training.every_steps=10",
                                       "eval.dimensions.language_modeling.chat=false"])
    asked = yaml.safe_load(rank_config_yaml(plain))["eval"]["dimensions"]
    assert asked == {"language_modeling": {"chat": False}}
    other = load_config("debug.yaml", ["eval.during_training.every_steps=10",
                                       "eval.dimensions.math.num_fewshot=1"])
    assert rank_config_yaml(other) == rank_config_yaml(in_training)


def test_the_ranks_config_of_a_run_on_the_pipelines_own_pairs_is_valid() -> None:
    """A `kind: pairs` source needs the `pairs` section that places its file: the ranks' config
    holds it (they refused a config without it, and the preference stage failed on every rank)."""
    pairs = ["data.sources=[{kind: pairs}]", "pairs.instruction_types=[punctuation:no_comma]"]
    cfg = load_config("debug.yaml", ["preference.beta=0.1", "model.init_from=base", *pairs])
    ranks = Config.model_validate(yaml.safe_load(rank_config_yaml(cfg)))
    assert ranks.preference == cfg.preference and ranks.data == cfg.data


def test_the_summary_is_read_with_its_paths_under_the_configured_directory(tmp_path) -> None:
    """A stage reading train's output from another directory than train ran in (--upstream-run)
    finds its checkpoint."""
    summary = TrainResult(out_dir="artifacts/train", checkpoint="artifacts/train/checkpoints/step-00000020",
                          step=20, loss=1.0, tokens_seen=8, layout={})
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "train.json").write_text(json.dumps(dataclasses.asdict(summary)))
    read = read_train_summary(load_config("debug.yaml", [f"train.out_dir={tmp_path / 'elsewhere'}"]))
    assert read.checkpoint == str(tmp_path / "elsewhere" / "checkpoints" / "step-00000020")
    assert read.step == 20


def test_nonsensical_fine_tuning_is_refused_naming_the_key(tmp_path) -> None:
    """Before any work: packed conversations that would attend to each other (at config load),
    and adapters on random weights (before any stage runs)."""
    chats = ["data.sources=[{kind: chitchat}]", "sft.lora=null"]
    with pytest.raises(ConfigError, match="train.document_masking=false with sft"):
        load_config("debug.yaml", [*chats, "train.document_masking=false"])
    lora = load_config("debug.yaml", ["data.sources=[{kind: chitchat}]", "sft.lora.rank=4",
                                      f"train.out_dir={tmp_path / 'train'}"])
    with pytest.raises(ConfigError, match="sft.lora trains adapters on a base's frozen weights, but "
                                          "model.init_from is unset"):
        preflight_train(lora)
    assert not (tmp_path / "train").exists()
