"""Supervised fine-tuning end to end through `forgeline run`: a base (a tiny random Llama with
SmolLM2's real tokenizer and chat template) fine-tuned with LoRA on conversations from a JSONL
file, on two data-parallel ranks -- real Prefect, torchrun, lm-eval and an MLflow sqlite store.
The pipeline is data -> sft -> eval -> register; the stage of the other pipeline is refused
before any work."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import mlflow
import pytest
import torch
import yaml
from mlflow import MlflowClient

from forgeline.configs import load_config
from forgeline.model.training.shards import read_manifest
from forgeline.tasks.data.chat import conversation_of
from forgeline.tasks.data.sources import read_chitchat
from forgeline.tasks.runner import STAGE_TAG
from tests.integration.helpers import VENV_BIN, run, user_env
from tests.smollm2_tokenizer import MISSING, SKIP_REASON, smollm2_tokenizer_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(bool(MISSING), reason=SKIP_REASON)]
SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 176, "max_position_embeddings": 512}


def save_base(directory: Path) -> None:
    """A random Llama of the debug shape beside SmolLM2's tokenizer, as `save_pretrained` writes them."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE, vocab_size=len(tokenizer), tie_word_embeddings=True,
                                 rms_norm_eps=1e-5, rope_theta=10000.0)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def write_config(root: Path) -> Path:
    conversations = root / "conversations.jsonl"
    with conversations.open("w") as out:
        for _, document in zip(range(160), read_chitchat("chitchat"), strict=False):
            out.write(json.dumps({"messages": conversation_of(document.data.decode())}) + "\n")
    save_base(root / "base")
    config = {
        "inherit": "debug.yaml",
        "data": {"sources": [{"kind": "files", "path": str(conversations), "format": "messages"}],
                 "seq_len": 128, "val_fraction": 0.1},
        "model": {"init_from": str(root / "base")},
        "sft": {"lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}},
        "parallel": {"dp_shard": 2},
        "train": {"steps": 6, "warmup_steps": 1, "lr": 1e-2, "val_every": 3, "val_batches": 1},
        "checkpoint": {"every_steps": 3},
        "eval": {"dimensions": {"instruction_following": {"limit": 2}, "language_modeling": {"limit": 2}}},
        "registry": {"experiment": "forgeline-sft", "model_name": "forgeline-sft"},
    }
    path = root / "sft.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_forgeline_run_fine_tunes_a_base_on_conversations_and_registers_the_assistant(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    forgeline = str(VENV_BIN / "forgeline")
    refused = subprocess.run([forgeline, "stage", "train", "--config", str(config)], cwd=tmp_path,
                             env=user_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "run `forgeline stage sft` instead of train" in refused.stderr
    assert not (tmp_path / "artifacts").exists()  # refused before any work

    done = run([forgeline, "run", "--config", str(config)], tmp_path, timeout=1800)
    run_id = re.search(r"MLflow run: (\w+)", done.stdout).group(1)
    assert "Registered model: forgeline-sft version 1" in done.stdout
    manifest = read_manifest(tmp_path / load_config(config).data.out_dir)
    assert manifest["loss_masks"] is True

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.get_run(run_id)
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
    by_name = {child.data.tags[STAGE_TAG]: child for child in children}
    assert set(by_name) == {"data", "sft", "eval", "register"}
    sft = by_name["sft"]
    assert sft.data.params["sft.lora.rank"] == "4"
    losses = [metric.value for metric in client.get_metric_history(sft.info.run_id, "loss")]
    assert len(losses) == 6 and all(loss > 0 for loss in losses)
    assert sft.data.metrics["val/bpb"] > 0
    eval_metrics = by_name["eval"].data.metrics
    assert "eval/dimension/instruction_following" in eval_metrics
    assert "eval/base/dimension/instruction_following" in eval_metrics  # scored beside its base
    # IFEval asked through the sft tokenizer's template by default (eval.dimensions.*.chat unset)
    eval_params = by_name["eval"].data.params
    assert eval_params["eval.dimensions.instruction_following.chat"] == "None"
    assert eval_params["chat.instruction_following"] == "True"
    assert eval_params["chat.language_modeling"] == "False"  # no generative task: nothing to ask

    # Registered: the merged model, and the adapter as peft reads it.
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    model_dir = Path(mlflow.artifacts.download_artifacts("models:/forgeline-sft/1",
                                                         dst_path=str(tmp_path / "model")))
    [adapter_config] = model_dir.glob("artifacts/peft_adapter/adapter_config.json")
    assert json.loads(adapter_config.read_text())["r"] == 4

    # Rerun alone on its upstream outputs: nothing changed, nothing to do.
    status = run([forgeline, "status", "--config", str(config), "--json"], tmp_path)
    assert json.loads(status.stdout.splitlines()[-1]) == dict.fromkeys(["data", "sft", "eval", "register"])
    assert load_config(str(config)).sft.lora.rank == 4
