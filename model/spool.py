"""The tracking spool: every write a forgeline process makes to an MLflow run goes first to a
local append-only file, then to the tracking store from a background thread, in order.

A tracking server that restarts, is redeployed or falls over must never block a training step
or kill a rank, and must not lose a metric. So a write is durable on local disk before the store
sees it: `<spool>/<run_id>/<writer>-<host>-<pid>-<n>.jsonl`, one JSON record a line, with
`<same>.sent` counting the records the store accepted. While the store does not answer, records
wait in the file and the sender retries with backoff; when it answers again they are replayed,
in order. What a process leaves unsent when it ends (the store never came back) waits for the
next `forgeline sync`, which replays every file no live writer holds (a writer keeps an flock on
its file).

A run's directory goes once everything in it is sent (`discard_sent`), and never from under a
writer: every writer holds a shared flock on the directory's `.writers.lock` from before it
creates its file until it closes, the removal takes that lock exclusively and each file's lock,
and checks under them that all is sent. A writer that finds the directory removed while it waited
makes it anew. A file without its header (its writer killed between creating it and writing the
header) holds no write: it is skipped, and removed with its directory.

Replay is idempotent, so a record sent twice (the store committed it, the answer was lost) is
recorded once: MLflow keeps one metric per (key, value, timestamp, step) -- the timestamp is
taken when the write is spooled, not when it is sent -- logging a param again with its value is a
no-op, and tags, artifacts and a run's end overwrite. A record the store refuses for good (a
param changed value, a deleted run) is moved to `<file>.rejected` with the reason and skipped.

The files name the store by its URI with credentials masked (a password, a token in its query:
configs/redaction.py): they stay on disk, maybe for days. Replay sends to the URI in the file's
header when it has none, else to this process's store (MLflow's tracking URI, credentials
included) when its URI masks to the header's -- the same store, whatever its password is now.

Imports nothing of forgeline but the masking (the standard library only): the rank program, the
in-training evaluation and the stages use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import shutil
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from forgeline.configs.redaction import scrub, url_credential

log = logging.getLogger(__name__)

# For the processes the train stage starts (the ranks, the in-training evaluation): the spool
# directory (ops.tracking_spool) and how long to wait for the store at the end (ops.tracking_flush_s).
SPOOL_ENV = "FORGELINE_TRACKING_SPOOL"
FLUSH_ENV = "FORGELINE_TRACKING_FLUSH_S"
# MLflow's limits per log_batch request.
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100
RETRY_MIN_S, RETRY_MAX_S = 1.0, 30.0
WRITERS_LOCK_NAME = ".writers.lock"  # in a run's spool directory: shared by its live writers
_SPOOL_NUMBERS = itertools.count()
# Answers that resending cannot change: the record is rejected, not retried.
PERMANENT_ERRORS = frozenset({"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE",
                              "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST"})


class TrackingSpool:
    """The spool of one writer (a process) for one run. `log_*` return once the record is on
    disk; with `wait=True`, and while the store answers, they also wait (at most `wait_s`) until
    it is sent, so a read after a write sees it and a refusal reaches the caller."""

    def __init__(self, root: str | Path, run_id: str, tracking_uri: str, writer: str, wait_s: float = 30.0):
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.store = scrub(tracking_uri)  # as files and messages name it
        self.wait_s = wait_s
        self.dir = Path(root) / run_id
        self._dir_lock = _join_run_dir(self.dir)  # held until close: the directory stays
        self.path, self._file = _new_spool_file(self.dir, f"{writer}-{socket.gethostname()}-{os.getpid()}")
        self._cond = threading.Condition()
        self._pending: deque[tuple[int, dict]] = deque()
        self._written = self._sent = 0
        self._rejected: dict[int, str] = {}
        self._outage_since: float | None = None
        self._failures = 0  # failed attempts to send, all told
        self._warned = False  # about the outage under way
        self._closed = False
        self._stopped = False  # past close's deadline: what is left is sync's
        self._write({"op": "open", "run_id": run_id, "tracking_uri": self.store})
        self._sent = 1  # the header is no write to send
        _write_count(self.path, 1)
        self._thread = threading.Thread(target=self._send_loop, name=f"tracking-spool-{run_id[:8]}",
                                        daemon=True)
        self._thread.start()

    # -- writes ---------------------------------------------------------------------------------
    def log_batch(self, metrics: list[tuple[str, float, int, int]] = (), params: dict[str, str] | None = None,
                  tags: dict[str, str] | None = None, wait: bool = False) -> None:
        """Metrics as (key, value, timestamp ms, step); params and tags as strings."""
        metrics, params, tags = list(metrics), list((params or {}).items()), list((tags or {}).items())
        last = None
        for key, items, size in (("metrics", metrics, MAX_METRICS), ("params", params, MAX_PARAMS),
                                 ("tags", tags, MAX_TAGS)):
            for start in range(0, len(items), size):
                last = self._append({"op": "batch", key: items[start:start + size]})
        self._wait_for(last, wait)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None, wait: bool = False,
                     landed: bool = False) -> None:
        """A copy of the file or directory, taken now: the original may change before it is sent.
        With `landed=True` the call waits as `wait=True` does and raises NotLanded unless the store
        holds it when it returns: for a file that is read back from the store next."""
        path = Path(path)
        copy = self.dir / "files" / f"{self.path.stem}-{self._written}" / path.name
        copy.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            shutil.copytree(path, copy)
        else:
            shutil.copy2(path, copy)
        seq = self._append({"op": "artifact", "file": str(copy.relative_to(self.dir)),
                            "artifact_path": artifact_path})
        self._wait_for(seq, wait or landed)
        if landed and not self._is_sent(seq):
            raise NotLanded(f"{path.name} did not reach the tracking store {self.store} within "
                            f"{self.wait_s:g} s (it is down or does not answer); it waits in {self.path} "
                            "and `forgeline sync` sends it once the store answers")

    def log_input(self, dataset: dict[str, str], context: str, wait: bool = False) -> None:
        """An input dataset: name, digest, source_type, source."""
        self._wait_for(self._append({"op": "input", "dataset": dataset, "context": context}), wait)

    def terminate(self, status: str, wait: bool = False) -> None:
        self._wait_for(self._append({"op": "terminate", "status": status,
                                     "end_time": int(time.time() * 1000)}), wait)

    def _is_sent(self, seq: int) -> bool:
        with self._cond:
            return self._sent >= seq

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    @property
    def waiting(self) -> int:
        """Writes waiting for a store that does not answer (0 while it does: what is pending then
        goes within moments)."""
        with self._cond:
            return len(self._pending) if self._outage_since is not None else 0

    def close(self, deadline_s: float) -> int:
        """Send what is left, waiting at most `deadline_s` -- and no longer than one more attempt
        when the store is down already; returns the records still unsent, which stay in the file
        for `forgeline sync`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            failures = self._failures
            down = self._outage_since is not None
            self._cond.wait_for(lambda: not self._pending or (down and self._failures > failures),
                                timeout=deadline_s)
            left = len(self._pending)
            self._stopped = True
            self._cond.notify_all()
        if left:
            log.warning("tracking store %s: %d write(s) of run %s not sent (%s); they are kept in %s -- "
                        "`forgeline sync` sends them once the store answers", self.store, left,
                        self.run_id, "it is down" if down else f"not within {deadline_s:.0f} s", self.path)
        self._file.close()  # and the locks: sync may take the file over
        self._dir_lock.close()
        return left

    # -- internals ------------------------------------------------------------------------------
    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # in the OS's hands: survives the process being killed
        self._written += 1

    def _append(self, record: dict) -> int:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"tracking spool {self.path} is closed")
            self._write(record)
            self._pending.append((self._written, record))
            self._cond.notify_all()
            return self._written

    def _wait_for(self, seq: int | None, wait: bool = True) -> None:
        if not wait or seq is None:
            return
        with self._cond:
            answered = self._cond.wait_for(lambda: self._sent >= seq or self._outage_since is not None,
                                           timeout=self.wait_s)
            if not answered:  # a store that hangs is down too: the next writes do not wait for it
                self._outage_since = time.time()
            error = self._rejected.pop(seq, None)
        if error is not None:
            raise SpoolRejected(error)

    def _send_loop(self) -> None:
        from mlflow import MlflowClient  # here: a rank that logs nothing never imports mlflow

        # One warning per outage is the spool's (`_note_outage`), not one per retried request.
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)

        client = MlflowClient(self.tracking_uri)
        delay, retried_at_close = RETRY_MIN_S, False
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending or self._stopped:
                    return
                seq, record = self._pending[0]
            try:
                send(client, self.run_id, record, self.dir)
            except Exception as err:  # noqa: BLE001 -- whatever the store raised, the record waits
                if is_permanent(err):
                    self._reject(seq, record, err)
                    continue
                self._note_outage(err)
                with self._cond:  # backing off; a close cuts the wait short once, for one more try
                    self._cond.wait_for(lambda retried=retried_at_close: self._closed and not retried,
                                        timeout=delay)
                    retried_at_close = self._closed
                delay = min(2 * delay, RETRY_MAX_S)
                continue
            delay = RETRY_MIN_S
            self._delivered(seq)

    def _delivered(self, seq: int) -> None:
        with self._cond:
            self._pending.popleft()
            self._sent = seq
            _write_count(self.path, seq)
            if self._outage_since is not None:
                log.warning("tracking store %s answers again after %.0f s; %d write(s) of run %s still to "
                            "send", self.store, time.time() - self._outage_since, len(self._pending),
                            self.run_id)
                self._outage_since, self._warned = None, False
            self._cond.notify_all()

    def _reject(self, seq: int, record: dict, err: Exception) -> None:
        set_aside(self.path, record, err)
        with self._cond:
            self._rejected[seq] = str(err)
        self._delivered(seq)

    def _note_outage(self, err: Exception) -> None:
        with self._cond:
            self._failures += 1
            first, self._warned = not self._warned, True
            if self._outage_since is None:
                self._outage_since = time.time()
            self._cond.notify_all()  # writers waiting for delivery stop waiting
            pending = len(self._pending)
        if first:
            log.warning("tracking store %s does not answer (%s); run %s's writes go to %s (%d pending) "
                        "and are sent when it does", self.store, scrub(str(err).splitlines()[0][:300]),
                        self.run_id, self.path, pending)


