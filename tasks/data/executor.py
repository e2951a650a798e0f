"""What runs the data build's partition work: Prefect tasks on a Dask cluster, or a pool of
forked processes on this machine.

Both take the same plain functions (build.py) and work items -- small, picklable descriptions
of a partition's work whose data lie in files all workers see -- and return the results in the
items' order, so the output cannot depend on which worker ran what, or how many there were.

`DaskExecutor` submits each item as a Prefect task run to a `DaskTaskRunner` (prefect-dask):
the runs show in Prefect's UI under the stage's flow run, with their logs (called without Prefect,
it submits the same functions with a plain Dask client). Without an address it
runs on a local cluster of processes, started on first use and kept for the life of the process
(a second build in the same process, as in the tests, does not wait for workers to start
again), except that the data stage closes it when done (`close_local_clusters`), so that no idle
workers share the cores with the training that follows. A worker that dies mid-task (killed,
out of memory) has its task recomputed by Dask on another; a task that fails for good raises
`PartitionFailed`, naming the partition and its sources.

A cluster at an address runs its own installed forgeline and libraries: the build refuses it
before any work when a worker's differ from this process's (`check_workers_code`, raising
`WorkersRunOtherCode`). Every cluster's workers mask URL credentials in their log records, as
this process does, and keep the sources they import for the next check (on_workers.py).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
# Worker processes run one task at a time on one core: the parallelism is the processes'.
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
_LOCAL_CLUSTERS: dict[int, object] = {}


class PartitionFailed(RuntimeError):
    """A piece of the build failed on its worker; the message names the partition and sources."""


class WorkersRunOtherCode(RuntimeError):
    """A cluster's workers would run other forgeline code, or other library versions, than the
    data stage's key records; the message names the workers and what differs."""


class Work(Protocol):
    number: int

    def describe(self) -> str:
        """The partition and its sources, for an error message."""
        ...


