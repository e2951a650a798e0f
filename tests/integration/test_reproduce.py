"""`forgeline reproduce`: a pipeline run, rerun from its recorded config on the same code and
data version into fresh directories, gives the same data hash and the same eval scores."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mlflow import MlflowClient

from forgeline.tasks.reproduce import REPRODUCES_TAG
from tests.integration.helpers import VENV_BIN, run

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]


def test_a_recorded_run_reproduces_its_data_and_scores(tmp_path: Path, flow_runs) -> None:
    forgeline = str(VENV_BIN / "forgeline")
    done = run([forgeline, "run", "--config", "debug.yaml", "--set", "train.deterministic=true"], tmp_path)
    run_id = re.search(r"MLflow run: (\w+)", done.stdout).group(1)

    again = run([forgeline, "reproduce", run_id, "--config", "debug.yaml"], tmp_path)
    lines = again.stdout.splitlines()
    assert f"reproduced run {run_id} as" in again.stdout
    checked = [line.split()[1] for line in lines if line.startswith("  ")]
    assert checked[0] == "data" and "overall:" in checked and len(checked) == 9  # data, overall, 7 dimensions
    assert all(line.split()[0] == "same" for line in lines if line.startswith("  ")), again.stdout
    assert (tmp_path / "reproduce" / run_id / "train" / "train.json").is_file()
    # The store's URI, which $MLFLOW_TRACKING_URI may give with a password, is no flow parameter.
    [reproduced] = [flow_run for flow_run in flow_runs(tmp_path)
                    if flow_run["flow"] == "forgeline-reproduce"]
    assert "mlflow.db" not in str(reproduced["parameters"]), reproduced["parameters"]

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [reproduction] = client.search_runs([client.get_run(run_id).info.experiment_id],
                                        filter_string=f"tags.`{REPRODUCES_TAG}` = '{run_id}'")
    assert reproduction.info.status == "FINISHED"
    assert len(client.search_model_versions("name = 'forgeline-debug'")) == 1  # it registers nothing
