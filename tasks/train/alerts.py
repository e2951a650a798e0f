"""The launcher's side of training alerts (model/training/alerts.py): recognise the ranks' alert
lines in the job's output, or take an alert the launcher itself finds (a hang), and post each to
the Prefect notification block `ops.notify_block` -- at most one post per kind per
`ops.alert_interval_s`, those held back counted in the next post of their kind, and what is
still held at the end in one summary. Posts go out from a background thread, so the job's
output pump never waits on the network; a post that fails (the Prefect API or the webhook down)
costs a warning, never the training."""

from __future__ import annotations

import contextvars
import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from forgeline.configs import Config
from forgeline.model.training.alerts import Alert, AlertKind, make_alert, parse_alert

log = logging.getLogger(__name__)


def load_block(name: str) -> Any:
    """The saved Prefect notification block `name` ("custom-webhook/alerts"). Prefect is imported
    here: the rest of tasks/ does without it."""
    from prefect.blocks.core import Block

    return Block.load(name)


class AlertForwarder:
    """Posts alerts to the notification block `block_name`; with none (""), does nothing -- the
    alert lines still reach the log with the rest of the job's output. `run` names the run in
    every post; `clock` and `load` are for tests."""

    def __init__(self, block_name: str, interval_s: float, run: str, close_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, load: Callable[[str], Any] = load_block):
        self.block_name, self.interval_s, self.run = block_name, interval_s, run
        self.close_timeout_s = close_timeout_s
        self._clock, self._load = clock, load
        self._block: Any = None
        self._lock = threading.Lock()
        self._last_post: dict[str, float] = {}  # kind -> when its last post was sent
        self._held: dict[str, tuple[int, Alert]] = {}  # kind -> (alerts held back since, the latest)
        self._outbox: queue.Queue[tuple[str, str] | None] = queue.Queue()
        # The poster runs in its creator's context: the Prefect settings (API URL) and run logger.
        self._context = contextvars.copy_context()
        self._poster: threading.Thread | None = None
        self._unposted = 0  # sent to the poster, not yet tried

    @classmethod
    def from_config(cls, cfg: Config, mlflow_run_id: str | None = None) -> AlertForwarder:
        run = f"train.out_dir={cfg.train.out_dir}"
        if mlflow_run_id:
            run += f", MLflow run {mlflow_run_id}"
        return cls(cfg.ops.notify_block, cfg.ops.alert_interval_s, run)

    def on_line(self, line: str) -> None:
        """run_streaming's `on_line`: forward the line if it is an alert."""
        if (alert := parse_alert(line)) is not None:
            self.submit(alert)

    def report(self, kind: AlertKind, message: str, rank: int, host: str | None = None,
               step: int | None = None) -> None:
        """An alert the launcher found itself, about `rank` on `host` (default: this host)."""
        self.submit(make_alert(kind, message, step, rank, host))

    def report_hang(self, ranks: list[int], timeout_s: int) -> None:
        """The ranks on this host whose hang watchdogs fired together (their stack files; the
        watchdog exits from C, so the ranks cannot say it themselves): one alert each, each naming
        the others -- the stuck rank cannot be told from those waiting on it in a collective."""
        for rank in ranks:
            others = ", ".join(str(other) for other in ranks if other != rank)
            also = f", nor did rank(s) {others}: one is stuck, the others wait on it" if others else ""
            self.report("hang", f"made no step progress for {timeout_s} s (train.hang_timeout_s){also}; "
                                "the threads of each are in the train stage's log", rank)

    def submit(self, alert: Alert) -> None:
        """Post `alert` now, or hold it back if one of its kind went out less than interval_s ago."""
        if not self.block_name:
            return
        with self._lock:
            now = self._clock()
            last = self._last_post.get(alert.kind)
            if last is not None and now - last < self.interval_s:
                held, _ = self._held.get(alert.kind, (0, alert))
                self._held[alert.kind] = (held + 1, alert)
                return
            self._last_post[alert.kind] = now
            held, _ = self._held.pop(alert.kind, (0, alert))
        self._send(*self._compose(alert, held))

    def close(self) -> None:
        """Post one summary of the alerts still held back and wait, at most close_timeout_s, for
        the posts to go out; those that have not by then are given up with a warning."""
        with self._lock:
            held, self._held = self._held, {}
        if held:
            self._send(*self._summary(held))
        with self._lock:
            poster = self._poster
        if poster is None:
            return
        self._outbox.put(None)
        poster.join(self.close_timeout_s)
        if poster.is_alive():
            log.warning("gave up on %d training alert(s) to %s not posted within %g s",
                        self._unposted, self.block_name, self.close_timeout_s)

    def _compose(self, alert: Alert, held: int) -> tuple[str, str]:
        at = f" at step {alert.step}" if alert.step is not None else ""
        subject = f"forgeline alert: {alert.kind} on rank {alert.rank} ({alert.host}){at}"
        body = (f"{alert.kind}: {alert.message}\nrank {alert.rank} on host {alert.host}{at}, "
                f"{_utc(alert.time)}; run {self.run}")
        if held:
            body += (f"\n{held} more {alert.kind} alert(s) were held back since the last "
                     f"(ops.alert_interval_s={self.interval_s:g})")
        return subject, body

    def _summary(self, held: dict[str, tuple[int, Alert]]) -> tuple[str, str]:
        total = sum(count for count, _ in held.values())
        subject = f"forgeline alert: {total} alert(s) held back until the end of the job"
        lines = [f"{count} {kind}, the last: rank {a.rank} on host {a.host}"
                 + (f" at step {a.step}" if a.step is not None else "") + f", {_utc(a.time)}: {a.message}"
                 for kind, (count, a) in held.items()]
        body = "\n".join(lines) + f"\nrun {self.run} (ops.alert_interval_s={self.interval_s:g})"
        return subject, body

    def _send(self, subject: str, body: str) -> None:
        with self._lock:  # the output pump and the launcher both send
            self._unposted += 1
            self._outbox.put((subject, body))
            if self._poster is None:
                self._poster = threading.Thread(target=self._context.run, args=(self._post_all,),
                                                daemon=True, name="forgeline-alerts")
                self._poster.start()

    def _post_all(self) -> None:
        while (item := self._outbox.get()) is not None:
            self._post(*item)
            with self._lock:
                self._unposted -= 1

    def _post(self, subject: str, body: str) -> None:
        # Whatever goes wrong -- the API unreachable, no such block, the webhook refusing -- the
        # training goes on: a notification is a courtesy. Loaded once, when it is first needed.
        try:
            if self._block is None:
                self._block = self._load(self.block_name)
            self._block.notify(body=body, subject=subject)
        except Exception as err:
            log.warning("could not post %r to %s: %s: %s", subject, self.block_name, type(err).__name__, err)
            return
        log.info("posted %r to %s", subject, self.block_name)


def _utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
