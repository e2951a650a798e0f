"""The data build on Dask: the same bytes as the pool's whatever the executor, the number of
workers and the partitioning; `forgeline stage data` on a real `dask scheduler` and `dask worker`
processes (the work runs there, as Prefect tasks); a worker killed while it cleans a partition
costs nothing but time."""

from __future__ import annotations

import importlib
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import dask
import psutil
import pytest
from distributed import Client

from forgeline.model.fileio import sha256_file
from forgeline.tasks.data import executor as data_executor
from forgeline.tasks.data import snapshot
from forgeline.tasks.data.build import build_dataset, partition_members
from forgeline.tasks.data.executor import WorkersRunOtherCode, check_workers_code
from forgeline.tasks.data.snapshot import snapshot_members, take_snapshot
from tests.conftest import REPO_ROOT, debug_config, output_overrides
from tests.integration.helpers import VENV_BIN, free_port, run, serving, user_env
from tests.unit.test_code_inputs import package_copy, touch

pytestmark = pytest.mark.integration

# Shakespeare's 5.4 MB of snapshot lines in 21 members: partitions of one to all of them.
MEMBER_BYTES = 256 << 10


def output_digests(out_dir: str | Path) -> dict[str, str]:
    """sha256 of every file of a build's output, by relative path."""
    root = Path(out_dir)
    return {str(path.relative_to(root)): sha256_file(path)
            for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The debug config's snapshot (Shakespeare) in small members; every build here reads it."""
    root = tmp_path_factory.mktemp("snapshot")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(snapshot, "MEMBER_BYTES", MEMBER_BYTES)
        take_snapshot(debug_config(root))
    return root / "raw"


def build_config(root: Path, raw_dir: Path, *overrides: str):
    return debug_config(root, f"data.raw_dir={raw_dir}", *overrides)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, raw_dir: Path) -> dict[str, str]:
    """One forked worker, the default partitioning: the output every other build must equal."""
    cfg = build_config(tmp_path_factory.mktemp("reference"), raw_dir, "data.executor=pool",
                       "data.num_workers=1")
    assert len(partition_members(snapshot_members(cfg.data), cfg.data.partition_mb)) == 2
    return output_digests(build_dataset(cfg, from_snapshot=True).out_dir)


@pytest.mark.parametrize(("executor", "workers", "partition_mb", "partitions"), [
    ("pool", 2, 0.25, 21),  # a member a partition
    ("dask", 2, 0.6, 7),
    ("dask", 1, 100, 1),  # one partition: one dedup bucket, one range of the training order
])
def test_output_is_byte_identical_across_executors_workers_and_partitions(
        tmp_path: Path, raw_dir: Path, reference: dict[str, str], executor: str, workers: int,
        partition_mb: float, partitions: int, caplog: pytest.LogCaptureFixture) -> None:
    cfg = build_config(tmp_path, raw_dir, f"data.executor={executor}", f"data.num_workers={workers}",
                       f"data.partition_mb={partition_mb}")
    assert len(partition_members(snapshot_members(cfg.data), partition_mb)) == partitions
    environ = dict(os.environ)
    with caplog.at_level(logging.INFO, logger="forgeline.tasks.data.executor"):
        result = build_dataset(cfg, from_snapshot=True)
    assert not result.reused
    # Dask's nanny sets its workers' variables here; the training launched next must not inherit them.
    assert dict(os.environ) == environ
    assert output_digests(result.out_dir) == reference
    if executor == "dask":  # it ran on this process's local cluster of that size
        address = data_executor.local_cluster(workers).scheduler_address
        assert f"partition work on the Dask cluster at {address}\n" in caplog.text
        with Client(address, set_as_default=False) as client:
            environs = client.run(lambda: dict(os.environ)).values()
            profiling = client.run(lambda: dask.config.get("distributed.worker.profile.enabled")).values()
        for worker_environ in environs:
            assert {k: worker_environ.get(k) for k in data_executor.WORKER_ENV} == data_executor.WORKER_ENV
            # Dask's default would pin glibc's mmap threshold: cleaning 14 % slower than the pool.
            assert "MALLOC_TRIM_THRESHOLD_" not in worker_environ
        assert not any(profiling)


def test_a_secret_a_worker_logs_reaches_its_log_masked(capfd: pytest.CaptureFixture[str]) -> None:
    """The partition work logs what the stage passes it (a source's URL, the tracking store's):
    each worker process of the cluster masks credentials in its records, through its own
    handlers and Python's last-resort one (a logger without any) alike."""
    secret = "s3://AKIAEXAMPLE:hunter2-worker@bucket/pages?X-Amz-Signature=sig-worker-secret"

    def log_secret(_: int) -> int:
        logging.getLogger("forgeline.tasks.data.work").warning("reading %s", secret)
        logging.getLogger("distributed.worker").warning("from %s", secret)
        return os.getpid()

    # A cluster of its own: a worker writes to the stderr it started with (an earlier test's capture).
    data_executor.close_local_clusters()
    try:
        with data_executor.DaskExecutor(None, 1) as executor:
            [worker_pid] = executor.map("log", log_secret, [0])
            # Its workers run this checkout: a check of their code passes.
            check_workers_code(data_executor.local_cluster(1).scheduler_address, "forgeline.tasks.data.work")
    finally:
        data_executor.close_local_clusters()
    assert worker_pid != os.getpid()  # the records were made in the worker's process
    output = capfd.readouterr().err  # the worker writes to the stderr it inherited from here
    assert "reading s3://AKIAEXAMPLE:***@bucket/pages?X-Amz-Signature=***" in output, output[-3000:]
    assert "from s3://AKIAEXAMPLE:***@bucket" in output
    assert "hunter2" not in output and "sig-worker-secret" not in output


