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
    # Bounded waits on the Prefect API (docs/outages.md). Prefect's
    # defaults (5 retries backing off 2, 4, ... 32 s; 60 s per request) hold each call about a
    # minute against an API that is gone, and a flow makes several after its work: the command
    # hung for minutes. With these a call gives up within about 7 s on a refused connection and
    # about 70 s on a server that hangs (3 tries x 20 s + backoff); `forgeline sync` replays
    # the final states the API missed.
    "PREFECT_CLIENT_MAX_RETRIES": "2",
    "PREFECT_API_REQUEST_TIMEOUT": "20",
    # Bounded waits on an MLflow tracking server: MLflow's own defaults (7 retries with backoff,
    # 120 s per request) hold one call for about 4 minutes against a server that is down. With
    # these a call gives up within about 2 s on a refused connection and ~95 s on a server that
    # hangs (3 tries x 30 s + backoff); the tracking spool (model/spool.py) retries for good.
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    # Stage functions log to `forgeline.*` loggers; Prefect forwards them to its run logs.
    "PREFECT_LOGGING_EXTRA_LOGGERS": "forgeline",
    # Outside a flow run those records are for the console and the stage's log file alone
    # (Prefect's default: a UserWarning on the console for each).
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    # MLflow's records go through the process's handlers, as every other library's do (its
    # default: a console handler of its own, which the console's filter cannot reach).
    "MLFLOW_CONFIGURE_LOGGING": "false",
    # MLflow writes each run's URL on a tracking server to stdout as the run ends, with the
    # tracking URI's `user:password@` in clear; the stages log the store, masked, instead.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


# tqdm's own switch, set by the console unless --verbose (flows/console.py).
PROGRESS_BARS_OFF = "TQDM_DISABLE"


def progress_bars_shown() -> bool:
    """Whether progress bars are on: those that pass tqdm `disable=` themselves ask this."""
    return os.environ.get(PROGRESS_BARS_OFF, "").lower() not in {"1", "true", "yes"}


def apply_environment_defaults() -> None:
    """Set every variable of ENV_DEFAULTS that is not set yet."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
