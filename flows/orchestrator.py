"""When the Prefect API goes away under a flow run: the work goes on, and the final states the
API could not be told wait in a small durable record until `forgeline sync` -- or the next flow
run from the same directory and API -- replays them.

A flow writes the record of its final state, and of its task runs', just before Prefect's engine
reports it (write-ahead), and a completion/failure hook removes the record once the API has
accepted that state. So a record that outlives its flow run holds exactly what the API never
got. Task runs need it too: Prefect 3 sends their states as events, which are lost while the API
is away, whereas the engine reports the flow run's state with a request that fails.

The records are JSON files, one per flow run, under `.forgeline/pending/` in the directory the
flow ran in; `PendingStates` says what each holds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple
from uuid import UUID

import httpx
from prefect import Flow, Task
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, State, StateType
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL, temporary_settings

from forgeline.configs.redaction import scrub
from forgeline.tasks.atomic import write_text_atomic
from forgeline.tasks.tracking import ServerUnreachable

log = logging.getLogger(__name__)

PENDING_DIR = Path(".forgeline") / "pending"
CACHED = "Cached"  # the name of a Completed state whose stage the stage cache skipped
# What the Prefect client raises when its API cannot be reached or fails: a transport error
# (refused, reset, timed out) or an HTTP error status (PrefectHTTPStatusError is a subclass).
API_ERRORS = (httpx.HTTPError,)


@dataclass(frozen=True)
class PendingStates:
    """The final states of one flow run (and of its task runs) that the Prefect API has not
    acknowledged."""

    api_url: str | None  # PREFECT_API_URL of the run; None: Prefect's temporary local API
    flow_run_id: str
    flow_name: str
    state: str  # a StateType value: COMPLETED or FAILED
    message: str  # what the run ended with: a summary, or the error that failed it
    task_runs: list[dict[str, str]] = field(default_factory=list)  # {"id", "name", "state"}, in run order
    finished_at: str = ""  # ISO 8601, UTC
    pid: int = 0  # the process that ran the flow: the CLI finds its own run's record by it

    @property
    def completed(self) -> bool:
        return self.state == StateType.COMPLETED.value

    def path(self, directory: Path = PENDING_DIR) -> Path:
        return directory / f"{self.flow_run_id}.json"

    def write(self, directory: Path = PENDING_DIR) -> Path:
        path = self.path(directory)
        write_text_atomic(path, json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, path: Path) -> PendingStates:
        return cls(**json.loads(path.read_text()))


def pending_records(directory: Path = PENDING_DIR) -> list[PendingStates]:
    """The records waiting in `directory`, oldest first (a half-written temporary file is no
    record: its name does not end in .json)."""
    if not directory.is_dir():
        return []
    records = [PendingStates.read(path) for path in directory.glob("*.json")]
    return sorted(records, key=lambda record: record.finished_at)


def forget(flow_run_id: str, directory: Path = PENDING_DIR) -> None:
    """Remove a flow run's record, and the directories it leaves empty (no trace in a checkout)."""
    (directory / f"{flow_run_id}.json").unlink(missing_ok=True)
    for empty in (directory, directory.parent) if directory == PENDING_DIR else (directory,):
        try:
            empty.rmdir()
        except OSError:  # not empty (another record, a temporary file), or gone already
            break


def forget_reported_states(flow: Flow, run: FlowRun, state: State) -> None:
    """on_completion and on_failure hook: Prefect calls it once the API has accepted the flow
    run's final state, so the run's record has nothing left to replay."""
    forget(str(run.id))


class FinalStates:
    """Inside a flow run: its task runs' final states, and a summary for the flow run's own."""

    def __init__(self) -> None:
        self.task_runs: list[dict[str, str]] = []
        self.cached: list[str] = []  # the tasks that ended Cached: their stage was skipped
        self.message = ""

    def run(self, task: Task, *args: Any) -> Any:
        """`task(*args)`, noting its task run's final state; raises what the task raised."""
        state = task(*args, return_state=True)
        self.task_runs.append({"id": str(state.state_details.task_run_id), "name": task.name,
                               "state": state.type.value})
        if state.name == CACHED:
            self.cached.append(task.name)
        return state.result()

    def summary(self) -> str:
        """Which stages ran and which were skipped as cached: `ran eval, register; cached data, train`."""
        ran = [run["name"] for run in self.task_runs if run["name"] not in self.cached]
        parts = (("ran", ran), ("cached", self.cached))
        return "; ".join(f"{what} {', '.join(names)}" for what, names in parts if names)


@contextmanager
def final_states_recorded() -> Iterator[FinalStates]:
    """Around a flow's work: write the flow run's record as the work ends, Completed or (the
    work raised) Failed, before the engine reports that state."""
    ledger = FinalStates()
    try:
        yield ledger
    except Exception as err:
        _record(ledger, StateType.FAILED, f"{type(err).__name__}: {err}")
        raise
    _record(ledger, StateType.COMPLETED, ledger.message)


def _record(ledger: FinalStates, state: StateType, message: str) -> None:
    record = PendingStates(api_url=PREFECT_API_URL.value(), flow_run_id=str(flow_run.id),
                           flow_name=flow_run.flow_name, state=state.value, message=message,
                           task_runs=ledger.task_runs, pid=os.getpid(),
                           finished_at=datetime.now(UTC).isoformat(timespec="seconds"))
    try:
        record.write()
    except OSError as err:  # the record only matters should the API fail too: it costs no finished work
        log.warning("could not write %s (%s): should the Prefect API miss this flow run's end, `forgeline "
                    "sync` will not know of it", record.path(), err)


