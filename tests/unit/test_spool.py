"""The tracking spool (model/spool.py) against real MLflow stores: a sqlite store, and a server
address nothing answers on. Writes are durable before they are sent, wait while the store is
down, are sent in order and exactly once, survive their process, and a refusal does not block
what follows."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from forgeline.model.spool import (
    NotLanded,
    SpoolRejected,
    TrackingSpool,
    read_records,
    replay,
    spooled_metric,
    unsent,
)
from forgeline.tasks.tracking import close_tracker, tracker_for
from tests.conftest import debug_config


def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on: a tracking server that is down."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def store(tmp_path: Path) -> tuple[MlflowClient, str]:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    return client, client.create_run(client.create_experiment("spool")).info.run_id


def test_writes_reach_the_store_in_order_and_the_spool_keeps_them(tmp_path: Path, store) -> None:
    client, run_id = store
    spool = TrackingSpool(tmp_path / "spool", run_id, client.tracking_uri, "rank0")
    spool.log_batch([("loss", 3.0 - step / 10, 1000 + step, step) for step in range(1, 2501)],
                    params={"lr": "0.001"}, tags={"stage": "train"}, wait=True)
    spool.terminate("FINISHED")
    assert spool.close(30) == 0
    history = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 2501))  # 3 requests of <= 1000 metrics
    run = client.get_run(run_id)
    assert run.data.params == {"lr": "0.001"} and run.data.tags["stage"] == "train"
    assert run.info.status == "FINISHED"
    assert len(spooled_metric(tmp_path / "spool", run_id, "loss")) == 2500  # read without the store
    assert not unsent(tmp_path / "spool")


def test_a_store_that_is_down_costs_the_writer_nothing_and_sync_sends_it_all(tmp_path: Path, store) -> None:
    client, run_id = store
    down = TrackingSpool(tmp_path / "spool", run_id, f"http://127.0.0.1:{closed_port()}", "rank0")
    for step in range(1, 31):
        down.log_batch([("loss", float(step), 1000 + step, step)], wait=True)  # returns at once when down
    assert down.close(0.5) > 0  # left for sync, in the file
    [(path, left)] = unsent(tmp_path / "spool").items()
    assert left == 30

    # The store is back (here: the run's own store, written into the file's header).
    records = read_records(path)
    records[0]["tracking_uri"] = client.tracking_uri
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert replay(tmp_path / "spool") == (30, 0)
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(1, 31))
    assert not (tmp_path / "spool" / run_id).exists()  # all sent: the run's spool goes


def test_an_artifact_that_must_land_is_there_when_the_call_returns(tmp_path: Path, store) -> None:
    client, run_id = store
    items = tmp_path / "items.json"
    items.write_text("[]\n")
    spool = TrackingSpool(tmp_path / "spool", run_id, client.tracking_uri, "stage")
    spool.log_artifact(items, "eval", landed=True)
    assert [f.path for f in client.list_artifacts(run_id, "eval")] == ["eval/items.json"]
    assert spool.close(30) == 0


def test_an_artifact_that_must_land_is_an_error_while_the_store_is_down(tmp_path: Path, store) -> None:
    _, run_id = store
    items = tmp_path / "items.json"
    items.write_text("[]\n")
    down = TrackingSpool(tmp_path / "spool", run_id, f"http://127.0.0.1:{closed_port()}", "stage")
    with pytest.raises(NotLanded, match=r"items.json did not reach the tracking store http://127.0.0.1:"):
        down.log_artifact(items, "eval", landed=True)
    assert down.close(0.5) == 1  # kept for sync


def test_an_artifact_that_must_land_is_an_error_while_the_store_is_silent(tmp_path: Path, store) -> None:
    _, run_id = store
    items = tmp_path / "items.json"
    items.write_text("[]\n")
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        slow = TrackingSpool(tmp_path / "spool", run_id, f"http://127.0.0.1:{silent.getsockname()[1]}",
                             "stage", wait_s=1)
        with pytest.raises(NotLanded, match="within 1 s"):
            slow.log_artifact(items, "eval", landed=True)
        assert slow.close(0) == 1


def test_replay_sends_each_write_once_even_if_it_was_sent_before(tmp_path: Path, store) -> None:
    """A write the store committed but whose answer was lost is sent again: the run holds it once."""
    client, run_id = store
    spool = TrackingSpool(tmp_path / "spool", run_id, client.tracking_uri, "rank0")
    spool.log_batch([("loss", float("nan"), 1000, 1), ("loss", 2.0, 1001, 2)], params={"a": "1"},
                    tags={"t": "x"}, wait=True)
    spool.close(30)
    [path] = (tmp_path / "spool" / run_id).glob("*.jsonl")
    Path(f"{path}.sent").write_text("1")  # as if no answer had come back
    assert replay(tmp_path / "spool") == (3, 0)
    assert len(client.get_metric_history(run_id, "loss")) == 2


def test_a_refused_write_is_reported_and_skipped(tmp_path: Path, store) -> None:
    client, run_id = store
    spool = TrackingSpool(tmp_path / "spool", run_id, client.tracking_uri, "stage")
    spool.log_batch(params={"lr": "0.1"}, wait=True)
    with pytest.raises(SpoolRejected, match="lr"):
        spool.log_batch(params={"lr": "0.2"}, wait=True)  # a param never changes value
    spool.log_batch([("loss", 1.0, 1000, 1)], wait=True)
    assert spool.close(30) == 0
    assert client.get_run(run_id).data.metrics == {"loss": 1.0}
    assert "lr" in Path(f"{spool.path}.rejected").read_text()


def test_sync_leaves_a_live_writers_spool_alone_and_takes_a_dead_ones(tmp_path: Path, store) -> None:
    client, run_id = store
    writer = ("import sys, time\nfrom forgeline.model.spool import TrackingSpool\n"
              "spool = TrackingSpool(sys.argv[1], sys.argv[2], sys.argv[3], 'rank0')\n"
              "spool.log_batch([('loss', 1.0, 1000, 1)])\nprint('spooled', flush=True)\n"
              "time.sleep(float(sys.argv[4]))\n")
    alive = subprocess.Popen([sys.executable, "-c", writer, str(tmp_path / "spool"), run_id,
                              f"http://127.0.0.1:{closed_port()}", "600"], stdout=subprocess.PIPE, text=True)
    assert alive.stdout.readline().strip() == "spooled"
    try:
        assert replay(tmp_path / "spool") == (0, 0)  # its writer holds it and sends it itself
    finally:
        alive.kill()
        alive.wait()
    assert sum(unsent(tmp_path / "spool").values()) == 1  # killed: the write is still in the file
    [path] = unsent(tmp_path / "spool")
    records = read_records(path)
    records[0]["tracking_uri"] = client.tracking_uri
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert replay(tmp_path / "spool") == (1, 0)
    assert client.get_run(run_id).data.metrics == {"loss": 1.0}


def test_a_line_cut_short_by_a_crash_is_not_a_record(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"op": "open", "run_id": "r", "tracking_uri": "x"}\n{"op": "batch", "metr')
    assert read_records(path) == [{"op": "open", "run_id": "r", "tracking_uri": "x"}]


def files_of_writers_killed_early(run_dir: Path) -> None:
    """What writers killed early leave: an empty file (killed between creating and locking it),
    a header cut short, a header whose count (`.sent`) was never written."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "rank1-host-101-0.jsonl").write_text("")
    (run_dir / "rank2-host-102-0.jsonl").write_text('{"op": "open", "run_id": "r", "track')
    header = {"op": "open", "run_id": run_dir.name, "tracking_uri": "http://127.0.0.1:1"}
    (run_dir / "rank3-host-103-0.jsonl").write_text(json.dumps(header) + "\n")


