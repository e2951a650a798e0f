"""The console a person reads (flows/console.py), the rank lines the launcher relays to it
(tasks/train/launch.py) and each stage's full log beside it (tasks/stage_log.py)."""

from __future__ import annotations

import contextvars
import io
import logging
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient

from forgeline.flows.cli import build_parser
from forgeline.flows.console import (
    QUIET_ENV,
    STAGE_COLUMN,
    ConsoleHandler,
    EventFormatter,
    configure_console,
    shown_by_default,
)
from forgeline.tasks.stage_log import RUNNING_STAGE, RunningStage, stage_log
from forgeline.tasks.tracking import resolve_tracking_uri, tracked_run
from forgeline.tasks.train.launch import relay_line
from tests.conftest import debug_config

METRICS_LINE = ("[rank0] 2026-12-03 20:58:51,713 INFO forgeline.model.training.metrics: "
                "[#####...............]  25% step 5/20  loss 6.659  lr 0.003  grad_norm 0.4725  mfu 0.17")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def console() -> Iterator[tuple[io.StringIO, ConsoleHandler]]:
    """The default console on a string, as the only handler of a fresh logger tree's root."""
    stream = io.StringIO()
    handler = ConsoleHandler(stream, live=False)
    handler.setFormatter(EventFormatter())
    handler.addFilter(shown_by_default)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield stream, handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def test_the_default_console_shows_forgeline_events_and_other_libraries_errors_only(console) -> None:
    stream, _ = console
    logging.getLogger("forgeline.tasks.cache").info("stage train runs (no record of an earlier run)")
    logging.getLogger("lm_eval.evaluator").warning("Overwriting default num_fewshot of forgeline_mmlu")
    logging.getLogger("lm_eval.evaluator").info("Running loglikelihood requests")
    logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables...")
    logging.getLogger("prefect.task_runs").info("Finished in state Completed()")
    logging.getLogger("prefect.flow_runs").warning("the API did not answer")
    # How a run ended, once per task and flow run around it: the command's last line says it once.
    for logger in ("prefect.task_runs", "prefect.flow_runs", "prefect.flow_runs"):
        logging.getLogger(logger).error("Crash detected! Execution was aborted by a termination signal.")
    logging.getLogger("prefect.task_runs").error("Task run failed with exception: ValueError('x')")
    logging.getLogger("prefect.task_runs").error("Finished in state Failed('Task run encountered an error')")
    logging.getLogger("prefect.flow_runs").error("Encountered exception during execution: ValueError('x')")
    logging.getLogger("py.warnings").warning("UserWarning: Add type hints to the `predict` method")
    logging.getLogger("a.library").error("a library's error")
    lines = stream.getvalue().splitlines()
    column = " " * STAGE_COLUMN  # no stage running: the messages line up under the stages' lines
    assert [line[9:] for line in lines] == [
        f"{column}stage train runs (no record of an earlier run)",
        f"{column}warning: the API did not answer",
        f"{column}error: a library's error",
    ]
    assert all(line[2] == ":" and line[5] == ":" for line in lines)  # HH:MM:SS, once


def test_a_line_names_the_stage_running_in_its_context(console, tmp_path: Path) -> None:
    stream, _ = console
    cfg = debug_config(tmp_path)
    with tracked_run(cfg, "train") as run, stage_log("train", cfg, run):
        logging.getLogger("forgeline.tasks.train.job").info("launching")
    assert stream.getvalue().splitlines()[-1][9:] == "train".ljust(STAGE_COLUMN) + "launching"


