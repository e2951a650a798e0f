"""No credential reaches MLflow params, tags or the config artifact."""

from __future__ import annotations

from forgeline.tasks.tracking import REDACTED, redact


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
