"""The train stage on a real Slurm cluster (tests/integration/slurm_cluster.py: Debian's slurmctld
and slurmd, `make slurm`): parallel.launcher=slurm submits an sbatch job whose torchrun agent
starts 4 ranks, streams its output into the stage's log and reports its end; a signal to the job
makes the ranks save their step, the job requeues itself and resumes, bit-identical to a run
that was never interrupted."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from forgeline.model.checkpoint.manager import committed_checkpoints
from forgeline.model.inference import load_from_checkpoint
from forgeline.tasks.train.job import TrainResult, train_model
from tests.conftest import REPO_ROOT, debug_config
from tests.integration.slurm_cluster import slurm_cluster
from tests.integration.test_recovery import callbacks

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BASE = ["train.steps=24", "checkpoint.every_steps=100", "checkpoint.keep_last=10", "train.deterministic=true",
        "train.peak_tflops=1", "train.max_restarts=0", "train.log_every=2", "train.preemption_grace_s=30",
        "slurm.poll_s=0.5"]
PP2_DP2 = ["parallel.pp=2", "parallel.dp_shard=2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm"), kill_wait_s=60) as env:
        yield env


@pytest.fixture(autouse=True)
def on_cluster(cluster: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", cluster["SLURM_CONF"])
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # rank processes import tests.faults


def test_the_train_stage_runs_as_a_slurm_job_of_four_ranks(data_root: Path, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    data = f"data.out_dir={data_root / 'data'}"
    local = train_model(debug_config(tmp_path / "local", data, *BASE, *PP2_DP2))
    caplog.set_level(logging.INFO, logger="forgeline")  # the stage's and its ranks' relayed lines
    cfg = debug_config(tmp_path / "slurm", f"data.out_dir={data_root / 'data'}", *BASE, *PP2_DP2,
                       "parallel.launcher=slurm")
    result = train_model(cfg)
    assert result.step == 24 and result.layout["world_size"] == 4
    [output] = (Path(cfg.train.out_dir) / "slurm").glob("slurm-*.out")
    assert "starting at step 0/24" in output.read_text()
    streamed = caplog.text
    assert "submitted Slurm job" in streamed and "step 24/24" in streamed and "COMPLETED" in streamed
    assert_same_weights(Path(result.checkpoint), Path(local.checkpoint))


def test_a_signalled_slurm_job_saves_its_step_requeues_and_resumes(
        data_root: Path, tmp_path: Path, cluster: dict[str, str], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`scancel --signal=USR1` as Slurm's `--signal` sends it before a time limit: the ranks save
    step 11, the job requeues itself (`scontrol requeue`), its second run resumes at step 11."""
    monkeypatch.chdir(tmp_path)
    reference = train_model(debug_config(tmp_path / "local", f"data.out_dir={data_root / 'data'}", *BASE,
                                         "parallel.dp_shard=2"))
    caplog.set_level(logging.INFO, logger="forgeline")  # the stage's and its ranks' relayed lines
    cue = tmp_path / "signalled"
    wait = callbacks(("WaitBefore", {"step": 11, "until": str(cue)}))
    cfg = debug_config(tmp_path / "slurm", f"data.out_dir={data_root / 'data'}", *BASE, "parallel.dp_shard=2",
                       "parallel.launcher=slurm", wait)
    results: list[TrainResult | BaseException] = []
    stage = threading.Thread(target=lambda: results.append(_run(cfg)))
    stage.start()
    jobs = Path(cfg.train.out_dir) / "slurm"
    deadline = time.monotonic() + 300
    while not any("step 10/24" in p.read_text() for p in jobs.glob("slurm-*.out")):
        assert time.monotonic() < deadline and stage.is_alive(), results
        time.sleep(0.2)
    [job_id] = [p.stem.removeprefix("slurm-") for p in jobs.glob("slurm-*.out")]
    subprocess.run(["scancel", "--signal=USR1", job_id], env=cluster, check=True)
    cue.touch()
    stage.join(timeout=600)
    [result] = results
    assert isinstance(result, TrainResult), result
    assert [info.step for info in committed_checkpoints(Path(cfg.train.out_dir) / "checkpoints")] == [24, 11]
    output = (jobs / f"slurm-{job_id}.out").read_text()
    assert "requeueing job" in output and "starting at step 11/24" in output
    assert "requeued 1x" in caplog.text
    assert_same_weights(Path(result.checkpoint), Path(reference.checkpoint))


def _run(cfg) -> TrainResult | BaseException:
    try:
        return train_model(cfg)
    except BaseException as err:  # the test thread reports it
        return err


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_from_checkpoint(a).state_dict(), load_from_checkpoint(b).state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ"
