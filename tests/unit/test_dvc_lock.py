"""Which runs forgeline records in dvc.lock (tasks/dvc_lock.py): only the one dvc.yaml describes --
its paths, and the params file's values of each stage's params -- never one DVC runs itself; and a
lock it cannot write is a warning naming the remedy, not the stage's failure. (The records
themselves, against `dvc commit`: tests/integration/test_stage_cache.py and test_dvc.py.)"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from forgeline.configs import load_config
from forgeline.tasks import dvc_lock
from forgeline.tasks.dvc_lock import (
    commit,
    dvc_stage_names,
    in_dvc_repository,
    record_in_dvc_lock,
    why_not_described,
)
from forgeline.tasks.dvc_yaml import render_dvc_yaml
from forgeline.tasks.stage import stage_named
from tests.conftest import REPO_ROOT

DVC = str(Path(sys.executable).parent / "dvc")


@pytest.fixture
def described(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """dvc.yaml's stages for configs/tiny.yaml, in a working directory with that params file."""
    (tmp_path / "configs").mkdir()
    shutil.copy(REPO_ROOT / "configs" / "tiny.yaml", tmp_path / "configs" / "tiny.yaml")
    (tmp_path / "dvc.yaml").write_text(render_dvc_yaml())
    monkeypatch.chdir(tmp_path)
    return yaml.safe_load((tmp_path / "dvc.yaml").read_text())["stages"]


def test_only_the_run_dvc_yaml_describes_is_recorded(described: dict) -> None:
    def not_described(*overrides: str) -> dict[str, str]:
        cfg = load_config("configs/tiny.yaml", list(overrides))
        return {name: reason for name in described if (reason := why_not_described(name, cfg, described))}

    assert not_described() == {}
    # The same directories, other values: DVC would record the file's values for what ran on these.
    assert not_described("eval.dimensions.math.limit=5") == {
        "eval": "this run's eval differ from configs/tiny.yaml's, which dvc.yaml's stage eval reads"}
    # A key that names the run moves its directories: train's, and eval's and register's, which read it.
    assert set(not_described("train.lr=0.01")) == {"train", "eval", "register"}
    assert "paths, deps or params differ" in not_described("train.lr=0.01")["train"]
    # A fine-tuning run under a pretraining dvc.yaml: its base and data are named elsewhere.
    sft = load_config("smollm2-sft.yaml")  # the shipped one
    assert dvc_stage_names(stage_named("sft")) == ("base", "sft")
    assert why_not_described("sft", sft, described) == "dvc.yaml has no stage sft"


def test_another_configs_run_is_said_once_a_run(described: dict, caplog: pytest.LogCaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of a config dvc.yaml does not describe: one line for the whole run (each stage said it,
    three to five 200-character lines a run), naming the command that describes it."""
    monkeypatch.setattr(dvc_lock, "_told_not_described", [])
    Path(".dvc").mkdir()
    cfg = load_config("smollm2-sft.yaml")  # the shipped one, under configs/tiny.yaml's dvc.yaml
    with caplog.at_level(logging.INFO, logger="forgeline.tasks.dvc_lock"):
        for name in ("data", "sft", "eval", "register"):
            record_in_dvc_lock(stage_named(name), cfg, None)
    [said] = [entry.getMessage() for entry in caplog.records if entry.levelno >= logging.INFO]
    assert said.startswith("dvc.lock: this run's stages are not recorded, from base on: dvc.yaml's stage "
                           "base is not this run's") and "`forgeline stages --dvc CONFIG > dvc.yaml`" in said


@pytest.mark.parametrize("dvc_yaml", [
    "",  # empty
    "stages:\n  train:\n    cmd: python train.py\n    params: [lr]\n",  # DVC's usual params form
    "stages:\n  train:\n    cmd: python train.py\n",  # no params
    "stages: [train]\n",
    "stages: {train: [\n",  # not YAML
], ids=["empty", "params-list", "no-params", "stages-list", "not-yaml"])
def test_a_users_own_dvc_yaml_is_a_warning_not_the_stages_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        dvc_yaml: str) -> None:
    """A user's dvc.yaml with a stage of forgeline's names, in DVC's own forms: the finished stage
    does not fail (it raised outside the warning's try, and each Prefect retry failed the same)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(dvc_lock, "_told_not_described", [])
    Path(".dvc").mkdir()
    Path("dvc.yaml").write_text(dvc_yaml)
    cfg = load_config("tiny.yaml")
    with caplog.at_level(logging.INFO, logger="forgeline.tasks.dvc_lock"):
        record_in_dvc_lock(stage_named("train"), cfg, None)
    [said] = [entry.getMessage() for entry in caplog.records if entry.levelno >= logging.INFO]
    assert said.startswith("dvc.lock: "), said
    assert not Path("dvc.lock").exists()


def test_under_dvc_repro_nothing_is_recorded(described: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    Path(".dvc").mkdir()
    assert in_dvc_repository()
    monkeypatch.setenv("DVC_STAGE", "eval")  # DVC records the stage it runs, holding the repository lock
    assert not in_dvc_repository()


def test_a_lock_that_cannot_be_written_is_a_warning(described: dict,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The register stage's deps and outs are not there: DVC cannot commit it."""
    subprocess.run(["git", "init", "-q"], check=True)
    subprocess.run([DVC, "init", "-q"], check=True)
    with caplog.at_level(logging.WARNING, logger="forgeline.tasks.dvc_lock"):
        record_in_dvc_lock(stage_named("register"), load_config("configs/tiny.yaml"), None)
    [warning] = [entry.getMessage() for entry in caplog.records if entry.name == "forgeline.tasks.dvc_lock"]
    assert warning.startswith("dvc.lock: stages register not recorded (") and \
        warning.endswith("`dvc status` may list them as changed until `dvc commit -f register`"), warning
    assert not Path("dvc.lock").exists()


def test_a_commit_waits_for_another_dvc_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    """Another process holds DVC's repository lock for 5 s, longer than DVC's own 3 s of retries
    (two stages of two flows finishing at once, a `dvc commit` copying a checkpoint): the commit
    waits for it, then records its stage, printing nothing of DVC's own on the console."""
    monkeypatch.chdir(tmp_path)
    subprocess.run(["git", "init", "-q"], check=True)
    subprocess.run([DVC, "init", "-q"], check=True)
    Path("dep.txt").write_text("in\n")
    Path("out.txt").write_text("out\n")
    Path("dvc.yaml").write_text(yaml.safe_dump({"stages": {"s": {"cmd": "true", "deps": ["dep.txt"],
                                                                 "outs": ["out.txt"]}}}))
    holder = subprocess.Popen([sys.executable, "-c", "import time\nfrom dvc.repo import Repo\n"
                               "Repo('.').lock.lock()\nprint('locked', flush=True)\ntime.sleep(5)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        started = time.monotonic()
        commit(["s"])
        assert time.monotonic() - started > 2
    finally:
        holder.wait(timeout=30)
    [out] = yaml.safe_load(Path("dvc.lock").read_text())["stages"]["s"]["outs"]
    assert out["path"] == "out.txt" and out["md5"]
    assert "Updating lock file" not in capfd.readouterr().out
