"""Eval-gated promotion against a real MLflow registry (sqlite store).

First one trained checkpoint is registered several times with synthetic per-item eval results of
known effect, through the register stage: `candidate` follows every new version and `champion`
only the ones the gate lets through; then `forgeline promote` and `forgeline compare` as a user
runs them. Then real runs: a barely trained model, one trained longer (better by construction),
and the latter again (identical), each trained, evaluated by lm-eval and registered; and the
champion evaluated again when a candidate has items it lacks. Last, `mlflow models serve` of the
champion answering a generation request."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient

from forgeline.configs import Config
from forgeline.flows.cli import main
from forgeline.tasks import evaluate
from forgeline.tasks.pretrained import CACHE_ENV
from forgeline.tasks.promote import CHAMPION_ALIAS, DECISION_TAG, EVIDENCE_TAG, EVIDENCE_TAG_PREFIX
from forgeline.tasks.register import CANDIDATE_ALIAS
from forgeline.tasks.runner import run_stage
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import resolve_tracking_uri
from forgeline.tasks.train.job import train_model
from tests.conftest import debug_config
from tests.integration.helpers import VENV_BIN, free_port, serving, user_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PLAN = {"math": {"tasks": ["forgeline_gsm8k"], "limit": 150, "num_fewshot": 0},
        "code": {"tasks": ["forgeline_mbpp"], "limit": 150, "num_fewshot": 0}}


def register_with_items(root: Path, data_root: Path, eval_dir: str, seed: str, suite: str = "synthetic",
                        **accuracy: float) -> tuple[Config, str]:
    """The register stage on the trained checkpoint under `root`, after an eval whose items.json
    holds 150 right/wrong answers per task drawn at these accuracies (by dimension), scored under
    suite fingerprint `suite`."""
    cfg = debug_config(root, f"data.out_dir={data_root / 'data'}", f"eval.out_dir={root / eval_dir}")
    write_synthetic_eval(root / eval_dir, seed, suite, **accuracy)
    result = run_stage(stage_named("register"), cfg)
    return cfg, result.version


def write_synthetic_eval(eval_dir: Path, seed: str, suite: str = "synthetic", **accuracy: float) -> None:
    """An eval stage's items.json and metrics.json in `eval_dir`: 150 right/wrong answers per task
    of PLAN, drawn at these accuracies (by dimension), under suite fingerprint `suite`."""
    rng = random.Random(seed)
    items = {entry["tasks"][0]: {"metric": "exact_match", "aggregation": "mean",
                                 "ids": [f"item-{i}" for i in range(150)],
                                 "values": [float(rng.random() < accuracy[name]) for _ in range(150)]}
             for name, entry in PLAN.items()}
    scores = {f"dimension/{name}": sum(items[PLAN[name]["tasks"][0]]["values"]) / 150 for name in PLAN}
    eval_dir.mkdir(exist_ok=True)
    suite_record = {"fingerprint": suite, "plan": PLAN}
    (eval_dir / "items.json").write_text(json.dumps({"suite": suite_record, "model": items}))
    (eval_dir / "metrics.json").write_text(json.dumps({"overall": sum(scores.values()) / 2, **scores}))


def aliases(client: MlflowClient, name: str) -> dict[str, str]:
    return {alias: str(client.get_model_version_by_alias(name, alias).version)
            for alias in (CANDIDATE_ALIAS, CHAMPION_ALIAS)}


def evidence(tags: dict[str, str]) -> dict[str, str]:
    """The intervals a decision rests on, which a version keeps in one JSON tag."""
    return json.loads(tags[EVIDENCE_TAG])


def test_champion_moves_only_when_the_gate_passes(tmp_path: Path, data_root: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    train_model(debug_config(tmp_path, f"data.out_dir={data_root / 'data'}", "train.peak_tflops=1"))
    cfg, first = register_with_items(tmp_path, data_root, "eval1", "a", math=0.3, code=0.3)
    client = MlflowClient(resolve_tracking_uri(cfg), resolve_tracking_uri(cfg))
    name = cfg.registry.model_name
    assert aliases(client, name) == {CANDIDATE_ALIAS: first, CHAMPION_ALIAS: first}
    assert client.get_model_version(name, first).tags[DECISION_TAG] == "promoted: no champion before"

    # Much better at math, much worse at code: a candidate, not the champion.
    _, second = register_with_items(tmp_path, data_root, "eval2", "b", math=0.9, code=0.1)
    assert aliases(client, name) == {CANDIDATE_ALIAS: second, CHAMPION_ALIAS: first}
    tags = client.get_model_version(name, second).tags
    assert tags[DECISION_TAG].startswith(f"rejected: versus version {first}; dimension code regressed: -0.")
    assert tags[EVIDENCE_TAG_PREFIX + "versus"] == f"version {first}"
    assert evidence(tags)["shared_items"] == "300"
    assert evidence(tags)["dimension/math"].startswith("+0.")

    # As good as the champion, drawn again: noise, inconclusive, with what would resolve it.
    _, third = register_with_items(tmp_path, data_root, "eval3", "c", math=0.3, code=0.3)
    tags = client.get_model_version(name, third).tags
    assert aliases(client, name)[CHAMPION_ALIAS] == first
    assert tags[DECISION_TAG].startswith(f"inconclusive: versus version {first}; overall ")
    assert "the smallest overall difference these items detect" in evidence(tags)["resolution"]

    # Better in both: promoted.
    _, fourth = register_with_items(tmp_path, data_root, "eval4", "d", math=0.6, code=0.6)
    assert aliases(client, name) == {CANDIDATE_ALIAS: fourth, CHAMPION_ALIAS: fourth}
    assert client.get_model_version(name, fourth).tags[DECISION_TAG].startswith(
        f"promoted: versus version {first}; overall +0.")

    # Evaluated under a suite this code and data do not render: the champion cannot be evaluated
    # on its items, so nothing is compared -- the version stays registered, the champion stays.
    _, fifth = register_with_items(tmp_path, data_root, "eval5", "e", suite="elsewhere", math=0.9, code=0.9)
    assert aliases(client, name) == {CANDIDATE_ALIAS: fifth, CHAMPION_ALIAS: fourth}
    assert client.get_model_version(name, fifth).tags[DECISION_TAG].startswith(
        f"inconclusive: versus version {fourth}; not compared: the champion {name}/{fourth} must be "
        "evaluated on the candidate's items (another suite")

    registry = ["--config", "debug.yaml", "--set", f"registry.tracking_uri={resolve_tracking_uri(cfg)}"]
    # The gate still rejects version 2 against the new champion; --force rolls back to version 1.
    assert main(["promote", "--version", second, *registry]) == 1
    assert f"stays behind @champion (version {fourth}), rejected: " in capsys.readouterr().out
    assert main(["promote", "--version", first, "--force", *registry]) == 0
    assert capsys.readouterr().out.startswith(f"{name} version {first} is now @champion (forced over version "
                                              f"{fourth})")
    assert client.get_model_version(name, first).tags[DECISION_TAG] == \
        f"promoted: forced over version {fourth}"
    assert aliases(client, name)[CHAMPION_ALIAS] == first

    runs = [client.get_model_version(name, v).run_id for v in (first, fourth)]
    assert main(["compare", *runs, "--diff-only", *registry]) == 0
    out = capsys.readouterr().out
    table = out.splitlines()
    assert table[0].split() == runs
    assert any(line.split()[:2] == ["*", "eval.out_dir"] for line in table)
    assert not any(line.split()[1:2] == ["model.dim"] for line in table)
    paired = out.split(f"paired on shared items, {runs[1]} - {runs[0]}:\n")[1].splitlines()
    assert paired[0].split() == ["difference", "95", "%", "interval", "shared", "items"]
    overall = paired[-1].split()
    assert overall[0] == "overall" and float(overall[1]) > 0 and overall[-1] == "300"


# Held-out bits per byte only: the one score a tiny model moves by training (the others sit at
# chance, where two models differ by noise alone).
HELDOUT_ONLY = "eval.dimensions={language_modeling: {tasks: [forgeline_heldout], limit: 20}}"


def trained_evaluated_registered(root: Path, data_root: Path, registry: Path, steps: int,
                                 *overrides: str) -> tuple[Config, str]:
    """The train, eval and register stages for a fresh run under `root`, into one registry."""
    cfg = debug_config(root, f"data.out_dir={data_root / 'data'}", f"train.steps={steps}",
                       "train.peak_tflops=1", "train.warmup_steps=0", HELDOUT_ONLY,
                       f"registry.tracking_uri=sqlite:///{registry / 'mlflow.db'}",
                       f"registry.artifact_location={registry / 'mlartifacts'}", *overrides)
    for stage in ("train", "eval"):
        run_stage(stage_named(stage), cfg)
    return cfg, run_stage(stage_named("register"), cfg).version


def test_a_better_model_is_promoted_an_identical_one_is_not_and_a_champion_is_re_evaluated(
        tmp_path: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    cfg, barely = trained_evaluated_registered(tmp_path / "barely", data_root, tmp_path, steps=2)
    client = MlflowClient(resolve_tracking_uri(cfg), resolve_tracking_uri(cfg))
    name = cfg.registry.model_name
    assert aliases(client, name)[CHAMPION_ALIAS] == barely

    # 40 steps from the same start: lower held-out bits per byte on every document.
    longer_cfg, longer = trained_evaluated_registered(tmp_path / "longer", data_root, tmp_path, steps=40)
    tags = client.get_model_version(name, longer).tags
    assert aliases(client, name)[CHAMPION_ALIAS] == longer, tags[DECISION_TAG]
    assert tags[DECISION_TAG].startswith(f"promoted: versus version {barely}; overall +0.")

    # The same 40 steps again (training is deterministic): identical on every item, no move.
    _, again = trained_evaluated_registered(tmp_path / "again", data_root, tmp_path, steps=40)
    assert aliases(client, name) == {CANDIDATE_ALIAS: again, CHAMPION_ALIAS: longer}
    assert client.get_model_version(name, again).tags[DECISION_TAG].endswith(
        "identical results on every shared item")

    # The eval of a registered run rerun: the same scores, so no new version and no move.
    versions = len(client.search_model_versions(f"name = '{name}'"))
    run_stage(stage_named("eval"), longer_cfg, force=True)
    assert run_stage(stage_named("register"), longer_cfg).version == longer
    assert len(client.search_model_versions(f"name = '{name}'")) == versions
    assert aliases(client, name)[CHAMPION_ALIAS] == longer

    # A candidate evaluated on 30 held-out documents: the champion's 20 do not cover them, so the
    # champion's registered export is evaluated on the 30 first -- once: the next decision reads
    # it from the cache.
    loads = []
    real_lm = evaluate.ForgelineLM
    monkeypatch.setattr(evaluate, "ForgelineLM", lambda **kwargs: loads.append(kwargs) or real_lm(**kwargs))
    more_items = "eval.dimensions.language_modeling.limit=30"
    _, other = trained_evaluated_registered(tmp_path / "more-items", data_root, tmp_path, 40, more_items)
    # The run's, then the champion's: scored in the run's windows and precision.
    scoring = {"tokenizer", "max_length", "precision", "batch_size"}
    assert [set(load) for load in loads] == [{"checkpoint"} | scoring, {"hf"} | scoring]
    assert [load["precision"] for load in loads] == ["fp32", "fp32"]
    # The same weights, the champion's through its Hugging Face export: equal to rounding.
    tags = client.get_model_version(name, other).tags
    assert tags[DECISION_TAG].startswith(f"inconclusive: versus version {longer}; overall "), \
        tags[DECISION_TAG]
    assert abs(float(evidence(tags)["overall"].split()[0])) < 1e-4
    assert evidence(tags)["shared_items"] == "30"
    registry = ["--config", "debug.yaml", "--set", f"registry.tracking_uri={resolve_tracking_uri(cfg)}",
                "--set", f"data.out_dir={data_root / 'data'}"]
    assert main(["promote", "--version", other, *registry]) == 1
    assert len(loads) == 2


# Held-out bits per byte, which training moves, and two reasoning tasks, at chance for models this
# small: their noise widens the overall interval around 0, as the dimensions at chance did for the
# user of issue 29.
LANGUAGE_AND_CHANCE = ("eval.dimensions={language_modeling: {tasks: [forgeline_heldout], limit: 20}, "
                       "reasoning: {tasks: [forgeline_piqa, forgeline_boolq], limit: 20}}")


def test_a_shorter_trained_candidate_is_rejected_naming_the_dimension_it_lost(
        tmp_path: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """10 steps against 40 from the same start: worse held-out bits per byte on every document,
    at chance in reasoning like the champion. Rejected on language modelling, even with a
    trade-off tolerance no loss here reaches (max_dimension_regression=0.5), though the overall
    interval holds 0 -- which the gate called inconclusive, advising more items."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    cfg, champion = trained_evaluated_registered(tmp_path / "longer", data_root, tmp_path, 40,
                                                 LANGUAGE_AND_CHANCE)
    _, candidate = trained_evaluated_registered(tmp_path / "shorter", data_root, tmp_path, 10,
                                                LANGUAGE_AND_CHANCE, "registry.max_dimension_regression=0.5")
    client = MlflowClient(resolve_tracking_uri(cfg), resolve_tracking_uri(cfg))
    name = cfg.registry.model_name
    assert aliases(client, name) == {CANDIDATE_ALIAS: candidate, CHAMPION_ALIAS: champion}
    tags = client.get_model_version(name, candidate).tags
    assert tags[DECISION_TAG].startswith(f"rejected: versus version {champion}; dimension language_modeling "
                                         "regressed: -0."), tags[DECISION_TAG]
    assert tags[DECISION_TAG].endswith("worse with 95 % confidence, and no dimension is better"), tags
    interval = evidence(tags)["overall"].split("[")[1].rstrip("]")
    low, high = (float(bound) for bound in interval.split(", "))
    assert low < 0 < high, tags  # the overall alone would have decided nothing
    assert "resolution" not in evidence(tags)  # no advice to evaluate more items


def test_mlflow_models_serve_answers_a_generation_request(tmp_path: Path, data_root: Path) -> None:
    train_model(debug_config(tmp_path, f"data.out_dir={data_root / 'data'}", "train.peak_tflops=1"))
    cfg, version = register_with_items(tmp_path, data_root, "eval", "a", math=0.3, code=0.3)
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