def _join_run_dir(run_dir: Path) -> IO[str]:
    """The run's spool directory, made if need be, with a shared lock on it held (the returned
    file): no sync removes the directory until it is closed."""
    while True:
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            lock = open(run_dir / WRITERS_LOCK_NAME, "a+")  # readable: NFS maps a shared flock to a read lock
        except FileNotFoundError:
            continue  # a sync removed the directory just now
        fcntl.flock(lock, fcntl.LOCK_SH)  # waits while a sync is removing the directory
        if _still_linked(run_dir / WRITERS_LOCK_NAME, lock):
            return lock
        lock.close()  # it was removed while this writer waited: make it anew


def _new_spool_file(run_dir: Path, stem: str) -> tuple[Path, IO[str]]:
    """A file of its own for one spool -- also of a run a process opens again (a Prefect retry in
    the same process), also where a dead process of the same pid left one -- locked for as long
    as it is open."""
    while True:
        path = run_dir / f"{stem}-{next(_SPOOL_NUMBERS)}.jsonl"
        try:
            file = path.open("x")
        except FileExistsError:
            continue
        # Waits, rarely: a sync may hold it a moment, finding it without its header yet.
        fcntl.flock(file, fcntl.LOCK_EX)
        return path, file


def _still_linked(path: Path, file: IO[str]) -> bool:
    """Whether `path` still names the file open as `file` (no one removed it)."""
    try:
        named, held = os.stat(path), os.fstat(file.fileno())
    except FileNotFoundError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def spool_from_environment(run_id: str, writer: str) -> TrackingSpool:
    """The spool of a process the train stage started: the directory and the store (MLflow's
    MLFLOW_TRACKING_URI) its launcher named in the environment."""
    return TrackingSpool(os.environ[SPOOL_ENV], run_id, os.environ["MLFLOW_TRACKING_URI"], writer)