def unreported_record(since: float, directory: Path = PENDING_DIR) -> PendingStates | None:
    """The record this process wrote after `since` (time.time()) that is still there: the final
    state of its flow run that the API did not accept."""
    if not directory.is_dir():
        return None
    mine = [record for record in pending_records(directory)
            if record.pid == os.getpid() and record.path(directory).stat().st_mtime >= since - 1]
    return mine[-1] if mine else None


class SyncReport(NamedTuple):
    """What one replayer of `forgeline sync` did: lines to print, and how many records are
    still pending (their API still unreachable)."""

    lines: list[str]
    left: int


def replay_flow_states(api_url: str | None = None, directory: Path = PENDING_DIR) -> SyncReport:
    """Replay the pending flow-run and task-run final states to the API each was meant for
    (only those meant for `api_url`, if given), with force: the API has had no state from
    those runs since. Idempotent: a run already in its final state is left as it is, and a
    record goes once the API has taken it."""
    records = [record for record in pending_records(directory)
               if api_url is None or record.api_url == api_url]
    if not records:
        return SyncReport([f"flow states: none pending in {directory}"], 0)
    lines, left = [], 0
    for record in records:
        where = record.api_url or "Prefect's temporary local API"
        try:
            done = replay(record)
        except API_ERRORS as err:
            left += 1
            lines.append(f"flow states: flow run {record.flow_run_id} ({record.flow_name}) still pending: "
                         f"the Prefect API at {where} did not take it ({type(err).__name__}: {err})")
            continue
        forget(record.flow_run_id, directory)
        lines.append(f"flow states: flow run {record.flow_run_id} ({record.flow_name}, finished "
                     f"{record.finished_at}) {'; '.join(done)}")
    return SyncReport(lines, left)


def replay(record: PendingStates) -> list[str]:
    """Set the record's states in its API unless they are there already; what was done."""
    message = (f"{record.message + '; ' if record.message else ''}reported by forgeline: the Prefect API "
               f"was unreachable when the run finished at {record.finished_at}")
    done = []
    # The record's API, whatever PREFECT_API_URL says now; none: a temporary local one, as the run had.
    api = temporary_settings({PREFECT_API_URL: record.api_url}) if record.api_url else \
        temporary_settings(restore_defaults={PREFECT_API_URL})
    with api, get_client(sync_client=True) as client:
        for task in record.task_runs:
            try:
                current = client.read_task_run(UUID(task["id"]))
            except ObjectNotFound:  # its creation event was lost with the API
                done.append(f"task run {task['name']} unknown to the API, left out")
                continue
            if current.state_type and current.state_type.value == task["state"]:
                done.append(f"task run {task['name']} was {task['state']} already")
                continue
            client.set_task_run_state(UUID(task["id"]), _state(task["state"], message), force=True)
            done.append(f"task run {task['name']} set {task['state']}")
        try:
            current = client.read_flow_run(UUID(record.flow_run_id))
        except ObjectNotFound:  # a new database behind the same URL: nothing left to report it to
            return [*done, "flow run unknown to the API, record dropped"]
        if current.state_type and current.state_type.value == record.state:
            done.append(f"flow run was {record.state} already")
        else:
            client.set_flow_run_state(UUID(record.flow_run_id), _state(record.state, message), force=True)
            done.append(f"flow run set {record.state}")
    return done


def _state(state_type: str, message: str) -> State:
    kind = StateType(state_type)
    return State(type=kind, name=kind.value.capitalize(), message=message)


class QuietApiErrors(logging.Filter):
    """One line per Prefect API failure. Drops the traceback from a record about an API error
    (Prefect's engine logs the one its final state report fails with; the CLI's message says
    what it means), and names an event that could not be sent instead of printing it whole
    (Prefect's services log every item they fail on: thousands of characters per event)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], API_ERRORS):
            record.exc_info, record.exc_text = None, None
        if record.msg == "Service %r failed to process item %r" and len(record.args or ()) == 2:
            service, item = record.args
            record.args = (service, getattr(item, "event", type(item).__name__))
        return True


def check_api(api_url: str | None, timeout_s: float = 5.0) -> None:
    """Raise ServerUnreachable, before any work, if PREFECT_API_URL names an API whose health
    endpoint does not answer within `timeout_s`: a flow run cannot start without it. None (the
    temporary local API the command starts itself) passes."""
    if not api_url:
        return
    try:
        httpx.get(f"{api_url.rstrip('/')}/health", timeout=timeout_s)
    except httpx.HTTPError as err:
        timed_out = isinstance(err, httpx.TimeoutException)
        reason = f"no answer within {timeout_s:.0f} s" if timed_out else "no connection"
        raise ServerUnreachable(
            f"the Prefect API at {scrub(api_url)} does not answer ({reason}): start it (`prefect server "
            "start`), or unset PREFECT_API_URL to run on a temporary local API that the command starts "
            "and stops itself") from None


def quiet_api_errors() -> None:
    """Install `QuietApiErrors` on the loggers of Prefect's flow and task run engines and its
    background services."""
    for name in ("prefect.flow_runs", "prefect.task_runs", "prefect._internal.concurrency"):
        logger = logging.getLogger(name)
        if not any(isinstance(existing, QuietApiErrors) for existing in logger.filters):
            logger.addFilter(QuietApiErrors())