# -- a real cluster: `dask scheduler` and `dask worker` processes on 127.0.0.1 --------------------


@dataclass(frozen=True)
class Cluster:
    address: str
    scheduler_log: Path
    worker_logs: tuple[Path, ...]

    def worker_output(self) -> str:
        return "\n".join(log.read_text() for log in self.worker_logs)


@contextmanager
def running_cluster(root: Path, workers: int, worker_env: dict[str, str]) -> Iterator[Cluster]:
    """A scheduler and `workers` single-threaded workers, each under its nanny (which restarts a
    killed worker); all stopped (SIGTERM, then SIGKILL) at the end."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    dask = str(VENV_BIN / "dask")
    logs = tuple(root / f"worker-{n}.log" for n in range(workers))
    with ExitStack() as stack:  # stopped in reverse: the workers, then the scheduler
        stack.enter_context(serving([dask, "scheduler", "--host", "127.0.0.1", "--port", str(port),
                                     "--no-dashboard"], user_env(root), root / "scheduler.log"))
        for n, log in enumerate(logs):
            stack.enter_context(serving([dask, "worker", address, "--nthreads", "1", "--host", "127.0.0.1",
                                         "--no-dashboard", "--name", f"worker-{n}"], worker_env, log))
        with Client(address, timeout=60) as client:
            client.wait_for_workers(workers, timeout=120)
        yield Cluster(address, root / "scheduler.log", logs)


@pytest.fixture
def dask_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A scheduler and two workers of this checkout."""
    with running_cluster(tmp_path, 2, user_env(tmp_path)) as cluster:
        yield cluster


def stage_data(root: Path, raw_dir: Path, *overrides: str) -> list[str]:
    """`forgeline stage data` on the debug config from the snapshot in `raw_dir`, its outputs under
    `root`."""
    overrides = (*output_overrides(root), f"data.raw_dir={raw_dir}", "data.executor=dask", *overrides)
    return [str(VENV_BIN / "forgeline"), "stage", "data", "--config", "debug.yaml", "--from-snapshot",
            *[arg for override in overrides for arg in ("--set", override)]]


def scheduler_prefixes(address: str) -> dict[str, dict[str, int]]:
    """Per task prefix (the function's name) how many of its tasks entered each state."""
    with Client(address, timeout=60) as client:
        return client.run_on_scheduler(lambda dask_scheduler: {
            name: dict(prefix.state_counts) for name, prefix in dask_scheduler.task_prefixes.items()})


def cleaned_partitions(cluster: Cluster) -> list[int]:
    """The partitions whose Prefect task run completed on the cluster's workers, by their logs."""
    found = re.findall(r"Task run 'data-clean-(\d+)' - Finished in state Completed", cluster.worker_output())
    return sorted(set(map(int, found)))


@pytest.mark.slow
def test_stage_runs_its_partition_work_on_a_dask_scheduler(tmp_path: Path, raw_dir: Path,
                                                          reference: dict[str, str],
                                                          dask_cluster: Cluster) -> None:
    partition_mb = 0.6
    cfg = build_config(tmp_path / "out", raw_dir, f"data.partition_mb={partition_mb}")
    partitions = len(partition_members(snapshot_members(cfg.data), partition_mb))
    workdir = tmp_path / "work"
    workdir.mkdir()
    done = run(stage_data(tmp_path / "out", raw_dir, f"data.dask_address={dask_cluster.address}",
                          f"data.partition_mb={partition_mb}"), workdir, timeout=600)
    assert f"partition work on the Dask cluster at {dask_cluster.address} as Prefect tasks" in done.stderr
    assert output_digests(tmp_path / "out" / "data") == reference
    # The scheduler ran every partition's cleaning, as Prefect task runs on its workers.
    prefixes = scheduler_prefixes(dask_cluster.address)
    assert prefixes["clean_partition"]["memory"] == partitions, prefixes
    assert not prefixes["clean_partition"].get("erred"), prefixes
    assert cleaned_partitions(dask_cluster) == list(range(partitions))