def flush_deadline_s() -> float:
    return float(os.environ.get(FLUSH_ENV, "30"))


class NotLanded(RuntimeError):
    """A write its caller needs in the store at once is not there yet (model/spool.py log_artifact)."""


class SpoolRejected(RuntimeError):
    """The tracking store refused a write for good (e.g. a param logged again with another value)."""


def is_permanent(err: Exception) -> bool:
    return getattr(err, "error_code", None) in PERMANENT_ERRORS


def send(client: Any, run_id: str, record: dict, spool_dir: Path) -> None:
    """One spooled record to the store through `client` (an MlflowClient)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag

    op = record["op"]
    if op == "batch":
        metrics = [Metric(key, value, ts, step) for key, value, ts, step in record.get("metrics", [])]
        client.log_batch(run_id, metrics=metrics,
                         params=[Param(k, v) for k, v in record.get("params", [])],
                         tags=[RunTag(k, v) for k, v in record.get("tags", [])])
    elif op == "artifact":
        path = spool_dir / record["file"]
        if path.is_dir():
            client.log_artifacts(run_id, str(path), record["artifact_path"])
        else:
            client.log_artifact(run_id, str(path), record["artifact_path"])
    elif op == "input":
        context = InputTag("mlflow.data.context", record["context"])
        client.log_inputs(run_id, datasets=[DatasetInput(Dataset(**record["dataset"]), tags=[context])])
    elif op == "terminate":
        client.set_terminated(run_id, record["status"], record["end_time"])
    else:
        raise ValueError(f"unknown spool record {op!r}")


def set_aside(path: Path, record: dict, err: Exception) -> None:
    """A record of spool file `path` the store refused for good, kept with the reason in
    `<path>.rejected` and skipped."""
    log.error("the tracking store refused a write of %s for good, skipped (kept in %s.rejected): %s",
              path, path, scrub(str(err)))
    with open(f"{path}.rejected", "a") as f:
        f.write(json.dumps({"record": record, "error": scrub(str(err))}) + "\n")


def _write_count(path: Path, count: int) -> None:
    tmp = path.with_name(path.name + ".sent.tmp")
    tmp.write_text(str(count))
    os.replace(tmp, path.with_name(path.name + ".sent"))


def _sent_count(path: Path) -> int:
    """Records of spool file `path` done with, its header included (a writer killed before it
    counted the header has still sent nothing else)."""
    try:
        return max(int(path.with_name(path.name + ".sent").read_text()), 1)
    except (OSError, ValueError):
        return 1


def read_records(path: Path) -> list[dict]:
    """The records of a spool file, its header first; a last line cut short by a crash is not
    one. None at all without a header: its writer died before writing one, or before even that
    (an empty file), and wrote nothing else -- or the file was removed meanwhile, all sent."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            break
    return records if records and records[0].get("op") == "open" else []


