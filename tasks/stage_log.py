"""Each stage's full log, whatever the console shows: every record logged in the stage's context
while it runs -- forgeline's, the libraries' (lm-eval, MLflow, Prefect), the ranks' lines the
launcher relays -- to `<ops.log_dir>/<stage>.log`, appended run after run under a header line
naming the MLflow run, and this run's part of it to the stage's MLflow run as `logs/<stage>.log`.
Records come at the level the process logs at (the CLI: INFO). Also names the stage that runs in
the current context, for the console's lines (flows/console.py).

"In the stage's context": the thread that runs it, and the threads it starts with its context
copied (the launcher's output reader). Two stages running at once in one process (threads)
each keep their own records."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from forgeline.configs import Config
from forgeline.configs.redaction import ScrubURLCredentials

if TYPE_CHECKING:  # imports MLflow: the CLI imports this module before it sets MLflow's environment
    from forgeline.tasks.tracking import RunTracker

log = logging.getLogger(__name__)

FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True, eq=False)
class RunningStage:
    """One run of a stage: compared by identity, so that two runs of a stage are two."""

    name: str
    started: float = field(default_factory=time.time)


RUNNING_STAGE: ContextVar[RunningStage | None] = ContextVar("forgeline_running_stage", default=None)


def running_stage_name() -> str | None:
    """The stage running in this context, if any."""
    running = RUNNING_STAGE.get()
    return None if running is None else running.name


class InStage(logging.Filter):
    """Passes the records logged in the context of one run of a stage."""

    def __init__(self, running: RunningStage) -> None:
        super().__init__()
        self.running = running

    def filter(self, record: logging.LogRecord) -> bool:
        return RUNNING_STAGE.get() is self.running


def stage_log_path(cfg: Config, stage: str) -> Path:
    return Path(cfg.ops.log_dir) / f"{stage}.log"


@contextmanager
def stage_log(stage: str, cfg: Config, run: RunTracker) -> Iterator[Path]:
    """The block's records to the stage's log file, then to its MLflow run. A failure leaving
    the block is written there with its traceback, and the console names the file."""
    path = stage_log_path(cfg, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    running = RunningStage(stage)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    handler.addFilter(InStage(running))
    handler.addFilter(ScrubURLCredentials())
    start = path.stat().st_size
    token = RUNNING_STAGE.set(running)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        handler.stream.write(f"==== stage {stage}, MLflow run {run.run_id}, "
                             f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(running.started))}\n")
        handler.flush()
        yield path
    except BaseException as err:
        record = logging.LogRecord(__name__, logging.ERROR, "", 0, "stage %s stopped: %s",
                                   (stage, f"{type(err).__name__}: {err}"),
                                   (type(err), err, err.__traceback__))
        handler.handle(record)  # the traceback to the file; the console gets one line, below
        if not isinstance(err, (KeyboardInterrupt, SystemExit)):
            log.error("stage %s failed; its full log: %s", stage, path)
        raise
    finally:
        root.removeHandler(handler)
        handler.close()
        RUNNING_STAGE.reset(token)
        attach_to_run(path, start, stage, run)


def attach_to_run(path: Path, start: int, stage: str, run: RunTracker) -> None:
    """This run's part of the file (from byte `start`) to the MLflow run, as logs/<stage>.log."""
    with path.open("rb") as whole, tempfile.TemporaryDirectory() as scratch:
        whole.seek(start)
        part = Path(scratch) / f"{stage}.log"
        part.write_bytes(whole.read())
        run.log_artifact(part, "logs")
