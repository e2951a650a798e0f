"""The console a person reads: one line per event, the time and the stage once.

By default it shows forgeline's own records at INFO and above (a rank's relayed line among them,
"[rank0] ..."), Prefect's warnings and errors, and any other library's errors; the libraries'
progress bars are off. The rest -- lm-eval's, MLflow's and Prefect's INFO lines, Python warnings
-- goes to each stage's log file (tasks/stage_log.py) and, inside a flow run, to Prefect.
`--verbose` shows every record at INFO and above, each with its logger's name, and the
libraries' progress bars.

On a terminal, a stage's progress (a record with `progress`: done, total, what it says) draws one
progress bar, redrawn in place, with the other lines printed above it; elsewhere (a file, CI) it
is a line like any other.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, TextIO

from forgeline.configs.environment import PROGRESS_BARS_OFF
from forgeline.configs.redaction import ScrubURLCredentials
from forgeline.tasks.stage import STAGE_NAMES
from forgeline.tasks.stage_log import running_stage_name

# The libraries' progress bars, and the INFO lines of Prefect's own console handler in the
# processes the command starts (Dask workers: "Task run 'data-clean-0' - Finished in state
# Completed()"), off unless --verbose. Read when each library is imported: set before any is.
QUIET_ENV = {
    PROGRESS_BARS_OFF: "1",  # tqdm's default for bars that do not say (lm-eval's, transformers')
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",  # its API handler still gets every record
}

if TYPE_CHECKING:  # tqdm reads its environment when imported: imported once it is set
    from tqdm import tqdm

VERBOSE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_console(verbose: bool, stream: TextIO | None = None) -> None:
    """The root logger's console handler (in place of one set before), at INFO; Python warnings
    become records (py.warnings)."""
    if not verbose:
        for key, value in QUIET_ENV.items():
            os.environ.setdefault(key, value)
    stream = sys.stderr if stream is None else stream
    handler = ConsoleHandler(stream, live=not verbose and stream.isatty())
    if verbose:
        handler.setFormatter(logging.Formatter(VERBOSE_FORMAT))
    else:
        handler.setFormatter(EventFormatter())
        handler.addFilter(shown_by_default)
    handler.addFilter(ScrubURLCredentials())
    root = logging.getLogger()
    for earlier in [h for h in root.handlers if isinstance(h, ConsoleHandler)]:  # once per process
        root.removeHandler(earlier)
        earlier.close()
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one record per Prefect API call, even in files
    logging.captureWarnings(True)


def shown_by_default(record: logging.LogRecord) -> bool:
    """forgeline's INFO and above, Prefect's warnings and above but for its restatements of a
    run's end, the rest's errors."""
    if is_forgelines(record):
        return record.levelno >= logging.INFO
    if record.name == "prefect" or record.name.startswith("prefect."):
        return record.levelno >= logging.WARNING and not restates_a_runs_end(record)
    return record.levelno >= logging.ERROR


# Prefect's run loggers say how each run ended -- the task run, the stage's flow run, the pipeline's
# ("Crash detected! Execution was aborted by a termination signal." three times for one SIGTERM) --
# which the command's last line says once (flows/cli.py): in the stage's log file only.
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
RUN_ENDINGS = ("Finished in state", "Crash detected!", "Encountered exception during execution",
               "Task run failed with")


def restates_a_runs_end(record: logging.LogRecord) -> bool:
    return record.name in RUN_LOGGERS and record.getMessage().startswith(RUN_ENDINGS)


STAGE_COLUMN = max(map(len, STAGE_NAMES)) + 1  # the stage's name and a space: messages line up


class EventFormatter(logging.Formatter):
    """'21:04:05 train    [rank0] step 5/20  loss 6.659': the time, the stage running in the
    record's context, 'warning: ' or 'error: ' above INFO, the message. Another library's record
    shows its first line only (Prefect's failed task run: not its traceback, which is in the
    stage's log file); forgeline's, whole."""

    def format(self, record: logging.LogRecord) -> str:
        when = self.formatTime(record, "%H:%M:%S")
        stage = running_stage_name() or ""
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        message = record.getMessage()
        if not is_forgelines(record):
            return f"{when} {stage:<{STAGE_COLUMN}}{level}{message.splitlines()[0] if message else ''}"
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        text = f"{when} {stage:<{STAGE_COLUMN}}{level}{message}"
        return f"{text}\n{record.exc_text}" if record.exc_text else text


def is_forgelines(record: logging.LogRecord) -> bool:
    return record.name == "forgeline" or record.name.startswith("forgeline.")


class ConsoleHandler(logging.StreamHandler):
    """Writes each record as a line; with `live`, a record's `progress` moves the stage's bar
    instead, and lines are written above the bar."""

    def __init__(self, stream: TextIO, live: bool) -> None:
        super().__init__(stream)
        self.live = live
        self.bar: tqdm | None = None
        self.bar_of = ""  # the stage whose progress the bar shows

    def emit(self, record: logging.LogRecord) -> None:
        progress = getattr(record, "progress", None)
        try:
            if self.live and progress is not None:
                self.advance(running_stage_name() or "", *progress)
                return
            line = self.format(record)
            with self.lock:  # records from the launcher's reader thread and the stage's own
                if self.bar is not None and (running_stage_name() or "") != self.bar_of:
                    self.end_bar()  # its stage has ended: the bar stays as it last was
                if self.bar is not None:
                    self.bar.clear()
                self.stream.write(line + self.terminator)
                self.flush()
                if self.bar is not None:
                    self.bar.refresh()
        except Exception:  # logging's contract: a broken console never breaks the work
            self.handleError(record)

    def advance(self, stage: str, done: int, total: int, says: str) -> None:
        with self.lock:
            other_round = self.bar is not None and (
                (self.bar_of, self.bar.total) != (stage, total) or done < self.bar.n)
            if other_round:  # another stage's, or the same again (a retry, the base's evaluation)
                self.end_bar()
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=f"{stage:<{STAGE_COLUMN - 1}}", file=self.stream,
                                dynamic_ncols=True, leave=True, disable=False, mininterval=0,
                                bar_format="{desc} {percentage:3.0f}%|{bar}| {n}/{total} "
                                           "[{elapsed}<{remaining}]{postfix}")
                self.bar_of = stage
            self.bar.set_postfix_str("  ".join(says.split("  ")[:2]), refresh=False)  # on one line
            self.bar.update(done - self.bar.n)
            if done >= total:
                self.end_bar()

    def end_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        with self.lock:
            self.end_bar()
        super().close()
