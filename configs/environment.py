"""The process environment forgeline runs with: offline by default, telemetry off.

Entry points apply it explicitly, before they import Prefect, MLflow, datasets or transformers
(which read these at import time): the CLI, the flows, the rank program, the in-training
evaluation and the lm-eval model class. Importing a forgeline module never changes
`os.environ`. Only defaults: a variable the user already set wins, e.g. HF_HUB_OFFLINE=0 to let
lm-eval fetch hub tasks.
"""

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


def apply_environment_defaults() -> None:
    """Set every variable of ENV_DEFAULTS that is not set yet."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
