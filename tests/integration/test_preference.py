"""Preference tuning end to end through `forgeline run`: a base (a tiny random Llama with SmolLM2's
real tokenizer and chat template) tuned with DPO and LoRA on preference pairs from a JSONL file, on
two data-parallel ranks -- real Prefect, torchrun, lm-eval and an MLflow sqlite store. The pipeline
is pairs -> data -> preference -> eval -> register; the reference's log-probabilities are computed once,
before the first step, and read back by every later start of the same base on the same data; a
rank killed mid-run resumes from the last checkpoint and, in deterministic mode, ends with the
weights of a run that was never interrupted; the steps log TRL's metrics."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient

from forgeline.configs import load_config
from forgeline.model.inference import load_from_checkpoint
from forgeline.model.training.preference import STATS
from forgeline.model.training.shards import read_manifest
from forgeline.tasks.data.chat import conversation_of
from forgeline.tasks.data.sources import read_chitchat
from forgeline.tasks.runner import STAGE_TAG
from tests.conftest import REPO_ROOT
from tests.integration.helpers import VENV_BIN, run, user_env
from tests.integration.test_sft import save_base
from tests.smollm2_tokenizer import MISSING, SKIP_REASON

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(bool(MISSING), reason=SKIP_REASON)]
STEPS = 6


def write_pairs(path: Path, count: int) -> None:
    """Pairs of Chit-Chat replies: a conversation's first user turn, its own reply chosen, the reply
    of a conversation further on rejected (whether it teaches anything does not matter here)."""
    conversations = [conversation_of(document.data.decode())
                     for _, document in zip(range(3 * count), read_chitchat("chitchat"), strict=False)]
    replies = [[m["content"] for m in c if m["role"] == "assistant"] for c in conversations]
    with path.open("w") as out:
        written = 0
        for i, conversation in enumerate(conversations):
            if written == count:
                break
            other = replies[(i + 7) % len(replies)]
            opens = [message["role"] for message in conversation[:2]]
            if opens == ["user", "assistant"] and other:
                pair = {"prompt": conversation[0]["content"], "chosen": conversation[1]["content"],
                        "rejected": other[0]}
                out.write(json.dumps(pair) + "\n")
                written += 1


def write_config(root: Path) -> Path:
    write_pairs(root / "pairs.jsonl", 140)
    save_base(root / "base")
    config = {
        "inherit": "debug.yaml",
        # The pipeline's own pairs too: the pairs stage runs first (a random model's replies run to
        # the budget, and are in no pair: the file's make the training).
        "data": {"sources": [{"kind": "files", "path": str(root / "pairs.jsonl"), "format": "preference"},
                             {"kind": "pairs"}],
                 "seq_len": 256, "val_fraction": 0.2},
        "pairs": {"instruction_types": ["punctuation:no_comma"], "num_prompts": 8, "samples_per_prompt": 2,
                  "max_new_tokens": 16, "batch_size": 8},
        "model": {"init_from": str(root / "base")},
        "preference": {"beta": 0.1, "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}},
        "parallel": {"dp_shard": 2},
        "train": {"steps": STEPS, "warmup_steps": 1, "lr": 1e-2, "val_every": 3, "val_batches": 1,
                  "deterministic": True, "max_restarts": 1},
        "checkpoint": {"every_steps": 3, "keep_last": 3},
        "eval": {"dimensions": {"instruction_following": {"limit": 2}, "language_modeling": {"limit": 2}}},
        "registry": {"experiment": "forgeline-dpo", "model_name": "forgeline-dpo"},
    }
    path = root / "dpo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def kill_before(step: int, marker: Path) -> str:
    entry = [{"path": "tests.faults:KillBefore", "args": {"step": step, "once": str(marker)}}]
    return "train.callbacks=" + yaml.safe_dump(entry, default_flow_style=True, width=10**6).strip()


def test_forgeline_run_tunes_preferences_resumes_a_killed_rank_and_registers(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    forgeline = str(VENV_BIN / "forgeline")
    env = {"PYTHONPATH": str(REPO_ROOT)}  # the ranks import tests.faults
    refused = subprocess.run([forgeline, "stage", "sft", "--config", str(config)], cwd=tmp_path,
                             env=user_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "run `forgeline stage preference` instead of sft" in refused.stderr

    marker = tmp_path / "killed"
    done = run([forgeline, "run", "--config", str(config), "--set", kill_before(5, marker)], tmp_path,
               timeout=1800, env=env)
    assert marker.is_file()  # rank 0 died before step 5; torchrun restarted the ranks
    assert "Registered model: forgeline-dpo version 1" in done.stdout
    cfg = load_config(config)
    made = json.loads((tmp_path / cfg.pairs.out_dir / "manifest.json").read_text())
    assert made["replies"]["sampled"] == 16 and made["prompts"]["made"] == 8
    manifest = read_manifest(tmp_path / cfg.data.out_dir)
    assert manifest["sources"]["pairs"]["input"]["documents"] == made["pairs"]
    assert manifest["preference"] is True and manifest["splits"]["train"]["pairs"] > 0
    log = (tmp_path / "artifacts/logs/preference.log").read_text()
    computed = re.findall(r"reference log-probabilities of (\d+) train \+ (\d+) val samples", log)
    samples = manifest["splits"]
    assert computed == [(str(samples["train"]["samples"]), str(samples["val"]["samples"]))]
    assert re.search(r"reference log-probabilities from \S+\.reference/", log)  # the restart read them

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [train_run] = client.search_runs(client.get_experiment_by_name("forgeline-dpo").experiment_id,
                                     f"tags.`{STAGE_TAG}` = 'preference'")
    for name in ("loss", *STATS):  # one curve through the restart, every step
        assert [m.step for m in client.get_metric_history(train_run.info.run_id, name)] == list(range(1, 7))
    assert {"val/loss", "val/rewards/accuracies"} <= set(train_run.data.metrics)
    assert "train/best_val_bpb" not in train_run.data.metrics  # a preference loss has no bits per byte

    uninterrupted = run([forgeline, "stage", "preference", "--config", str(config), "--set",
                         "run.name=uninterrupted"], tmp_path, timeout=1200, env=env)
    log = (tmp_path / "artifacts/logs/preference.log").read_text()  # appended to: the second run's part
    second = log[log.rindex("==== stage preference"):]
    assert re.search(r"reference log-probabilities from \S+\.reference/", second)  # the cached ones, again
    assert len(re.findall(r"reference log-probabilities of \d+ train", log)) == 1  # computed once in all
    resumed = load_from_checkpoint(tmp_path / cfg.train.out_dir / "checkpoints/step-00000006").state_dict()
    clean = load_from_checkpoint(tmp_path / "artifacts/uninterrupted/train/checkpoints/step-00000006")
    clean = clean.state_dict()
    assert resumed.keys() == clean.keys() and all(torch.equal(resumed[k], clean[k]) for k in resumed), \
        uninterrupted.stdout[-2000:]
