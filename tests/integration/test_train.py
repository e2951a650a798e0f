"""The train stage with real torchrun processes on the debug model."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from forgeline.configs import Config
from forgeline.model.checkpoint.manager import committed_checkpoints
from forgeline.model.inference import load_from_checkpoint
from forgeline.tasks.runner import run_stage
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import dvc_hash, resolve_tracking_uri
from forgeline.tasks.train.job import RunDirectoryTaken, train_model
from tests.conftest import debug_config
from tests.processes import descendants

pytestmark = pytest.mark.integration


def config(data_root: Path, tmp_path: Path, *overrides: str) -> Config:
    """Debug config reading the session's shared data, writing everything else to tmp_path."""
    return debug_config(tmp_path, f"data.out_dir={data_root / 'data'}", *overrides)


def test_train_stage_commits_checkpoints_and_logs_every_step(data_root: Path, tmp_path: Path) -> None:
    cfg = config(data_root, tmp_path)
    result = run_stage(stage_named("train"), cfg)
    assert result.step == 20 and Path(result.checkpoint).name == "step-00000020"
    assert [c.step for c in committed_checkpoints(tmp_path / "train" / "checkpoints")] == [20, 10]
    client = MlflowClient(resolve_tracking_uri(cfg))
    [run] = client.search_runs([client.get_experiment_by_name("forgeline-debug").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["train.steps"] == "20"
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in losses] == list(range(1, 21))
    assert losses[-1].value < losses[0].value
    for key in ("lr", "grad_norm", "tokens_per_s", "step_time_s", "data_wait_s"):
        assert len(client.get_metric_history(run.info.run_id, key)) == 20


def test_rerun_resumes_and_another_recipe_is_refused_the_directory_untouched(
        data_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A rerun resumes; another recipe in the same directory (train.out_dir given, as run.name would
    give it) is refused before its ranks start, and every file of the first run stays as it was."""
    caplog.set_level(logging.INFO)
    first = train_model(config(data_root, tmp_path))
    again = train_model(config(data_root, tmp_path))
    assert "resumed from" in caplog.text and "step 20" in caplog.text
    assert again == first  # nothing left to train: the same committed checkpoint
    before = dvc_hash(tmp_path / "train")
    with pytest.raises(RunDirectoryTaken, match="holds the checkpoints of another configuration"):
        train_model(config(data_root, tmp_path, "train.lr=1e-3"))
    assert dvc_hash(tmp_path / "train") == before
    assert [c.step for c in committed_checkpoints(tmp_path / "train" / "checkpoints")] == [20, 10]


def test_killed_rank_is_restarted_and_resumes_from_the_latest_checkpoint(
        data_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    cfg = config(data_root, tmp_path, "train.steps=400", "checkpoint.every_steps=50",
                 "train.max_restarts=1")
    outcome: dict = {}
    trainer = threading.Thread(target=lambda: outcome.setdefault("result", train_model(cfg)))
    trainer.start()
    first_checkpoint = tmp_path / "train" / "checkpoints" / "step-00000050"
    deadline = time.monotonic() + 120
    while not first_checkpoint.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    # This test's own ranks: another test file runs beside this one (make test's -n 2).
    workers = [p for p in descendants(os.getpid())
               if "forgeline.model.training.worker" in " ".join(p.cmdline())
               and "torch.distributed.run" not in " ".join(p.cmdline())]
    assert first_checkpoint.exists() and len(workers) == 1
    workers[0].kill()  # SIGKILL, mid-run
    trainer.join(timeout=300)
    assert outcome["result"].step == 400
    assert "resumed from" in caplog.text


def test_fsdp_x_tp_layout_trains_and_its_checkpoint_loads_in_one_process(
        data_root: Path, tmp_path: Path) -> None:
    cfg = config(data_root, tmp_path, "parallel.dp_shard=2", "parallel.tp=2")
    result = train_model(cfg)
    assert result.layout["dp_shard"] == 2 and result.layout["tp"] == 2 and result.layout["world_size"] == 4
    model = load_from_checkpoint(result.checkpoint)  # resharded onto one plain module
    logits = model(torch.zeros(1, 8, dtype=torch.long))
    assert torch.isfinite(logits).all()


def test_in_training_evaluation_logs_at_its_steps_the_eval_stages_scores(data_root: Path,
                                                                         tmp_path: Path) -> None:
    """Each evaluation logs its scores at its step; at the last step they are the eval stage's
    on the same checkpoint, asked the same way (LAMBADA with its dimension's shot)."""
    tasks = ("forgeline_heldout", "forgeline_lambada")
    cfg = config(data_root, tmp_path, "train.peak_tflops=1",
                 f"eval.during_training={{every_steps: 10, tasks: [{', '.join(tasks)}], limit: 3}}",
                 "eval.dimensions={language_modeling: {limit: 3, num_fewshot: 1}}")
    run_stage(stage_named("train"), cfg)
    client = MlflowClient(resolve_tracking_uri(cfg))
    [run] = client.search_runs([client.get_experiment_by_name("forgeline-debug").experiment_id])
    history = client.get_metric_history(run.info.run_id, "eval/forgeline_heldout/bits_per_byte")
    assert sorted(m.step for m in history) == [10, 20]
    assert all(0 < m.value < 16 for m in history)
    stderrs = client.get_metric_history(run.info.run_id, "eval/stderr/forgeline_heldout/bits_per_byte")
    assert sorted(m.step for m in stderrs) == [10, 20]
    assert all(0 < m.value < 1 for m in stderrs)  # the 3 documents score apart, by a fraction of a bit

    stage = run_stage(stage_named("eval"), cfg)
    assert stage.checkpoint.endswith("step-00000020")
    for name in ("forgeline_heldout/bits_per_byte", "forgeline_lambada/perplexity", "forgeline_lambada/acc"):
        [last] = [m for m in client.get_metric_history(run.info.run_id, f"eval/{name}") if m.step == 20]
        assert last.value == pytest.approx(stage.metrics[name], rel=1e-6), name