def test_sync_passes_over_files_of_writers_killed_before_they_wrote_anything(tmp_path: Path, store) -> None:
    client, run_id = store
    files_of_writers_killed_early(tmp_path / "spool" / run_id)
    spool = TrackingSpool(tmp_path / "spool", run_id, f"http://127.0.0.1:{closed_port()}", "rank0")
    spool.log_batch([("loss", 1.0, 1000, 1)])
    spool.close(0.5)
    [path] = unsent(tmp_path / "spool")  # the others hold no write
    records = read_records(path)
    records[0]["tracking_uri"] = client.tracking_uri  # the store is back
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert replay(tmp_path / "spool") == (1, 0)
    assert client.get_run(run_id).data.metrics == {"loss": 1.0}
    assert not (tmp_path / "spool" / run_id).exists()  # nothing left to send: the run's spool goes


def test_a_closing_run_passes_over_files_of_writers_killed_early(tmp_path: Path, store) -> None:
    client, run_id = store
    cfg = debug_config(tmp_path, f"registry.tracking_uri={client.tracking_uri}")
    files_of_writers_killed_early(Path(cfg.ops.tracking_spool) / run_id)
    tracker = tracker_for(cfg, run_id, client)
    tracker.spool.log_batch([("loss", 1.0, 1000, 1)], wait=True)
    close_tracker(cfg, tracker, finished=True)
    assert client.get_run(run_id).data.metrics == {"loss": 1.0}
    assert not (Path(cfg.ops.tracking_spool) / run_id).exists()