@pytest.mark.slow
@pytest.mark.usefixtures("temporary_prefect_api")
def test_dask_workers_report_to_the_stages_temporary_prefect_api(tmp_path: Path, raw_dir: Path) -> None:
    """The default config (`executor: dask`, a local cluster) as `forgeline stage data` runs it: the
    local cluster's workers print to the stage's own output, where their Prefect log lines show
    (with --verbose: by default the console shows forgeline's events only)."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    done = run([*stage_data(tmp_path / "out", raw_dir, "data.num_workers=1", "data.partition_mb=100"),
                "--verbose"], workdir, timeout=600)
    output = done.stdout + done.stderr
    assert "Task run 'data-clean-0' - Finished in state Completed" in output  # the worker's lines are here
    assert output.count("Starting temporary server") == 1, output[-6000:]


@pytest.mark.slow
def test_a_cluster_whose_workers_run_other_code_is_refused_before_any_work(tmp_path: Path,
                                                                          raw_dir: Path) -> None:
    """A cluster that is not this process's runs its own installed forgeline: here a copy with
    the cleaning edited. The stage's key would record this process's code, so it is refused."""
    other = package_copy(tmp_path / "other")
    touch(other / "tasks" / "data" / "clean.py")
    worker_env = user_env(tmp_path) | {"PYTHONPATH": str(other.parent)}
    with running_cluster(tmp_path, 1, worker_env) as cluster:
        cfg = build_config(tmp_path / "out", raw_dir, "data.executor=dask",
                           f"data.dask_address={cluster.address}")
        with pytest.raises(WorkersRunOtherCode) as refused:
            build_dataset(cfg, from_snapshot=True)
        # Only the edited module differs: the rest of the copy is this checkout's.
        differs = r"tcp://127\.0\.0\.1:\d+: forgeline\.tasks\.data\.clean [0-9a-f]{12} \(here [0-9a-f]{12}\)"
        assert re.search(rf"run other code than this process, .*: {differs}\. Install", str(refused.value))
        assert "clean_partition" not in scheduler_prefixes(cluster.address)  # refused before any work
        assert not any((tmp_path / "out").rglob("*")), "nothing written"

        # A worker that imported the edited module runs it after its file is put back.
        data_executor.set_up_workers(cluster.address)
        with Client(cluster.address, timeout=60) as client:
            client.run(importlib.import_module, "forgeline.tasks.data.clean")
        shutil.copy2(REPO_ROOT / "tasks" / "data" / "clean.py", other / "tasks" / "data" / "clean.py")
        with pytest.raises(WorkersRunOtherCode, match=differs):
            check_workers_code(cluster.address, "forgeline.tasks.data.work")


def kill_a_worker_executing(address: str, prefix: str, stage: subprocess.Popen, deadline: float) -> int:
    """SIGKILL a worker process of the cluster in the middle of a task of `prefix` (its function's
    name); its pid, once it is gone."""
    def probe(dask_worker: object) -> tuple[int, bool]:
        return os.getpid(), any(str(task.key).startswith(prefix) for task in dask_worker.state.executing)

    with Client(address, timeout=60) as client:
        while not (busy := [pid for pid, running in client.run(probe).values() if running]):
            assert stage.poll() is None and time.monotonic() < deadline, f"no worker seen running {prefix}"
            time.sleep(0.01)
        os.kill(busy[0], signal.SIGKILL)
    try:
        psutil.Process(busy[0]).wait(timeout=30)  # until its nanny has reaped it
    except psutil.NoSuchProcess:
        pass
    assert not psutil.pid_exists(busy[0])
    return busy[0]


@pytest.mark.slow
def test_a_worker_killed_while_cleaning_a_partition_changes_nothing(tmp_path: Path, raw_dir: Path,
                                                                   reference: dict[str, str],
                                                                   dask_cluster: Cluster) -> None:
    partition_mb = 0.25  # 21 partitions: the cleaning lasts long enough to be caught in
    workdir = tmp_path / "work"
    workdir.mkdir()
    out = tmp_path / "out"
    stage_log = tmp_path / "stage.log"
    with open(stage_log, "w") as log:
        stage = subprocess.Popen(stage_data(out, raw_dir, f"data.dask_address={dask_cluster.address}",
                                            f"data.partition_mb={partition_mb}"),
                                 cwd=workdir, env=user_env(workdir), stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list(out.glob(".data.tmp-*/.work/partition-*")):
            assert stage.poll() is None, f"the stage ended before cleaning:\n{stage_log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, "no partition started cleaning"
            time.sleep(0.05)
        pid = kill_a_worker_executing(dask_cluster.address, "clean_partition", stage, deadline)
        assert stage.poll() is None, "the stage ended before its worker was gone"
        returncode = stage.wait(timeout=600)
    finally:
        if stage.poll() is None:
            os.killpg(stage.pid, signal.SIGKILL)
            stage.wait()
    output = stage_log.read_text()
    assert returncode == 0, output[-8000:]
    # The nanny saw its worker killed in the middle of the task, and started another.
    assert f"Worker process {pid} was killed by signal {int(signal.SIGKILL)}" in dask_cluster.worker_output()
    assert output_digests(out / "data") == reference
    prefixes = scheduler_prefixes(dask_cluster.address)
    partitions = len(partition_members(snapshot_members(build_config(out, raw_dir).data), partition_mb))
    assert prefixes["clean_partition"]["memory"] >= partitions, prefixes
    assert not prefixes["clean_partition"].get("erred"), prefixes