def spool_files(root: str | Path, run_id: str = "*") -> Iterator[Path]:
    yield from sorted(Path(root).glob(f"{run_id}/*.jsonl"))


def _unheld(path: Path) -> IO[str] | None:
    """The file opened with its writer's lock taken, or None while a live writer (or another
    sync) holds it, or once it is removed."""
    try:
        handle = path.open("r+")  # not "a": that would make anew a file removed meanwhile
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    if not _still_linked(path, handle):  # removed while this sync waited for it
        handle.close()
        return None
    return handle


def unsent(root: str | Path) -> dict[Path, int]:
    """Records not yet sent, by spool file."""
    return {path: left for path in spool_files(root)
            if (left := len(read_records(path)) - _sent_count(path)) > 0}


def replay(root: str | Path, run_id: str = "*", discard: bool = True,
           tracking_uri: str | None = None) -> tuple[int, int]:
    """Send what every spool file (of `run_id`) no live writer holds has left, in order, to its
    store (`replay_uri`: this process's is `tracking_uri`, by default MLflow's); with `discard`,
    a run directory whose files are all sent goes. Returns (records sent, records still unsent)."""
    import mlflow
    from mlflow import MlflowClient

    live_uri = tracking_uri or mlflow.get_tracking_uri()
    sent = left = 0
    for path in spool_files(root, run_id):
        handle = _unheld(path)
        if handle is None:
            continue  # its writer is alive and sends it itself
        with handle:
            records = read_records(path)
            if not records:
                continue  # no header, so no write: its writer died creating it
            done = _sent_count(path)
            header = records[0]
            uri = replay_uri(header["tracking_uri"], live_uri)
            if uri is None:
                log.warning("%s: %d write(s) wait for the tracking store %s, whose credentials the spool "
                            "does not keep: `forgeline sync` with MLFLOW_TRACKING_URI set to it sends them",
                            path, len(records) - done, header["tracking_uri"])
                left += len(records) - done
                continue
            client = MlflowClient(uri)
            for seq, record in enumerate(records[done:], start=done + 1):
                try:
                    send(client, header["run_id"], record, path.parent)
                except Exception as err:  # noqa: BLE001
                    if not is_permanent(err):
                        log.warning("%s: %d write(s) still unsent: %s", path, len(records) - seq + 1,
                                    scrub(str(err).splitlines()[0][:300]))
                        left += len(records) - seq + 1
                        break
                    set_aside(path, record, err)
                _write_count(path, seq)
                sent += 1
    for run_dir in {path.parent for path in spool_files(root, run_id)} if discard else ():
        discard_sent(run_dir)
    return sent, left


