"""The default tracking store (`sqlite:///mlflow.db`) under concurrent writers: several processes
-- stages or pipeline runs -- open it and write at once, as forgeline's stages write (runs, params
in batches of 100, a metrics batch per step, tags, the run's end), and none fails; a reader that
keeps a read transaction open (a slow query, a UI, a `sqlite3` shell) does not block a writer.

Without forgeline's preparation of the store (tasks/tracking.py `prepare_sqlite_store`), writers
that open a new store at once all run MLflow's schema migrations on it: they fail ("table ...
already exists", "duplicate column name"), and can leave the store half-migrated for good. And in
sqlite's default journal mode a writer waits for every reader to finish, failing with "database
is locked" after MLflow's busy timeout (20 s)."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import time
import traceback
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from forgeline.configs import Config
from forgeline.tasks.tracking import resolve_tracking_uri

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WRITERS = 8
RUNS = 2
STEPS = 25
METRICS = 20  # per step, in one batch
PARAMS = 150  # sent in batches of 100, as RunTracker.log_params does


def write(workdir: str, writer: int, barrier) -> None:
    """One writer process: from `workdir`, with forgeline's default store, after every writer has
    started. Its error, if any, goes to `workdir`/error-`writer`.txt."""
    os.chdir(workdir)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    barrier.wait()
    try:
        client = MlflowClient(resolve_tracking_uri(Config()))
        found = client.get_experiment_by_name("forgeline")
        if found is None:
            try:
                experiment = client.create_experiment("forgeline")
            except MlflowException:  # created at the same time by another writer
                experiment = client.get_experiment_by_name("forgeline").experiment_id
        else:
            experiment = found.experiment_id
        for number in range(RUNS):
            run = client.create_run(experiment, tags={"writer": str(writer)}, run_name=f"w{writer}-{number}")
            run_id = run.info.run_id
            params = [Param(f"p{i}", str(i)) for i in range(PARAMS)]
            for start in range(0, PARAMS, 100):
                client.log_batch(run_id, params=params[start:start + 100])
            for step in range(STEPS):
                now = int(time.time() * 1000)
                metrics = [Metric(f"m{i}", float(step), now, step) for i in range(METRICS)]
                client.log_batch(run_id, metrics=metrics, tags=[RunTag("step", str(step))])
            client.set_terminated(run_id, "FINISHED")
    except Exception as err:
        Path(workdir, f"error-{writer}.txt").write_text(f"writer {writer}: {type(err).__name__}: "
                                                        f"{str(err)[:300]}\n{traceback.format_exc()[-3000:]}")


def test_concurrent_writers_to_a_new_default_store_all_succeed(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(WRITERS)
    writers = [context.Process(target=write, args=(str(tmp_path), n, barrier)) for n in range(WRITERS)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=600)
    failures = [path.read_text() for path in sorted(tmp_path.glob("error-*.txt"))]
    assert not failures, f"{len(failures)} of {WRITERS} writers failed:\n" + "\n".join(failures)
    assert [process.exitcode for process in writers] == [0] * WRITERS

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("forgeline").experiment_id], max_results=1000)
    assert sorted(run.info.run_name for run in runs) == sorted(f"w{w}-{n}" for w in range(WRITERS)
                                                                for n in range(RUNS))
    for run in runs:
        assert run.info.status == "FINISHED"
        assert len(run.data.params) == PARAMS and run.data.tags["step"] == str(STEPS - 1)
        assert run.data.metrics == {f"m{i}": float(STEPS - 1) for i in range(METRICS)}
        assert [m.step for m in client.get_metric_history(run.info.run_id, "m0")] == list(range(STEPS))
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_a_reader_holding_a_transaction_open_does_not_block_a_writer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    client = MlflowClient(resolve_tracking_uri(Config()))
    run_id = client.create_run("0").info.run_id
    reader = sqlite3.connect(tmp_path / "mlflow.db", isolation_level=None)
    try:
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM runs").fetchone() == (1,)
        started = time.monotonic()
        client.log_batch(run_id, metrics=[Metric(f"m{i}", 1.0, 0, 0) for i in range(100)])
        assert time.monotonic() - started < 10
    finally:
        reader.close()
    assert len(client.get_run(run_id).data.metrics) == 100
