"""What tracking records beyond metrics: no credential reaches MLflow params, tags or the config
artifact; the layout and dvc.lock's output hashes become tags."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from forgeline.configs import load_config
from forgeline.tasks.tracking import REDACTED, redact, run_context_tags


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


def test_layout_and_dvc_lock_hashes_become_tags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config("debug.yaml", ["parallel.dp_shard=2", "parallel.tp=2"])
    monkeypatch.chdir(tmp_path)
    assert run_context_tags(cfg) == {
        "forgeline.layout": "pp1 x dp_replicate1 x dp_shard2 x tp2 = 4 ranks on 1 node(s)"}
    lock = {"schema": "2.0", "stages": {"data": {"cmd": "forgeline stage data", "outs": [
        {"path": "artifacts/data", "hash": "md5", "md5": "0123456789abcdef0123456789abcdef.dir"}]}}}
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    assert run_context_tags(cfg)["dvc.lock.data.artifacts/data"] == "0123456789abcdef0123456789abcdef.dir"
