"""Recovery without a human, with real torchrun ranks and faults injected by loop callbacks
(tests/faults.py): a killed rank, a crash during a save, a corrupt file, NaN and loss spikes, a
hang, a different layout on resume, a full disk. In deterministic mode a recovered run ends
with weights bit-identical to an uninterrupted one."""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient

from forgeline.configs import Config
from forgeline.model.checkpoint.manager import committed_checkpoints, verify_checkpoint
from forgeline.model.inference import load_from_checkpoint
from forgeline.model.training.callbacks import TrainingUnstable
from forgeline.tasks.tracking import experiment_id, resolve_tracking_uri
from forgeline.tasks.train.job import TrainResult, train_model
from forgeline.tasks.train.launch import LaunchError
from tests.conftest import REPO_ROOT, debug_config

pytestmark = pytest.mark.integration

STEPS = 40
BASE = [f"train.steps={STEPS}", "checkpoint.every_steps=10", "checkpoint.keep_last=10",
        "train.deterministic=true", "train.peak_tflops=1", "parallel.dp_shard=2"]


@pytest.fixture(autouse=True)
def fault_callbacks_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # rank processes import tests.faults


def config(data_root: Path, root: Path, *overrides: str) -> Config:
    return debug_config(root, f"data.out_dir={data_root / 'data'}", *BASE, *overrides)


def callbacks(*specs: tuple[str, dict]) -> str:
    """The train.callbacks override for fault callbacks (kind, args)."""
    entries = [{"path": f"tests.faults:{kind}", "args": args} for kind, args in specs]
    return "train.callbacks=" + yaml.safe_dump(entries, default_flow_style=True, width=10**6).strip()


def fault(kind: str, root: Path, **args: object) -> str:
    return callbacks((kind, {"once": str(root / f"{kind}.fired"), **args}))


def weights(result: TrainResult) -> dict[str, torch.Tensor]:
    return load_from_checkpoint(result.checkpoint).state_dict()


def assert_bit_identical(a: TrainResult, b: TrainResult) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ"