class Executor(Protocol):
    def submit(self, name: str, fn: Callable[[T], R], items: Sequence[T]) -> Submitted:
        """`fn` over `items`, in parallel, without waiting: work submitted later can start on the
        workers this leaves idle."""
        ...

    def map(self, name: str, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """`fn` over `items`, in parallel; the results in the items' order."""
        ...


MEMORY_HINT = "lower data.partition_mb or give the workers more memory"


def failure(name: str, item: Work, err: BaseException) -> PartitionFailed:
    """The error for a piece of work that failed for good, naming it. A worker killed for its
    memory (by Dask's nanny at its memory limit, or the kernel) shows as the worker's death: Dask
    gives up after retrying the task on other workers (KilledWorker), a pool breaks."""
    if isinstance(err, MemoryError):
        why = f"it ran out of memory ({err or 'MemoryError'}); {MEMORY_HINT}"
    elif type(err).__name__ in {"KilledWorker", "BrokenProcessPool"}:
        why = f"its worker died ({type(err).__name__}) -- most often for lack of memory: {MEMORY_HINT}"
    else:
        why = f"{type(err).__name__}: {err}"
    return PartitionFailed(f"data build: {name} of {item.describe()} failed: {why}")


@dataclass(frozen=True)
class Submitted:
    """Work submitted under a name: its items and their futures (a process pool's, Dask's or
    Prefect's)."""

    name: str
    items: Sequence[Work]
    futures: Sequence

    def results(self) -> list:
        """Each future's result, in the items' order; the first failure raised naming its item."""
        results = []
        for item, future in zip(self.items, self.futures, strict=True):
            try:
                results.append(future.result())
            except Exception as err:
                raise failure(self.name, item, err) from err
        return results


class PoolExecutor:
    """Forked processes of this machine. Fork, not spawn: a spawned worker would re-import the
    entry point's modules (Prefect, MLflow: seconds each)."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers

    def __enter__(self) -> PoolExecutor:
        # The workers fork on demand, at submit time: each sets its variables when it starts.
        self.pool = ProcessPoolExecutor(self.num_workers, mp_context=multiprocessing.get_context("fork"),
                                        initializer=os.environ.update, initargs=(WORKER_ENV,))
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(cancel_futures=True)

    def submit(self, name: str, fn: Callable[[T], R], items: Sequence[T]) -> Submitted:
        return Submitted(name, items, [self.pool.submit(fn, item) for item in items])

    def map(self, name: str, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        return self.submit(name, fn, items).results()


class DaskExecutor:
    """The cluster at `address`, else this process's local cluster of `num_workers` processes.
    Inside a Prefect run (the stage's flow) each item is a Prefect task run on a
    `DaskTaskRunner`; a plain call (no Prefect run, so no API to report to) submits the plain
    functions to the same cluster with a Dask client."""

    def __init__(self, address: str | None, num_workers: int):
        self.address, self.num_workers = address, num_workers

    def __enter__(self) -> DaskExecutor:
        from prefect.context import FlowRunContext, TaskRunContext

        # Dask's nanny sets its workers' variables in this process's environment before spawning
        # them (OMP_NUM_THREADS=1, MALLOC_TRIM_THRESHOLD_, PYTHONHASHSEED...) and leaves them:
        # inherited by the training ranks launched next, they slowed training by a third.
        self.environ = dict(os.environ)
        address = self.address or local_cluster(self.num_workers).scheduler_address
        set_up_workers(address)
        self.api_url = None
        if FlowRunContext.get() or TaskRunContext.get():
            from prefect_dask import DaskTaskRunner

            self.api_url = temporary_api_url(address)
            self.runner, self.client = DaskTaskRunner(address=address), None
            self.runner.__enter__()
        else:
            from distributed import Client

            self.runner, self.client = None, Client(address, set_as_default=False)
        log.info("data: partition work on the Dask cluster at %s%s", address,
                 " as Prefect tasks" if self.runner else "")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.runner:
            self.runner.__exit__(*exc)
        else:
            self.client.close()
        restore_environ(self.environ)

    def submit(self, name: str, fn: Callable[[T], R], items: Sequence[T]) -> Submitted:
        if self.runner:
            from prefect import task
            from prefect.cache_policies import NO_CACHE
            from prefect.settings import PREFECT_API_URL, temporary_settings

            # Inputs are paths and counts; nothing to cache or persist: the files are the results.
            prefect_task = task(fn, name=f"data-{name}", cache_policy=NO_CACHE, persist_result=False,
                                task_run_name=f"data-{name}-{{work.number}}")
            # The submitted task runs carry these settings to the workers.
            with temporary_settings({PREFECT_API_URL: self.api_url} if self.api_url else {}):
                futures = [self.runner.submit(prefect_task, parameters={"work": item}) for item in items]
        else:
            # pure=False: the key must not be a hash of the item, whose plan differs per build
            futures = [self.client.submit(fn, item, pure=False) for item in items]
        return Submitted(name, items, futures)

    def map(self, name: str, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        return self.submit(name, fn, items).results()


def check_workers_code(address: str, module: str) -> None:
    """Refuse the cluster at `address` when a worker would run other code for the functions of
    `module` than this process: its own installed forgeline (the source of `module` and of the
    forgeline modules it imports, as this process imported them) or other versions of the
    libraries they import. The stage's key records this process's. Workers that join after the
    check are not seen."""
    from distributed import Client

    from forgeline.tasks import code_inputs
    from forgeline.tasks.data.on_workers import code_here

    used = code_inputs.reached((module,))
    modules = sorted(used.modules)
    hashes = {name: hashlib.sha256(code_inputs.imported_source(code_inputs.module_file(name))).hexdigest()
              for name in modules}
    versions = code_inputs.installed_versions(used.third_party)
    with Client(address, set_as_default=False, timeout=60) as client:
        theirs = client.run(code_here, modules, sorted(versions), code_inputs.__name__)
    differences = []
    for worker, (their_hashes, their_versions) in sorted(theirs.items()):
        differences += [f"{worker}: {name} {short(their_hashes[name])} (here {short(digest)})"
                        for name, digest in hashes.items() if their_hashes[name] != digest]
        differences += [f"{worker}: {name} {their_versions[name]} (here {version})"
                        for name, version in versions.items() if their_versions[name] != version]
    if differences:
        raise WorkersRunOtherCode(
            f"the Dask workers at {address} run other code than this process, so the data stage's key "
            f"would not say what built its output: {'; '.join(differences)}. Install this checkout's "
            "forgeline (and its lock) on the workers, or leave data.dask_address unset")


def short(digest: str | None) -> str:
    return "missing" if digest is None else digest[:12]


def set_up_workers(address: str) -> None:
    """Have every worker of the cluster, those that join later included, mask URL credentials in
    its log records, as this process does (the partition work logs what the stage passes it), and
    keep the sources of the forgeline modules it imports, for the next `check_workers_code`."""
    from distributed import Client

    from forgeline.tasks.data.on_workers import ForgelineWorker

    with Client(address, set_as_default=False, timeout=60) as client:
        client.register_plugin(ForgelineWorker())


def restore_environ(saved: dict[str, str]) -> None:
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)


def temporary_api_url(address: str) -> str | None:
    """The URL of the temporary Prefect server this process runs its flow on, when it has no
    configured API: the workers report there (left to themselves, each would start a server of
    its own, on the same database). Such a server listens on 127.0.0.1 only: a cluster on
    other machines needs a Prefect server it can reach."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return None
    server = SubprocessASGIServer()
    if not server.running:
        return None
    host = urlsplit(address).hostname or ""
    if host not in {"localhost", "::1"} and not host.startswith("127."):
        raise ValueError(f"data.dask_address {address} is a cluster on another machine, but this stage "
                         f"reports to a temporary Prefect server on 127.0.0.1 its workers cannot reach; "
                         "set PREFECT_API_URL to a Prefect server they can reach")
    return server.api_url


def local_cluster(num_workers: int) -> object:
    """This process's local Dask cluster of `num_workers` single-threaded processes."""
    if num_workers not in _LOCAL_CLUSTERS:
        import dask
        from distributed import LocalCluster

        logging.getLogger("distributed").setLevel(logging.WARNING)  # a line per worker event otherwise
        # Dask's default MALLOC_TRIM_THRESHOLD_=65536 for its workers also pins glibc's mmap
        # threshold at 128 KiB (set explicitly, it no longer adapts): every larger block -- a
        # document, an array -- is mapped and unmapped anew. Cleaning took 14 % longer than in a
        # forked pool worker. Nor do the workers sample their task's stack every 10 ms for a
        # dashboard this cluster does not have. The nannies take both when created, so restarted
        # workers keep them.
        with dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
                              "distributed.worker.profile.enabled": False}):
            cluster = LocalCluster(n_workers=num_workers, threads_per_worker=1, processes=True,
                                   host="127.0.0.1", dashboard_address=None, silence_logs=logging.WARNING,
                                   env=WORKER_ENV)
        _LOCAL_CLUSTERS[num_workers] = cluster
    return _LOCAL_CLUSTERS[num_workers]


@atexit.register
def close_local_clusters() -> None:
    """Stop this process's local clusters (the next build starts one again)."""
    while _LOCAL_CLUSTERS:
        _LOCAL_CLUSTERS.popitem()[1].close()


def executor_for(executor: str, address: str | None, num_workers: int) -> PoolExecutor | DaskExecutor:
    return DaskExecutor(address, num_workers) if executor == "dask" else PoolExecutor(num_workers)
