"""Process-wide defaults forgeline runs with, applied before Prefect, MLflow, datasets or
transformers are imported (they read these at import time). Only defaults: a variable the
user already set wins, e.g. HF_HUB_OFFLINE=0 to let lm-eval fetch hub tasks."""

from __future__ import annotations

import os

ENV_DEFAULTS = {
    # Offline by default: no model or data hub is reached at run time.
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # Telemetry off.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    # Prefect's temporary local API migrates a new database on first start, which takes
    # longer than its 20 s default on 2 cores.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    # Stage functions log to `forgeline.*` loggers; Prefect forwards them to its run logs.
    "PREFECT_LOGGING_EXTRA_LOGGERS": "forgeline",
}


def apply_env_defaults() -> None:
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
