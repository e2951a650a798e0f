"""Multi-node launch: two launchers -- as two nodes would run them -- join one c10d rendezvous
on 127.0.0.1 and train one dp2 x tp2 job of 4 ranks, 2 per "node", writing one checkpoint."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from forgeline.model.checkpoint.manager import read_checkpoint_manifest
from forgeline.tasks.train.job import TrainResult, torchrun_command, train_model
from tests.conftest import debug_config
from tests.integration.helpers import free_port

pytestmark = pytest.mark.integration



def test_two_launchers_form_one_job(data_root: Path, tmp_path: Path) -> None:
    cfg = debug_config(tmp_path, f"data.out_dir={data_root / 'data'}", "parallel.nnodes=2",
                       "parallel.dp_shard=2", "parallel.tp=2", "train.peak_tflops=1",
                       f"parallel.rdzv_endpoint=127.0.0.1:{free_port()}")
    command = torchrun_command(cfg, tmp_path / "config.yaml", None)
    assert "--nnodes=2" in command and "--rdzv-backend=c10d" in command and "--nproc-per-node=2" in command

    results: dict[int, TrainResult] = {}
    errors: list[BaseException] = []

    def node(index: int) -> None:
        try:
            results[index] = train_model(cfg)
        except BaseException as err:  # noqa: BLE001 -- reported by the assertion below
            errors.append(err)

    launchers = [threading.Thread(target=node, args=(i,)) for i in range(2)]
    for launcher in launchers:
        launcher.start()
    for launcher in launchers:
        launcher.join(timeout=300)
    assert not errors, errors
    assert results[0] == results[1] and results[0].step == 20
    assert read_checkpoint_manifest(Path(results[0].checkpoint))["layout"]["world_size"] == 4