@pytest.fixture(scope="module")
def uninterrupted(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainResult:
    return train_model(config(data_root, tmp_path_factory.mktemp("uninterrupted")))


def test_killed_rank_restarts_and_ends_bit_identical(data_root: Path, tmp_path: Path,
                                                    uninterrupted: TrainResult) -> None:
    result = train_model(config(data_root, tmp_path, fault("KillBefore", tmp_path, step=25, rank=1)))
    assert result.step == STEPS
    assert len(result.failures) == 1 and "killed by SIGKILL" in result.failures[0]
    assert_bit_identical(result, uninterrupted)


def test_crash_during_save_never_loads_the_partial(data_root: Path, tmp_path: Path,
                                                   uninterrupted: TrainResult,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    result = train_model(config(data_root, tmp_path, fault("KillAfterSaveStarts", tmp_path, step=20)))
    assert "resumed from" in caplog.text and "step-00000010 (step 10)" in caplog.text
    assert "step-00000020 (step 20)" not in caplog.text  # the half-written save was never loaded
    assert_bit_identical(result, uninterrupted)


def test_corrupt_file_is_detected_and_the_previous_version_used(
        data_root: Path, tmp_path: Path, uninterrupted: TrainResult,
        caplog: pytest.LogCaptureFixture) -> None:
    first = train_model(config(data_root, tmp_path))
    shard = sorted(Path(first.checkpoint).glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-64] + bytes(64))
    caplog.set_level(logging.INFO)
    again = train_model(config(data_root, tmp_path))
    assert "sha256 mismatch" in caplog.text and "step-00000030 (step 30)" in caplog.text
    assert list((tmp_path / "train" / "checkpoints").glob(".step-00000040.corrupt-*"))  # kept aside
    assert_bit_identical(again, uninterrupted)


def test_nan_and_loss_spike_roll_back_and_the_run_completes(data_root: Path, tmp_path: Path) -> None:
    cfg = config(data_root, tmp_path, "train.steps=60", "train.max_rollbacks=2", "train.spike_zscore=6",
                 callbacks(("ScaleWeightsBefore", {"step": 15, "factor": float("nan"),
                                                   "once": str(tmp_path / "nan.fired")}),
                           ("ScaleWeightsBefore", {"step": 45, "factor": 4.0,
                                                   "once": str(tmp_path / "spike.fired")})))
    client = MlflowClient(resolve_tracking_uri(cfg))
    run = client.create_run(experiment_id(client, cfg))
    result = train_model(cfg, mlflow_run_id=run.info.run_id)
    assert result.step == 60
    events = [v for k, v in sorted(client.get_run(run.info.run_id).data.tags.items())
              if k.startswith("forgeline.event.")]
    assert any("non-finite loss or gradient: update skipped (3 in a row)" in e for e in events)
    assert any("rolled back to step 10 after 3 consecutive non-finite steps" in e for e in events)
    assert any("rolled back to step 40 after loss spike" in e and "skipping the" in e for e in events)
    assert client.get_metric_history(run.info.run_id, "rollbacks")[-1].value == 2


def test_too_many_rollbacks_fail_with_a_report(data_root: Path, tmp_path: Path) -> None:
    cfg = config(data_root, tmp_path, "train.max_rollbacks=0", "train.max_restarts=1",
                 fault("ScaleWeightsBefore", tmp_path, step=15, factor=float("nan")))
    with pytest.raises(TrainingUnstable, match=r"3 consecutive non-finite steps; rollback limit"):
        train_model(cfg)
    started = time.monotonic()
    with pytest.raises(TrainingUnstable, match="delete .*unstable.json to try the same one again"):
        train_model(cfg)  # the same configuration fails fast with the same report
    assert time.monotonic() - started < 60


def test_hang_is_dumped_and_restarted(data_root: Path, tmp_path: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    result = train_model(config(data_root, tmp_path, "train.hang_timeout_s=5",
                                fault("HangBefore", tmp_path, step=12, rank=1)))
    # That the watchdog, not something slower, ended the hang is shown by its dumps below, not by
    # a wall-clock bound: the run's own length depends on the machine's load.
    assert result.step == STEPS
    assert caplog.text.count("Timeout (0:00:05)!") == 2  # the hung rank and the one waiting on it
    # Each rank's dump logged whole (on one stream, the ranks' dumps interleaved mid-line).
    [hung] = [r.message for r in caplog.records if "(train.hang_timeout_s); its threads" in r.message
              and "in pre_step" in r.message]
    assert hung.startswith("rank 1 (start 1 of the group)") and "most recent call first" in hung
    assert result.failures


def test_resume_into_a_different_layout(data_root: Path, tmp_path: Path) -> None:
    def losses(cfg: Config) -> dict[int, float]:
        client = MlflowClient(resolve_tracking_uri(cfg))
        run = client.create_run(experiment_id(client, cfg))
        try:
            train_model(cfg, mlflow_run_id=run.info.run_id)
        finally:
            history = client.get_metric_history(run.info.run_id, "loss")
        return {m.step: m.value for m in history}

    reference = losses(config(data_root, tmp_path / "reference", "train.steps=20"))
    crashed = config(data_root, tmp_path, "train.steps=20", "train.max_restarts=0", "parallel.tp=2",
                     fault("KillBefore", tmp_path, step=15))
    with pytest.raises(LaunchError):
        losses(crashed)
    resumed = losses(config(data_root, tmp_path, "train.steps=20", "parallel.dp_shard=2", "parallel.pp=2"))
    assert sorted(resumed) == list(range(11, 21))  # dp2 x tp2 checkpoint of step 10, now pp2 x dp2
    expected = [reference[s] for s in range(11, 21)]
    assert [resumed[s] for s in range(11, 21)] == pytest.approx(expected, rel=1e-4)


def test_full_disk_keeps_older_versions_and_says_so(data_root: Path, tmp_path: Path) -> None:
    disk = tmp_path / "small-disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        cfg = config(data_root, tmp_path, f"train.out_dir={disk}", "train.max_restarts=0")
        with pytest.raises(LaunchError, match="No space left on device") as err:
            train_model(cfg)
        assert "Committed checkpoints are untouched" in str(err.value)
        kept = committed_checkpoints(disk / "checkpoints")
        assert kept and all(not verify_checkpoint(info.path) for info in kept)
        assert not list((disk / "checkpoints").glob(".*.partial"))
    finally:
        subprocess.run(["umount", str(disk)], check=True)