class Contention:
    """Notes when any flock has to wait (taken without waiting first, then with)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.waited = threading.Event()
        real = fcntl.flock

        def flock(fd: object, operation: int) -> None:
            if operation & (fcntl.LOCK_NB | fcntl.LOCK_UN):
                return real(fd, operation)
            try:
                real(fd, operation | fcntl.LOCK_NB)
            except BlockingIOError:
                self.waited.set()
                real(fd, operation)

        monkeypatch.setattr(fcntl, "flock", flock)


def test_sync_never_removes_a_spool_from_under_a_writer_that_joins_the_run(
        tmp_path: Path, store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new writer of the run (a stage starting) creates its file while a sync is removing the
    run's spool, all sent: the writer waits, and its file survives."""
    client, run_id = store
    done = TrackingSpool(tmp_path / "spool", run_id, client.tracking_uri, "rank0")
    done.log_batch([("loss", 1.0, 1000, 1)], wait=True)
    done.close(30)
    contention, joined = Contention(monkeypatch), []
    real_rmtree = shutil.rmtree

    def rmtree_as_a_writer_joins(path: os.PathLike, *args: object, **kwargs: object) -> None:
        if not joined:
            writer = threading.Thread(target=lambda: joined.append(
                TrackingSpool(tmp_path / "spool", run_id, client.tracking_uri, "stage")))
            joined.append(writer)
            writer.start()
            deadline = time.monotonic() + 30
            while writer.is_alive() and not contention.waited.is_set():
                assert time.monotonic() < deadline
                time.sleep(0.01)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree_as_a_writer_joins)
    replay(tmp_path / "spool")
    joined[0].join(timeout=30)
    spool = joined[1]
    spool.log_batch([("loss", 2.0, 1001, 2)], wait=True)
    assert spool.path.exists(), "the sync removed the spool file of a live writer"
    assert spool.close(30) == 0
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2]


def test_a_writer_whose_new_file_a_sync_holds_for_a_moment_waits_for_it(
        tmp_path: Path, store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync can take a writer's file between its creation and the writer's lock (it finds no
    header and lets go): the writer waits for the lock instead of failing."""
    client, run_id = store
    real = fcntl.flock
    taken = []

    def flock(fd: object, operation: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd.fileno()}")
        if path.endswith(".jsonl") and not taken:  # the writer's first lock of its new file
            sync = open(path, "r+")
            real(sync, fcntl.LOCK_EX | fcntl.LOCK_NB)
            taken.append(threading.Timer(0.3, sync.close))
            taken[0].start()
        return real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    spool = TrackingSpool(tmp_path / "spool", run_id, client.tracking_uri, "rank0")
    spool.log_batch([("loss", 1.0, 1000, 1)], wait=True)
    assert spool.close(30) == 0 and taken
    assert client.get_run(run_id).data.metrics == {"loss": 1.0}
