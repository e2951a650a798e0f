"""forgeline's records reach Prefect's API handler in a process that a worker starts: Prefect
configures logging on its first import, before any forgeline code (PREFECT_LOGGING_EXTRA_LOGGERS
unset then), with the root at WARNING. The flow run itself, through a real server and worker:
tests/integration/test_deployments.py."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import logging
import prefect.main  # as `python -m prefect.engine` does: logging configured, nothing of forgeline's yet
from prefect.logging.handlers import APILogHandler

before = logging.getLogger("forgeline.tasks.cache")
print("before", before.isEnabledFor(logging.INFO),
      any(isinstance(h, APILogHandler) for h in logging.getLogger("forgeline").handlers))
from forgeline.flows.hooks import forgeline_logs_to_prefect

forgeline_logs_to_prefect()
forgeline_logs_to_prefect()
handlers = [h for h in logging.getLogger("forgeline").handlers if isinstance(h, APILogHandler)]
print("after", before.isEnabledFor(logging.INFO), len(handlers))
"""


def test_a_worker_started_process_sends_forgelines_info_records_to_prefect() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_LOGGING")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.split("\n")[:2] == ["before False False", "after True 1"], done.stdout + done.stderr
