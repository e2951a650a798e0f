"""What tracking records beyond metrics: no credential reaches MLflow params, tags or the config
artifact; the layout and dvc.lock's output hashes become tags; run names say what ran; the
experiment opens on its runs in the MLflow UI."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from forgeline.configs import load_config
from forgeline.tasks.tracking import (
    EXPERIMENT_KIND_TAG,
    REDACTED,
    TRAINING_KIND,
    experiment_id,
    layout_label,
    redact,
    run_context_tags,
    run_name,
)

CLEAN = {"git.commit": "1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d", "git.dirty": "false"}


def test_credential_keys_are_redacted_by_their_last_part() -> None:
    assert redact("ops.webhook_url", "https://hooks.example/T0/B0/x") == REDACTED
    assert redact("hf_token", "hf_abc") == REDACTED
    assert redact("registry.password", "p") == REDACTED


def test_counts_that_merely_mention_tokens_are_kept() -> None:
    assert redact("train.tokens_seen", 1024) == 1024
    assert redact("eval.max_new_tokens", "64") == "64"


def test_a_password_inside_a_url_is_redacted_wherever_it_appears() -> None:
    assert redact("registry.tracking_uri", "postgresql://ml:hunter2@db:5432/mlflow") == \
        f"postgresql://ml:{REDACTED}@db:5432/mlflow"
    assert redact("", {"registry": {"tracking_uri": "https://u:p@h", "api_key": "k"}}) == \
        {"registry": {"tracking_uri": f"https://u:{REDACTED}@h", "api_key": REDACTED}}


def test_the_layout_is_a_tag_and_an_earlier_runs_dvc_lock_is_not(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """dvc.lock, read as a run starts, holds the previous run's hashes (forgeline records each
    stage in it as the stage ends): none of them may pass for this run's lineage."""
    cfg = load_config("debug.yaml", ["parallel.dp_shard=2", "parallel.tp=2"])
    monkeypatch.chdir(tmp_path)
    lock = {"schema": "2.0", "stages": {"data": {"cmd": "forgeline stage data", "outs": [
        {"path": "artifacts/data", "hash": "md5", "md5": "0123456789abcdef0123456789abcdef.dir"}]}}}
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    assert run_context_tags(cfg) == {
        "forgeline.layout": "pp1 x dp_replicate1 x dp_shard2 x tp2 = 4 ranks on 1 node(s)"}


def test_a_run_name_says_what_ran_for_which_config_on_which_layout_at_which_commit() -> None:
    cfg = load_config("tiny.yaml")
    assert run_name("train", cfg, with_layout=True, code=CLEAN) == "train tiny pp2xdp2 @1a2b3c4"
    assert run_name("eval", cfg, with_layout=False, code=CLEAN | {"git.dirty": "true"}) == \
        "eval tiny @1a2b3c4-dirty"
    outside_git = {"git.commit": "unknown", "git.dirty": "unknown"}
    assert run_name("pipeline", cfg, with_layout=True, code=outside_git) == "pipeline tiny pp2xdp2"
    mine = cfg.with_values({"registry.model_name": "mine"})  # a model name without forgeline-: whole
    assert run_name("pipeline", mine, with_layout=False, code=outside_git) == "pipeline mine"


@pytest.mark.parametrize(("overrides", "label"), [
    ([], "dp1"),
    (["parallel.dp_shard=2", "parallel.tp=2"], "dp2xtp2"),
    (["parallel.dp_replicate=2", "parallel.dp_shard=2"], "dp4"),
])
def test_the_layout_label_names_the_degrees_above_one_and_always_dp(overrides: list[str], label: str) -> None:
    assert layout_label(load_config("debug.yaml", overrides)) == label


def test_the_experiment_is_marked_as_holding_training_runs_unless_a_kind_is_set(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)

    def kind_after_experiment_id(name: str) -> str:
        cfg = load_config("debug.yaml", [f"registry.tracking_uri={uri}", f"registry.experiment={name}",
                                         f"registry.artifact_location={tmp_path / 'mlartifacts'}"])
        return client.get_experiment(experiment_id(client, cfg)).tags[EXPERIMENT_KIND_TAG]

    assert kind_after_experiment_id("new") == TRAINING_KIND
    client.create_experiment("made-before-the-tag")
    assert kind_after_experiment_id("made-before-the-tag") == TRAINING_KIND
    client.create_experiment("chosen-in-the-ui", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    assert kind_after_experiment_id("chosen-in-the-ui") == "genai_development"
