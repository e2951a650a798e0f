"""bench/cache: what a rerun with nothing changed costs once stage caching skips every stage.

    .venv/bin/python bench/cache.py [--config tiny.yaml] [--workdir DIR]

Runs `forgeline run --config CONFIG` twice in a fresh working directory (its own MLflow store and
Prefect home, so both runs pay the same Prefect start-up), checks that every stage of the second
run was a cache hit, and reports the second run's wall time as a ratio to the first
(target <= 10 %). Writes bench/results/cache.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from forgeline.configs.environment import apply_environment_defaults

apply_environment_defaults()  # before MLflow is imported

from mlflow import MlflowClient  # noqa: E402
from results_file import write_results  # noqa: E402  (bench/, the script's own directory)

from forgeline.configs import load_config  # noqa: E402
from forgeline.tasks.cache import CACHE_TAG  # noqa: E402
from forgeline.tasks.runner import STAGE_TAG  # noqa: E402
from forgeline.tasks.stage import pipeline_stages  # noqa: E402

VENV_BIN = Path(sys.executable).parent


def timed_run(config: str, workdir: Path) -> tuple[float, str]:
    """Wall seconds of one `forgeline run`, and the MLflow parent run id it printed."""
    env = dict(os.environ, PREFECT_HOME=str(workdir / ".prefect"),
               PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)
    start = time.perf_counter()
    done = subprocess.run([str(VENV_BIN / "forgeline"), "run", "--config", config], cwd=workdir, env=env,
                          capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"forgeline run failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    [run_id] = [line.split()[-1] for line in done.stdout.splitlines() if line.startswith("MLflow run:")]
    return elapsed, run_id


def stage_cache_states(workdir: Path, config: str, parent_run_id: str) -> dict[str, str]:
    cfg = load_config(config)
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(cfg.registry.experiment).experiment_id
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent_run_id}'")
    return {run.data.tags[STAGE_TAG]: run.data.tags.get(CACHE_TAG, "none") for run in children}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny.yaml",
                        help="shipped config name or path (default tiny.yaml)")
    parser.add_argument("--workdir", help="run here instead of a new temporary directory")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="forgeline-bench-cache-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = str(Path(args.config).resolve()) if Path(args.config).is_file() else args.config

    first_s, first_id = timed_run(config, workdir)
    second_s, second_id = timed_run(config, workdir)
    states = stage_cache_states(workdir, config, second_id)
    if states != {stage.name: "hit" for stage in pipeline_stages(load_config(config))}:
        sys.exit(f"the second run did not skip every stage: {states}")
    write_results("cache", {
        "config": args.config,
        "first_run_s": round(first_s, 2),
        "second_run_s": round(second_s, 2),
        "ratio": round(second_s / first_s, 4),
        "target_ratio": 0.10,
        "second_run_stages": states,
        "runs": [first_id, second_id],
    })


if __name__ == "__main__":
    main()
