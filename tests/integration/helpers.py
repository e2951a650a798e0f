"""Helpers for tests that run forgeline as a user would: as processes, in their own
working directory, with their own Prefect home and MLflow store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


def user_env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PREFECT_HOME"] = str(workdir / ".prefect")  # a fresh Prefect database per test
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def run(cmd: list[str], workdir: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=workdir, env=user_env(workdir), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return done


def prefect_flow_runs(workdir: Path) -> list[dict]:
    """Flow runs (with their task runs) recorded in the Prefect database of `workdir`."""
    script = r"""
import json
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter
with get_client(sync_client=True) as client:
    out = []
    for fr in client.read_flow_runs():
        flow = client.read_flow(fr.flow_id)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
        out.append({"id": str(fr.id), "flow": flow.name, "state": fr.state.type.value,
                    "tasks": sorted((t.name.split("-")[0], t.state.type.value) for t in tasks),
                    "task_run_counts": {t.name.split("-")[0]: t.run_count for t in tasks}})
print(json.dumps(out))
"""
    done = run([sys.executable, "-c", "import forgeline.flows\n" + script], workdir, timeout=300)
    return json.loads(done.stdout.strip().splitlines()[-1])
