"""Eval-gated promotion against a real MLflow registry (sqlite store): one trained checkpoint is
registered three times with different eval outcomes, through the register stage; `candidate`
follows every new version and `champion` only the ones the gate lets through. Then
`forgeline promote` and `forgeline compare` as a user runs them, and `mlflow models serve` of
the champion answering a generation request."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient

from forgeline.configs import Config
from forgeline.flows.cli import main
from forgeline.tasks.promote import CHAMPION_ALIAS, DECISION_TAG
from forgeline.tasks.register import CANDIDATE_ALIAS
from forgeline.tasks.runner import run_stage
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import resolve_tracking_uri
from forgeline.tasks.train.job import train_model
from tests.conftest import debug_config
from tests.integration.helpers import VENV_BIN, free_port, serving, user_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GATE = ("registry.promotion_margin=0.01", "registry.max_dimension_regression=0.05")


def register_with_scores(root: Path, data_root: Path, eval_dir: str, overall: float,
                         **dimensions: float) -> tuple[Config, str]:
    """The register stage on the trained checkpoint under `root`, after an eval with these scores."""
    cfg = debug_config(root, f"data.out_dir={data_root / 'data'}", f"eval.out_dir={root / eval_dir}", *GATE)
    metrics = {"overall": overall, **{f"dimension/{k}": v for k, v in dimensions.items()}}
    (root / eval_dir).mkdir()
    (root / eval_dir / "metrics.json").write_text(json.dumps(metrics))
    result = run_stage(stage_named("register"), cfg)
    return cfg, result.version


def aliases(client: MlflowClient, name: str) -> dict[str, str]:
    return {alias: str(client.get_model_version_by_alias(name, alias).version)
            for alias in (CANDIDATE_ALIAS, CHAMPION_ALIAS)}


def test_champion_moves_only_when_the_gate_passes(tmp_path: Path, data_root: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    train_model(debug_config(tmp_path, f"data.out_dir={data_root / 'data'}", "train.peak_tflops=1"))
    cfg, first = register_with_scores(tmp_path, data_root, "eval1", 0.30, math=0.30, code=0.30)
    client = MlflowClient(resolve_tracking_uri(cfg), resolve_tracking_uri(cfg))
    name = cfg.registry.model_name
    assert aliases(client, name) == {CANDIDATE_ALIAS: first, CHAMPION_ALIAS: first}

    # Better overall, but math regresses by 0.1 (> 0.05): a candidate, not the champion.
    _, second = register_with_scores(tmp_path, data_root, "eval2", 0.40, math=0.20, code=0.60)
    assert aliases(client, name) == {CANDIDATE_ALIAS: second, CHAMPION_ALIAS: first}
    assert client.get_model_version(name, second).tags[DECISION_TAG].startswith(
        "rejected: dimension math fell 0.1000")

    # Overall above 0.30 + 0.01 and no dimension down more than 0.05: promoted.
    _, third = register_with_scores(tmp_path, data_root, "eval3", 0.32, math=0.27, code=0.37)
    assert aliases(client, name) == {CANDIDATE_ALIAS: third, CHAMPION_ALIAS: third}
    assert client.get_model_version(name, third).tags[DECISION_TAG] == "promoted"

    registry = ["--config", "debug.yaml", "--set", f"registry.tracking_uri={resolve_tracking_uri(cfg)}", *(
        arg for setting in GATE for arg in ("--set", setting))]
    # The gate still rejects version 2 against the new champion; --force rolls back to version 1.
    assert main(["promote", "--version", second, *registry]) == 1
    assert "stays behind @champion (version 3)" in capsys.readouterr().out
    assert main(["promote", "--version", first, "--force", *registry]) == 0
    assert capsys.readouterr().out.startswith(f"{name} version {first} is now @champion")
    assert aliases(client, name)[CHAMPION_ALIAS] == first

    runs = [client.get_model_version(name, v).run_id for v in (first, third)]
    assert main(["compare", *runs, "--diff-only", *registry]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == runs
    assert any(line.split()[:2] == ["*", "eval.out_dir"] for line in table)
    assert not any(line.split()[1:2] == ["model.dim"] for line in table)


def test_mlflow_models_serve_answers_a_generation_request(tmp_path: Path, data_root: Path) -> None:
    train_model(debug_config(tmp_path, f"data.out_dir={data_root / 'data'}", "train.peak_tflops=1"))
    cfg, version = register_with_scores(tmp_path, data_root, "eval", 0.3, math=0.3)
    port = free_port()
    env = user_env(tmp_path) | {"MLFLOW_TRACKING_URI": resolve_tracking_uri(cfg)}
    cmd = [str(VENV_BIN / "mlflow"), "models", "serve", "-m", f"models:/{cfg.registry.model_name}@champion",
           "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)]
    with serving(cmd, env, tmp_path / "serve.log", f"http://127.0.0.1:{port}/ping"):
        answer = httpx.post(f"http://127.0.0.1:{port}/invocations", timeout=120, json={
            "dataframe_records": [{"prompt": "ROMEO:"}, {"prompt": "JULIET:"}],
            "params": {"max_new_tokens": 8}})
    assert answer.status_code == 200, answer.text
    predictions = answer.json()["predictions"]
    assert len(predictions) == 2 and all(isinstance(text, str) and text for text in predictions)
