"""The pairs stage end to end on a tiny random model with a ChatML template: prompts made, replies
sampled through the template and checked by lm-eval's registry, pairs.jsonl and the manifest
written, the run recorded in MLflow; the same seed makes the same pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from forgeline.configs import Config, ConfigError
from forgeline.configs.schema import IFEVAL_INSTRUCTION_TYPES
from forgeline.tasks.pairs.build import make_pairs, preflight_pairs
from forgeline.tasks.pairs.checks import DROP_REASONS, Prompt, followed
from forgeline.tasks.runner import STAGE_TAG, run_stage
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import resolve_tracking_uri
from tests.chat import save_chat_export
from tests.conftest import debug_config

TRAINED = ["punctuation:no_comma"]  # a random model's reply holds a comma or not by chance: both come

PROMPTS, K = 6, 8


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chat_export(tmp_path_factory.mktemp("policy"))  # max_seq_len 128


def pairs_config(root: Path, export: Path, *overrides: str) -> Config:
    return debug_config(root, "preference.beta=0.1", f"model.init_from={export}",
                        "data.sources=[{kind: pairs}]", f"pairs.instruction_types=[{', '.join(TRAINED)}]",
                        f"pairs.out_dir={root / 'pairs'}", f"pairs.num_prompts={PROMPTS}",
                        f"pairs.samples_per_prompt={K}", "pairs.max_new_tokens=96", "pairs.temperature=1.0",
                        "pairs.batch_size=8", "pairs.pairs_per_prompt=2", *overrides)


def test_the_stage_samples_checks_and_writes_pairs_and_a_manifest(tmp_path: Path, export: Path) -> None:
    cfg = pairs_config(tmp_path, export)
    result = run_stage(stage_named("pairs"), cfg)
    out = Path(cfg.pairs.out_dir)
    records = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    manifest = json.loads((out / "manifest.json").read_text())

    assert result.pairs == manifest["pairs"] == len(records) > 0
    assert manifest["prompts"]["made"] == PROMPTS and manifest["prompts"]["excluded_ifeval_overlap"] > 0
    assert manifest["instruction_types"] == {
        "trained": TRAINED, "held_out": [t for t in IFEVAL_INSTRUCTION_TYPES if t not in TRAINED]}
    assert manifest["samples_per_prompt"] == K and manifest["replies"]["sampled"] == PROMPTS * K
    assert manifest["pass_rate"]["punctuation:no_comma"]["checks"] == PROMPTS * K
    assert set(manifest["dropped"]) == set(DROP_REASONS)
    prompts_paired = len({record["prompt"][0]["content"] for record in records})
    assert prompts_paired < len(records)  # a prompt gave two pairs (pairs_per_prompt)
    assert prompts_paired + sum(manifest["dropped"].values()) == PROMPTS
    assert manifest["generation"]["new_tokens"] > 0 and manifest["generation"]["precision"] == "fp32"
    assert manifest["base"]["uri"] == str(export)

    for record in records:  # the format the data stage reads, each pair as the registry judges it
        assert set(record) == {"prompt", "chosen", "rejected", "instruction_ids", "kwargs", "source"}
        assert [m["role"] for m in record["prompt"] + record["chosen"] + record["rejected"]] == [
            "user", "assistant", "assistant"]
        assert set(record["instruction_ids"]) <= set(TRAINED)
        prompt = Prompt(record["prompt"][0]["content"], record["instruction_ids"], record["kwargs"],
                        record["source"])
        assert all(followed(prompt, record["chosen"][0]["content"]))
        assert not all(followed(prompt, record["rejected"][0]["content"]))

    client = MlflowClient(resolve_tracking_uri(cfg))
    experiment = client.get_experiment_by_name(cfg.registry.experiment).experiment_id
    [run] = client.search_runs([experiment], f"tags.`{STAGE_TAG}` = 'pairs'")
    assert run.data.metrics["pairs"] == len(records)
    assert run.data.metrics["replies_sampled"] == PROMPTS * K
    assert run.data.params["pairs.samples_per_prompt"] == str(K)
    assert [a.path for a in client.list_artifacts(run.info.run_id, "pairs")] == ["pairs/manifest.json"]


def test_the_same_seed_makes_the_same_pairs(tmp_path: Path, export: Path) -> None:
    """Prompts, the registry's arguments and the sampled replies alike (the prompts' dependence on
    the seed: test_pairs_prompts)."""
    made = []
    for name in ("first", "again"):
        cfg = pairs_config(tmp_path / name, export)
        make_pairs(cfg)
        made.append((Path(cfg.pairs.out_dir) / "pairs.jsonl").read_bytes())
    assert made[0] == made[1] and made[0]


def test_a_reply_budget_the_context_cannot_hold_is_refused(tmp_path: Path, export: Path) -> None:
    with pytest.raises(ConfigError, match=r"pairs.max_new_tokens=128 leaves no room for a prompt in the "
                                          r"base's 128-token context"):
        preflight_pairs(pairs_config(tmp_path, export, "pairs.max_new_tokens=128"))


def test_a_reply_budget_a_row_cannot_hold_twice_is_said_before_sampling(tmp_path: Path, export: Path,
                                                                        caplog) -> None:
    with caplog.at_level("WARNING", logger="forgeline"):
        preflight_pairs(pairs_config(tmp_path, export, "data.seq_len=192"))  # 2 x 96 fit
        assert "do not fit one row" not in caplog.text
        preflight_pairs(pairs_config(tmp_path, export, "data.seq_len=191"))
    assert "two replies of pairs.max_new_tokens=96 do not fit one row of data.seq_len=191 + 1" in caplog.text
