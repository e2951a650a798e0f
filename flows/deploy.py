"""The Prefect deployments: prefect.yaml, rendered from the stage records (the scheduled
pipeline, one manual deployment per stage), and their registration with the Prefect API in
PREFECT_API_URL."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists

from forgeline.tasks.stage import STAGES, Stage, chain

log = logging.getLogger(__name__)

PREFECT = Path(sys.executable).parent / "prefect"
PREFECT_HEADER = """\
# Generated from the stage records (tasks/stage.py) by `forgeline stages --write`; edit those.
# Prefect deployments of forgeline. `forgeline deploy` registers them all (it creates the work
# pool first and fills the two variables below); `prefect worker start --pool forgeline` runs them.
#
#   forgeline-pipeline/scheduled   the whole pipeline, nightly at 03:00 UTC, at most one flow run
#                                  at a time; stages whose inputs did not change end Cached
#   forgeline-STAGE/rerun-STAGE    one stage by hand, e.g.
#       prefect deployment run forgeline-eval/rerun-eval -p upstream_run=MLFLOW_RUN_ID \\
#           --param overrides='["eval.out_dir=artifacts/eval-rerun"]'
#
# FORGELINE_WORKDIR: the directory flow runs start in (relative output paths and the default
# MLflow store resolve there); FORGELINE_WORK_POOL: the pool (default `forgeline`, a process
# pool). For a Kubernetes pool, create it with deploy/kubernetes-job-template.json as its base
# job template (docs/servers.md).
"""
PREFECT_VERSION = "3.9.1"  # the release this file's format was written for
WORK_POOL = {"name": "{{ $FORGELINE_WORK_POOL }}"}
DEFAULT_CONFIG = "tiny.yaml"
SCHEDULE = {"cron": "0 3 * * *", "timezone": "UTC"}


def stage_deployment(stage: Stage) -> dict:
    """`forgeline-STAGE/rerun-STAGE`: named by its stage, so that the deployments list tells them
    apart (they were all `manual`)."""
    reads = ", optionally on the outputs of an earlier run (upstream_run)" if stage.reads else ""
    parameters = {"config": DEFAULT_CONFIG, "overrides": [], "upstream_run": None, "force": False}
    if stage.snapshot is not None:
        parameters["from_snapshot"] = False
    return {"name": f"rerun-{stage.name}",
            "description": f"Rerun the {stage.name} stage{reads}: {stage.summary}.",
            "entrypoint": f"forgeline.flows.stage_flows:{stage.name}_flow", "parameters": parameters,
            "work_pool": dict(WORK_POOL)}


def render_prefect_yaml() -> str:
    pipeline = {"name": "scheduled",
                "description": f"{chain()} (sft, preference, pairs: a config with that section) nightly at "
                               f"03:00 UTC (cron {SCHEDULE['cron']}, time zone {SCHEDULE['timezone']}); one "
                               "run at a time; "
                               "stages whose inputs did not change end Cached.",
                "entrypoint": "forgeline.flows.pipeline:pipeline_flow",
                "parameters": {"config": DEFAULT_CONFIG, "overrides": [], "force": False},
                "schedules": [dict(SCHEDULE)],
                "concurrency_limit": 1,
                "work_pool": dict(WORK_POOL)}
    body = {"name": "forgeline",
            "prefect-version": PREFECT_VERSION,
            "pull": [{"prefect.deployments.steps.set_working_directory":
                      {"directory": "{{ $FORGELINE_WORKDIR }}"}}],
            "deployments": [pipeline, *map(stage_deployment, STAGES)]}
    return PREFECT_HEADER + yaml.safe_dump(body, sort_keys=False, width=100)


def ensure_work_pool(name: str) -> None:
    """Create `name` as a process work pool unless a pool of that name (of any type, e.g. a
    Kubernetes pool made with deploy/kubernetes-job-template.json) exists."""
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            log.info("created process work pool %s", name)
        except ObjectAlreadyExists:
            log.info("work pool %s exists; deploying to it", name)


def deploy(prefect_file: Path, workdir: Path, pool: str) -> str:
    """`prefect deploy --all` of `prefect_file`, its flow runs starting in `workdir`; returns
    Prefect's report."""
    ensure_work_pool(pool)
    env = dict(os.environ, FORGELINE_WORKDIR=str(workdir.resolve()), FORGELINE_WORK_POOL=pool)
    done = subprocess.run([str(PREFECT), "--no-prompt", "deploy", "--all", "--prefect-file",
                           str(prefect_file.resolve())], cwd=prefect_file.resolve().parent, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"prefect deploy failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout
