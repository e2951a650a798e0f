"""Training metrics: MLflow (asynchronous, so the loop never waits on the tracking store) and
a progress line on the console, from global rank 0 only."""

from __future__ import annotations

import logging
import time

from mlflow import MlflowClient
from mlflow.entities import Metric

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, run_id: str | None, log_every: int, total_steps: int):
        self.client = MlflowClient() if run_id else None
        self.run_id = run_id
        self.log_every = log_every
        self.total_steps = total_steps
        self._pending = []

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        if self.client is not None:
            now = int(time.time() * 1000)
            batch = [Metric(key, float(value), now, step) for key, value in metrics.items()]
            self._pending.append(self.client.log_batch(self.run_id, metrics=batch, synchronous=False))
        if step % self.log_every == 0 or step == self.total_steps:
            shown = "  ".join(f"{k} {_fmt(v)}" for k, v in metrics.items())
            log.info("step %d/%d  %s", step, self.total_steps, shown)

    def close(self) -> None:
        """Wait until every queued metric reached the tracking store."""
        for operation in self._pending:
            operation.wait()
        self._pending.clear()


def _fmt(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