def test_a_rank_line_is_relayed_at_its_level_with_one_time_stamp_and_its_step_as_progress(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    job = logging.getLogger("forgeline.tasks.train.job")
    relay_line(job, METRICS_LINE)
    relay_line(job, "[rank0] 2026-12-03 20:58:51,800 INFO alembic.runtime.migration: Context impl.")
    relay_line(job, "[rank1] 2026-12-03 20:58:52,000 WARNING forgeline.model.training.loop: rank 1 is slow")
    relay_line(job, "W1203 20:31:33.002000 23102 torch/distributed/run.py:803] *****")
    metrics, alembic, slow, torchrun = caplog.records
    assert [r.name for r in caplog.records] == [
        "forgeline.model.training.metrics", "alembic.runtime.migration", "forgeline.model.training.loop",
        "forgeline.tasks.train.job"]
    assert not shown_by_default(alembic)  # a library's INFO line in a rank: the stage's log file only
    assert metrics.getMessage() == "[rank0] [#####...............]  25% step 5/20  loss 6.659  lr 0.003  " \
                                   "grad_norm 0.4725  mfu 0.17"
    assert metrics.levelno == logging.INFO and metrics.progress[:2] == (5, 20)
    assert metrics.progress[2].startswith("loss 6.659")
    assert slow.levelno == logging.WARNING and slow.getMessage() == "[rank1] rank 1 is slow"
    assert not hasattr(slow, "progress")
    assert torchrun.getMessage().startswith("W1203 20:31:33") and torchrun.levelno == logging.INFO


def test_on_a_terminal_a_stages_progress_is_one_bar_redrawn_with_lines_above_it() -> None:
    terminal = Terminal()
    handler = ConsoleHandler(terminal, live=True)
    handler.setFormatter(EventFormatter())
    job, forgeline = logging.getLogger("forgeline.tasks.train.job"), logging.getLogger("forgeline")
    forgeline.addHandler(handler)
    forgeline.setLevel(logging.INFO)
    running = RUNNING_STAGE.set(RunningStage("train"))
    try:
        for step in (5, 10):
            relay_line(job, METRICS_LINE.replace("step 5/20", f"step {step}/20"))
        job.info("checkpoint committed")
        relay_line(job, METRICS_LINE.replace("step 5/20", "step 20/20"))
    finally:
        RUNNING_STAGE.reset(running)
        forgeline.removeHandler(handler)
        forgeline.setLevel(logging.NOTSET)
    shown = terminal.getvalue()
    assert "[#####." not in shown and "grad_norm" not in shown  # the bar in place of the metrics lines
    draws = shown.split("\r")[1:]  # each drawing of the bar starts at the line's start
    drawn = [draw.split("|")[0].split() for draw in draws if draw.startswith("train")]
    assert drawn == [["train", "0%"], ["train", "25%"], ["train", "50%"], ["train", "50%"],
                     ["train", "100%"], ["train", "100%"]]  # the last, redrawn as it closes
    assert draws[-1].endswith("20/20 [00:00<00:00], loss 6.659  lr 0.003\n")  # left as it ended
    assert "checkpoint committed\n" in shown  # a line above the bar, which is drawn again below it
    assert shown.count("\n") == 2 and handler.bar is None  # closed at its total


def test_verbose_shows_every_librarys_records_with_their_names_and_the_default_turns_bars_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key in QUIET_ENV:
        monkeypatch.delenv(key, raising=False)
    root = logging.getLogger()
    before = list(root.handlers), root.level

    def log_as_libraries_do() -> None:
        logging.getLogger("a.library").info("Running loglikelihood requests")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("Add type hints to the `predict` method", UserWarning, stacklevel=1)

    loud, quiet = io.StringIO(), io.StringIO()
    logging.captureWarnings(False)  # an earlier test's capture, its showwarning since put back by pytest
    try:
        configure_console(verbose=True, stream=loud)
        log_as_libraries_do()
        assert "TQDM_DISABLE" not in os.environ
        configure_console(verbose=False, stream=quiet)  # in place of the first
        log_as_libraries_do()
        assert os.environ["TQDM_DISABLE"] == "1"
        assert os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] == "WARNING"
        assert sum(isinstance(h, ConsoleHandler) for h in root.handlers) == 1
    finally:
        logging.captureWarnings(False)
        root.handlers[:], root.level = before
    assert "INFO a.library: Running loglikelihood requests" in loud.getvalue()
    assert "UserWarning: Add type hints" in loud.getvalue()
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("argv", [["-v", "run"], ["run", "-v"], ["run", "--verbose"],
                                  ["config", "show", "-v"], ["-v", "status"]])
def test_verbose_is_taken_before_or_after_the_verb(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).verbose
    assert not build_parser().parse_args([a for a in argv if not a.startswith("-")]).verbose


def test_a_stage_log_keeps_its_own_records_and_its_run_gets_its_part(tmp_path: Path) -> None:
    """The launcher's reader thread (started with the stage's context) counts; a thread of
    another stage running at once does not; the file keeps earlier runs, the MLflow run gets
    its own."""
    cfg = debug_config(tmp_path)
    log = logging.getLogger("forgeline.tasks.train.job")
    log.setLevel(logging.INFO)
    other_started, other_may_end = threading.Event(), threading.Event()

    def another_stage() -> None:
        with tracked_run(cfg, "eval") as run, stage_log("eval", cfg, run):
            other_started.set()
            other_may_end.wait(10)
            log.info("an eval line")

    try:
        with tracked_run(cfg, "train") as first, stage_log("train", cfg, first):
            log.info("first run")
        other = threading.Thread(target=another_stage)
        other.start()
        other_started.wait(10)
        with tracked_run(cfg, "train") as second, stage_log("train", cfg, second) as path:
            context = contextvars.copy_context()
            reader = threading.Thread(target=context.run, args=(log.info, "from the reader thread"))
            reader.start()
            reader.join()
            other_may_end.set()
            other.join()
            log.info("second run")
    finally:
        log.setLevel(logging.NOTSET)
    text = path.read_text()
    assert path == tmp_path / "logs" / "train.log"
    assert text.count("==== stage train") == 2 and "first run" in text and "second run" in text
    assert "from the reader thread" in text and "an eval line" not in text
    client = MlflowClient(resolve_tracking_uri(cfg))
    attached = Path(client.download_artifacts(second.run_id, "logs/train.log", str(tmp_path / "down")))
    assert "second run" in attached.read_text() and "first run" not in attached.read_text()
    assert "an eval line" in (tmp_path / "logs" / "eval.log").read_text()


def test_a_stage_that_fails_leaves_its_traceback_in_the_file_and_names_it_on_the_console(
        console, tmp_path: Path) -> None:
    stream, _ = console
    cfg = debug_config(tmp_path)
    with pytest.raises(ValueError, match="no such token"), tracked_run(cfg, "data") as run, \
            stage_log("data", cfg, run):
        raise ValueError("no such token")
    text = (tmp_path / "logs" / "data.log").read_text()
    assert "stage data stopped: ValueError: no such token" in text and "Traceback" in text
    assert stream.getvalue().splitlines()[-1][9:] == \
        "data".ljust(STAGE_COLUMN) + f"error: stage data failed; its full log: {tmp_path / 'logs/data.log'}"
