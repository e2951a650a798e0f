"""Register the deployments of prefect.yaml with the Prefect API in PREFECT_API_URL."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists

log = logging.getLogger(__name__)

PREFECT = Path(sys.executable).parent / "prefect"


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
