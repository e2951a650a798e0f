import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from forgeline.configs import load_config
from forgeline.flows.cli import main
from forgeline.tasks.stage import STAGE_NAMES

FORGELINE = str(Path(sys.executable).parent / "forgeline")


@pytest.mark.parametrize("verb", [[], ["run"], ["stage"], ["status"], ["stages"], ["config"],
                                  ["config", "show"], ["plan"]],
                         ids=lambda v: " ".join(v) or "forgeline")
def test_every_verb_has_help(verb: list[str]) -> None:
    done = subprocess.run([FORGELINE, *verb, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: forgeline" in done.stdout


def test_stage_help_lists_the_four_stages() -> None:
    done = subprocess.run([FORGELINE, "stage", "--help"], capture_output=True, text=True, timeout=60)
    assert all(name in done.stdout for name in STAGE_NAMES)


def test_bad_config_fails_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--set", "parallel.tp=3"]) == 2
    assert "parallel.tp=3 must divide model.n_heads=8" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no artifacts, no MLflow store, nothing


def test_stage_with_unknown_key_fails_with_exit_code_2(capsys: pytest.CaptureFixture) -> None:
    assert main(["stage", "eval", "--set", "eval.limt=3"]) == 2
    assert "eval.limt: unknown key" in capsys.readouterr().err


def test_config_show_prints_the_resolved_config(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "show", "--config", "debug.yaml", "--set", "train.steps=7"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["train"]["steps"] == 7 and shown["model"]["dim"] == 64


def test_config_docs_cover_every_section(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "show", "--docs"]) == 0
    out = capsys.readouterr().out
    for section in ("data", "model", "parallel", "train", "checkpoint", "eval", "registry"):
        assert f"\n{section}:" in f"\n{out}"


def test_stage_without_its_upstream_output_fails_before_any_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["stage", "eval", "--config", "debug.yaml"]) == 2
    err = capsys.readouterr().err
    assert "stage 'eval' reads the output of data, train, which is missing" in err
    assert "run `forgeline stage data` first" in err
    assert list(tmp_path.iterdir()) == []


def test_plan_writes_a_config_the_launch_takes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "planned.yaml"
    assert main(["plan", "--config", "tiny.yaml", "--nodes", "1", "--accelerators-per-node", "8",
                 "--memory-gib", "80", "--write-config", str(out)]) == 0
    report = capsys.readouterr().out
    assert "layout                  TP=1 PP=1 DP=8" in report and "Young" in report
    planned = load_config(out)
    assert (planned.parallel.tp, planned.parallel.pp, planned.parallel.dp_shard) == (1, 1, 8)
    assert planned.model == load_config("tiny.yaml").model


def test_plan_across_nodes_needs_a_rendezvous(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--params", "10e9", "--nodes", "32", "--accelerators-per-node", "8",
                 "--memory-gib", "40", "--global-batch", "512", "--microbatches", "16",
                 "--write-config", str(tmp_path / "p.yaml")]) == 2
    assert "pass --set parallel.rdzv_endpoint=HOST:PORT" in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()
