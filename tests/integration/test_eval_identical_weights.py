"""Identical weights score identically: a run continued from a base with a learning rate of
1e-30 holds the base's weights, so its eval must find no difference from the base on any item,
and its registration must take neither its base nor the champion it was continued from for a
worse or better model.

The base is one no other test uses, made as a user's model is: a small random
`LlamaForCausalLM` with untied embeddings, saved in bfloat16 by `save_pretrained` with the
tokenizer of a chat model -- whose end-of-text token (`<|im_end|>`) is not the one the data
stage separates documents with (`<|endoftext|>`, data.special_tokens). The first run trains
from its directory in pp2 x dp2 and is registered: with no champion it faces its base, and is not
crowned (inconclusive, identical on every item); crowned with --force, the second continues from
`models:/NAME@champion` in pp2, so its candidate is the champion's weights again.
Real torchrun ranks, lm-eval, MLflow (sqlite registry)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from forgeline.configs import Config
from forgeline.tasks.data.build import train_tokenizer
from forgeline.tasks.pretrained import CACHE_ENV
from forgeline.tasks.promote import CHAMPION_ALIAS, DECISION_TAG, aliased, promote
from forgeline.tasks.runner import run_stage
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import resolve_tracking_uri
from tests.conftest import debug_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The debug config's model keys (configs/debug.yaml), which a base must fit.
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=176, max_position_embeddings=512)
ALMOST_NO_LEARNING = ["train.lr=1e-30", "train.warmup_steps=0", "train.steps=2", "train.val_every=0",
                      "train.peak_tflops=1", "checkpoint.every_steps=100"]
TOLERANCE = dict(rel=1e-6, abs=1e-6)  # float rounding, far below any real change


@pytest.fixture(scope="module")
def chat_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("chat-base") / "tiny-chat-llama"
    texts = ["Now is the winter of our discontent made glorious summer by this sun of York; and all the "
             "clouds that lour'd upon our house in the deep bosom of the ocean buried."] * 4
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(texts, 400, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
        bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tokenizer.save_pretrained(directory)
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, vocab_size=len(tokenizer), tie_word_embeddings=False,
                                         rms_norm_eps=1e-5, rope_theta=10000.0))
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory


def run_config(root: Path, registry: Path, init_from: str | Path, *overrides: str) -> Config:
    return debug_config(root, f"model.init_from={init_from}", *ALMOST_NO_LEARNING,
                        f"registry.tracking_uri=sqlite:///{registry / 'mlflow.db'}",
                        f"registry.artifact_location={registry / 'mlartifacts'}", *overrides)


def run_pipeline(cfg: Config) -> str:
    """The data, train, eval and register stages; the registered version."""
    for stage in ("data", "train", "eval"):
        run_stage(stage_named(stage), cfg)
    return run_stage(stage_named("register"), cfg).version


def assert_scored_as_its_base(cfg: Config) -> None:
    """Every item of every task scored alike for the run and its base, and no change reported."""
    eval_dir = Path(cfg.eval.out_dir)
    items = json.loads((eval_dir / "items.json").read_text())
    for task, ours in items["model"].items():
        theirs = items["base"][task]
        assert ours["ids"] == theirs["ids"] and ours["ids"], task
        for item, mine, base in zip(ours["ids"], ours["values"], theirs["values"], strict=True):
            assert mine == pytest.approx(base, **TOLERANCE), f"{task} item {item}: run {mine}, base {base}"
    metrics = json.loads((eval_dir / "metrics.json").read_text())
    changes = {key: value for key, value in metrics.items()
               if key.startswith("versus_base/") and not key.startswith("versus_base/stderr/")}
    assert "versus_base/overall" in changes and len(changes) > 1  # overall and each dimension
    assert changes == pytest.approx(dict.fromkeys(changes, 0.0), **TOLERANCE)
    assert items["suite"]["scoring"]["max_length"] == SHAPE["max_position_embeddings"]  # the run's context
    assert items["suite"]["scoring"]["precision"] == "fp32"  # eval.precision auto, on the CPU


def test_a_run_that_kept_its_bases_weights_scores_as_its_base_and_is_not_promoted(
        chat_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    first = run_config(tmp_path / "first", tmp_path, chat_base, "parallel.pp=2", "parallel.dp_shard=2")
    champion = run_pipeline(first)
    assert_scored_as_its_base(first)
    client = MlflowClient(resolve_tracking_uri(first), resolve_tracking_uri(first))
    name = first.registry.model_name
    decision = client.get_model_version(name, champion).tags[DECISION_TAG]
    assert decision.startswith(f"inconclusive: versus its base {first.model.init_from}; "), decision
    assert decision.endswith("identical results on every shared item"), decision
    assert aliased(client, name, CHAMPION_ALIAS) is None
    promote(first, client, champion, force=True)
    assert str(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version) == champion

    second = run_config(tmp_path / "second", tmp_path, f"models:/{name}@{CHAMPION_ALIAS}", "parallel.pp=2")
    candidate = run_pipeline(second)
    assert_scored_as_its_base(second)
    decision = client.get_model_version(name, candidate).tags[DECISION_TAG]
    assert decision.startswith("inconclusive"), decision
    assert decision.endswith("identical results on every shared item"), decision
    assert str(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version) == champion
