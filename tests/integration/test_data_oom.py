"""A Dask worker that runs out of memory on a partition: the stage fails naming the partition and
its source, and says what to change -- a real `dask scheduler` and a `dask worker` with a memory
limit on 127.0.0.1, whose nanny kills the worker at 95 % of it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from forgeline.tasks.data.build import build_dataset
from forgeline.tasks.data.executor import PartitionFailed
from tests.conftest import debug_config
from tests.integration.helpers import VENV_BIN, free_port, serving, user_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def large_pages(directory: Path, count: int = 80, words: int = 200_000) -> Path:
    """`count` documents of about 1.3 MB of words each: a partition of them (100 MB) does not fit."""
    directory.mkdir()
    rng = random.Random(0)
    vocabulary = [f"w{i}" for i in range(5000)]
    for number in range(count):
        (directory / f"page{number:02d}.txt").write_text(" ".join(rng.choices(vocabulary, k=words)))
    return directory


def test_a_worker_out_of_memory_fails_naming_the_partition_and_source(tmp_path: Path) -> None:
    port = free_port()
    env = user_env(tmp_path)
    env["DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES"] = "1"  # give up after one retry, not three
    address = f"tcp://127.0.0.1:{port}"
    sources = [{"kind": "files", "path": f"{large_pages(tmp_path / 'pages')}/*.txt", "name": "large pages"}]
    cfg = debug_config(tmp_path, f"data.sources={json.dumps(sources)}", "data.cleaning.max_chars=2000000",
                       f"data.dask_address={address}", "data.partition_mb=128")
    scheduler = [str(VENV_BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                 "--no-dashboard"]
    # About 250 MB go to the worker's imports; cleaning a 100 MB partition needs more than the rest
    # (at 350 MB, since stop 44's changes, cleaning fitted and tokenizing died instead).
    worker = [str(VENV_BIN / "dask"), "worker", address, "--nthreads", "1", "--host", "127.0.0.1",
              "--no-dashboard", "--memory-limit", "300MB"]
    with serving(scheduler, env, tmp_path / "scheduler.log"), serving(worker, env, tmp_path / "worker.log"):
        with pytest.raises(PartitionFailed) as failed:
            build_dataset(cfg)
    message = str(failed.value)
    assert "clean of partition 0 (documents 0..79 of source(s) large pages)" in message
    assert "lack of memory" in message and "data.partition_mb" in message
    assert "exceeded 95% memory budget" in (tmp_path / "worker.log").read_text()
    assert not Path(cfg.data.out_dir).exists()  # nothing half-written under the output's name
