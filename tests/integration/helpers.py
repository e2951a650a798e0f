"""Helpers for tests that run forgeline as a user would: as processes, in their own
working directory, with their own Prefect home and MLflow store."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import httpx

from forgeline.model.lifetime import die_with_parent

VENV_BIN = Path(sys.executable).parent


def user_env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PREFECT_HOME"] = str(workdir / ".prefect")  # a fresh Prefect database per test
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(cmd: list[str], env: dict[str, str], log_path: Path, health_url: str | None = None,
            timeout: float = 180) -> Iterator[subprocess.Popen]:
    """A long-running process (a server, a worker) in its own process group, logging to
    `log_path`; with `health_url`, entered once that answers 200. Its whole group is stopped on
    exit."""
    with open(log_path, "w") as log:
        # Dies with this process too: a test session stopped by a signal runs no `finally`.
        process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=die_with_parent)
        try:
            deadline = time.monotonic() + timeout
            while health_url is not None and not _healthy(health_url):
                assert process.poll() is None, f"{cmd[0]} exited:\n{log_path.read_text()[-8000:]}"
                assert time.monotonic() < deadline, f"{health_url} not healthy after {timeout} s"
                time.sleep(1)
            yield process
        finally:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:  # the test killed it already
                return
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a Prefect worker can outlive SIGTERM, polling a stopped API
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def run(cmd: list[str], workdir: Path, timeout: float = 900,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`cmd` in `workdir` as a user would run it there (`env`: variables to add)."""
    done = subprocess.run(cmd, cwd=workdir, env=user_env(workdir) | (env or {}), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return done


def run_ranks(module: str, nproc: int, args: list[str], cwd: Path, timeout: float = 300) -> None:
    """`python -m module ARGS` as `nproc` local torchrun ranks in `cwd`, one thread each (ranks
    share the cores)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, *args]
    done = subprocess.run(cmd, cwd=cwd, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-8000:]


def prefect_flow_runs(workdir: Path, since: datetime) -> list[dict]:
    """Flow runs made since `since` (with their stages' task runs, and apart the data build's
    partition work), from the Prefect API a command in `workdir` reports to."""
    script = r"""
import json
import re
import sys
from datetime import datetime
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter
since = datetime.fromisoformat(sys.argv[1])
with get_client(sync_client=True) as client:
    out = []
    for fr in client.read_flow_runs():
        if fr.created < since:
            continue
        flow = client.read_flow(fr.flow_id)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
        # The data build's partition work (data-clean-0, ...) runs as task runs of its own.
        work = [t for t in tasks if re.fullmatch(r"data-[a-z-]+-\d+", t.name)]
        stages = [t for t in tasks if t not in work]
        out.append({"id": str(fr.id), "flow": flow.name, "state": fr.state.type.value,
                    "parameters": fr.parameters,
                    "tasks": sorted((t.name.split(" ")[0], t.state.type.value) for t in stages),
                    "task_run_counts": {t.name.split(" ")[0]: t.run_count for t in stages},
                    "partition_work": sorted((t.name, t.state.type.value) for t in work)})
print(json.dumps(out))
"""
    done = run([sys.executable, "-c", "import forgeline.flows\n" + script, since.isoformat()], workdir,
               timeout=300)
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextmanager
def running_prefect_server(root: Path, ui: bool = False) -> Iterator[str]:
    """`prefect server start` on 127.0.0.1 with its database under `root` (and its UI at the
    URL less `/api` with `ui`); its API URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    cmd = [str(VENV_BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port),
           *([] if ui else ["--no-ui"]), "--analytics-off"]
    # The UI asks the API at 127.0.0.1:4200 unless told where it is.
    env = user_env(root) | ({"PREFECT_UI_API_URL": url} if ui else {})
    with serving(cmd, env, root / "prefect-server.log", f"{url}/health"):
        yield url