def replay_uri(written: str, live: str) -> str | None:
    """Where a spool file whose header names the store `written` is replayed: this process's
    store (`live`) when it is the same one, its URI masked alike (its credentials may have changed
    since); else `written` itself, unless that was masked: then no URI the spool knows reaches it."""
    if scrub(live) == scrub(written):
        return live
    return None if written == scrub(written) and url_credential(written) else written


def discard_sent(run_dir: Path) -> bool:
    """Remove a run's spool directory if no writer is alive in it and every file in it is sent;
    whether it is gone. Checked and removed under the directory's lock (which every live writer
    holds shared) and every file's (which a replay holds while it sends it)."""
    try:
        dir_lock = open(run_dir / WRITERS_LOCK_NAME, "a+")
    except FileNotFoundError:
        return not run_dir.exists()  # removed by another sync
    with contextlib.ExitStack() as held:
        held.enter_context(dir_lock)
        try:
            fcntl.flock(dir_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a writer is alive
        if not _still_linked(run_dir / WRITERS_LOCK_NAME, dir_lock):
            return not run_dir.exists()  # removed by another sync while this one waited
        for path in run_dir.glob("*.jsonl"):
            handle = _unheld(path)
            if handle is None:
                return False  # a replay is sending it
            held.enter_context(handle)
            if len(read_records(path)) > _sent_count(path):
                return False
        shutil.rmtree(run_dir, ignore_errors=True)
    return True


def spooled_metric(root: str | Path, run_id: str, key: str) -> list[tuple[int, float, int]]:
    """(timestamp, value, step) of every value of metric `key` spooled for the run, sent or not:
    what the run holds, or will once the store answers."""
    found = []
    for path in spool_files(root, run_id):
        for record in read_records(path)[1:]:
            found += [(ts, value, step) for k, value, ts, step in record.get("metrics", []) if k == key]
    return found
