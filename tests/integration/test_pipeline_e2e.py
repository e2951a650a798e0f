"""The whole pipeline on the debug config through `forgeline run`: a real Prefect temporary
API, torchrun, lm-eval and an MLflow sqlite store, checked the way a user would check them; then
a run of another recipe beside it (#41), and the first command again, all cache hits."""

from __future__ import annotations

import re
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from mlflow import MlflowClient

from forgeline.configs import load_config
from forgeline.model.fileio import sha256_file
from forgeline.model.training.shards import read_manifest, split_shards
from forgeline.tasks.runner import STAGE_TAG
from forgeline.tasks.tracking import dvc_hash
from tests.integration.helpers import VENV_BIN, run

# The README's path: no Prefect server, each command starts the temporary API.
pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.usefixtures("temporary_prefect_api")]


def test_forgeline_run_takes_the_corpus_to_a_registered_evaluated_model(tmp_path: Path, flow_runs) -> None:
    done = run([str(VENV_BIN / "forgeline"), "run", "--config", "debug.yaml"], tmp_path)
    run_id = re.search(r"MLflow run: (\w+)", done.stdout).group(1)
    assert "Registered model: forgeline-debug version 1" in done.stdout

    # The console: one line per event, the time and the stage once; the libraries' lines and bars
    # are in each stage's log file (and its MLflow run), not here.
    console = done.stderr.splitlines()
    assert len(console) <= 70, done.stderr
    # MLflow prints its registrations to stderr, past every logging handler (tasks/register.py).
    for noise in ("%|", "Warning:", "fatal: not a git repository", "lm_eval", "Task run '", "Traceback",
                  "Successfully registered model", "Created version"):
        assert noise not in done.stderr, noise
    assert not [line for line in console if re.search(r"\[rank\d\] \d{4}-", line)]  # one time stamp
    assert any(re.fullmatch(r"\d\d:\d\d:\d\d train +\[rank0\] \[#{20}\] 100% step 20/20  loss .*", line)
               for line in console), done.stderr
    logs = tmp_path / "artifacts" / "logs"
    assert "INFO lm_eval.evaluator: " in (logs / "eval.log").read_text()
    assert "INFO forgeline.model.training.metrics: [rank0] " in (logs / "train.log").read_text()

    # Data: shards and manifest, every checksum verifying.
    cfg = load_config("debug.yaml")
    data_dir, train_dir = tmp_path / cfg.data.out_dir, tmp_path / cfg.train.out_dir
    eval_dir, register_dir = tmp_path / cfg.eval.out_dir, tmp_path / cfg.registry.out_dir
    run_dir = tmp_path / "artifacts" / cfg.run.name  # the run's directory (#41)
    assert {train_dir.parent, eval_dir.parent, register_dir.parent} == {run_dir}
    manifest = read_manifest(data_dir)
    for split in ("train", "val"):
        for shard in split_shards(data_dir, manifest, split):
            assert sha256_file(shard.path) == shard.sha256

    # MLflow: a parent run with the config and lineage, and one nested run per stage.
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.get_run(run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.params["model.dim"] == "64" and parent.data.params["train.steps"] == "20"
    assert parent.data.tags["forgeline.data.dvc_md5"] == dvc_hash(data_dir)
    assert parent.data.tags["git.commit"]
    assert parent.data.tags["prefect.flow_run_id"]
    assert parent.data.tags["forgeline.layout"] == \
        "pp1 x dp_replicate1 x dp_shard1 x tp1 = 1 ranks on 1 node(s)"
    assert parent.data.tags["forgeline.checkpoint_uri"].startswith("file://")
    [dataset] = parent.inputs.dataset_inputs
    assert dataset.dataset.digest == dvc_hash(data_dir) and dataset.dataset.name == "forgeline-data"
    parent_artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "train", "eval"} <= parent_artifacts
    assert "train/loss.png" in {a.path for a in client.list_artifacts(run_id, "train")}
    assert parent.data.metrics["train/final_loss"] > 0
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
    by_name = {c.data.tags[STAGE_TAG]: c for c in children}
    assert set(by_name) == {"data", "train", "eval", "register"}
    assert all(c.info.status == "FINISHED" for c in children)
    assert all(f"logs/{name}.log" in {a.path for a in client.list_artifacts(c.info.run_id, "logs")}
               for name, c in by_name.items())
    assert [m.step for m in client.get_metric_history(by_name["train"].info.run_id, "loss")] == \
        list(range(1, 21))
    # One name per score: the stage run's and the parent's are the same column of the runs table.
    assert by_name["train"].data.metrics["train/final_loss"] == parent.data.metrics["train/final_loss"]
    eval_metrics = {k.removeprefix("eval/"): v for k, v in by_name["eval"].data.metrics.items()
                    if not k.startswith("system/")}
    assert {f"eval/{k}": v for k, v in eval_metrics.items()}.items() <= parent.data.metrics.items()
    assert 0 <= eval_metrics["forgeline_arc_easy/acc"] <= 1
    assert eval_metrics["forgeline_heldout/bits_per_byte"] > 0
    assert any(k.startswith("system/cpu_utilization_percentage") for k in by_name["train"].data.metrics)
    dimensions = {"reasoning", "knowledge", "math", "code", "safety", "language_modeling",
                  "instruction_following"}
    assert {k.split("/")[1] for k in eval_metrics if k.startswith("dimension/")} == dimensions
    assert "overall" in eval_metrics and "eval/overall" in parent.data.metrics
    # What the eval run scored, and the runs named by it: `eval debug step-20 v1`.
    scored = by_name["eval"]
    assert scored.data.params["checkpoint_step"] == "20" and scored.data.params["checkpoint"].endswith(
        "step-00000020")
    assert scored.data.params["train_run_id"] == by_name["train"].info.run_id
    assert scored.data.tags["forgeline.model_version"] == "1"
    assert scored.info.run_name == "eval debug step-20 v1"
    assert re.fullmatch(r"pipeline debug v1 dp1 @[0-9a-f]{7}(-dirty)?", parent.info.run_name), \
        parent.info.run_name
    # The closing summary links the run in the UI's training view.
    assert (f"MLflow UI: http://127.0.0.1:5000/#/experiments/{parent.info.experiment_id}/runs/{run_id}"
            "?workflowType=machine_learning") in done.stdout
    assert re.search(r"Eval \(chance-normalized, 0 = chance, 1 = best; ± 95 % interval\): overall "
                     r"-?[0-9.]+ ± [0-9.]+", done.stdout)
    assert eval_metrics["stderr/overall"] > 0 and "stderr/dimension/reasoning" in eval_metrics
    detectable = re.search(r"Smallest overall change these items detect against another model \(80 % power "
                           r"at the gate's Holm-corrected 5 %\): ([0-9.]+)", done.stdout)
    assert float(detectable.group(1)) == pytest.approx(eval_metrics["detectable/overall"], abs=1e-3)
    assert by_name["data"].data.metrics["train_samples"] == manifest["splits"]["train"]["samples"]
    # ... built from the raw snapshot its run records.
    assert by_name["data"].data.tags["forgeline.data.raw_dvc_md5"] == dvc_hash(tmp_path / cfg.data.raw_dir)
    assert "data/sources.json" in {a.path for a in client.list_artifacts(by_name["data"].info.run_id, "data")}

    # Registry: version 1 with lineage and scores, alias `candidate`, and it generates text.
    version = client.get_model_version("forgeline-debug", "1")
    assert version.tags["forgeline.data.dvc_md5"] == dvc_hash(data_dir)
    assert float(version.tags["eval.overall"]) == pytest.approx(eval_metrics["overall"], abs=1e-5)
    assert str(client.get_model_version_by_alias("forgeline-debug", "candidate").version) == "1"
    assert str(client.get_model_version_by_alias("forgeline-debug", "champion").version) == "1"
    assert version.description == "promoted to champion: the first version, no champion to compare with"
    assert version.tags["forgeline.eval_run_id"] == scored.info.run_id
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    generator = mlflow.pyfunc.load_model("models:/forgeline-debug/1")
    [text] = generator.predict(pd.DataFrame({"prompt": ["ROMEO:"]}), params={"max_new_tokens": 8})
    assert isinstance(text, str) and text

    # Eval and register outputs on disk, and the chart among the eval run's artifacts.
    for name in ("metrics.json", "report.json", "lm_eval_results.json", "items.json", "dimensions.png"):
        assert (eval_dir / name).is_file()
    artifacts = {a.path for a in client.list_artifacts(by_name["eval"].info.run_id, "eval")}
    assert "eval/dimensions.png" in artifacts
    assert (register_dir / "registered.json").is_file()

    # Prefect: the pipeline flow run completed with its four stage tasks.
    [flow_run] = flow_runs(tmp_path)
    assert flow_run["id"] == parent.data.tags["prefect.flow_run_id"]
    assert flow_run["flow"] == "forgeline-pipeline" and flow_run["state"] == "COMPLETED"
    assert flow_run["tasks"] == sorted([name, "COMPLETED"] for name in ("data", "train", "eval", "register"))
    # The data build's partition work ran as Prefect task runs on the local Dask cluster.
    assert ["data-clean-0", "COMPLETED"] in flow_run["partition_work"]
    assert {state for _, state in flow_run["partition_work"]} == {"COMPLETED"}

    # Another recipe (#41): another run, in a directory of its own, on the same data (a cache hit);
    # it registers a version in the same model line. The first run's checkpoints stay as they were.
    trained = dvc_hash(train_dir)
    other = run([str(VENV_BIN / "forgeline"), "run", "--config", "debug.yaml", "--set", "train.steps=10"],
                tmp_path)
    other_id = re.search(r"MLflow run: (\w+)", other.stdout).group(1)
    other_runs = client.search_runs([parent.info.experiment_id],
                                    filter_string=f"tags.mlflow.parentRunId = '{other_id}'")
    assert {c.data.tags[STAGE_TAG]: c.data.tags["forgeline.cache"] for c in other_runs} == \
        {"data": "hit", "train": "miss", "eval": "miss", "register": "miss"}
    other_dir = tmp_path / load_config("debug.yaml", ["train.steps=10"]).train.out_dir
    assert other_dir != train_dir and (other_dir / "checkpoints" / "step-00000010").is_dir()
    assert "Registered model: forgeline-debug version 2" in other.stdout
    assert dvc_hash(train_dir) == trained

    # The first command again: every stage skipped, no new version.
    again = run([str(VENV_BIN / "forgeline"), "run", "--config", "debug.yaml"], tmp_path)
    second_id = re.search(r"MLflow run: (\w+)", again.stdout).group(1)
    assert "Registered model: forgeline-debug version 1" in again.stdout
    second = client.search_runs([parent.info.experiment_id],
                                filter_string=f"tags.mlflow.parentRunId = '{second_id}'")
    assert {c.data.tags[STAGE_TAG]: c.data.tags["forgeline.cache"] for c in second} == \
        dict.fromkeys(by_name, "hit")
    assert {c.data.tags["forgeline.cache.source_run"] for c in second} == {c.info.run_id for c in children}
