"""`forgeline clean`: what the user names goes, nothing else, and nothing at all on a bad path."""

from __future__ import annotations

from pathlib import Path

import pytest

from forgeline.flows.cli import main


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for directory in ("artifacts/train/checkpoints/step-00000010",
                      "artifacts/train/checkpoints/step-00000020", "artifacts/data/shards"):
        (tmp_path / directory).mkdir(parents=True)
        (tmp_path / directory / "file").write_text("x")
    return tmp_path


def test_clean_removes_the_named_directories_and_says_so(workdir: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    assert main(["clean", "artifacts/train/checkpoints/step-00000010", "artifacts/data"]) == 0
    assert not (workdir / "artifacts/train/checkpoints/step-00000010").exists()
    assert not (workdir / "artifacts/data").exists()
    assert (workdir / "artifacts/train/checkpoints/step-00000020/file").exists()  # not named: kept
    printed = capsys.readouterr().out
    assert "removed artifacts/train/checkpoints/step-00000010" in printed
    assert "removed artifacts/data\n" in printed


def test_clean_refuses_a_path_outside_the_artifacts_tree_unless_told(
        workdir: Path, capsys: pytest.CaptureFixture) -> None:
    (workdir / "mine").mkdir()
    assert main(["clean", "artifacts/data", "mine"]) == 2
    assert "--outside-artifacts" in capsys.readouterr().err
    assert (workdir / "mine").exists() and (workdir / "artifacts/data").exists()  # nothing removed
    assert main(["clean", "--outside-artifacts", "mine"]) == 0
    assert not (workdir / "mine").exists()


def test_clean_removes_nothing_when_a_path_is_missing_or_holds_the_working_directory(
        workdir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["clean", "artifacts/data", "artifacts/trian"]) == 2
    assert "artifacts/trian: nothing there to remove" in capsys.readouterr().err
    assert main(["clean", "--outside-artifacts", "artifacts/data", "."]) == 2
    assert "holds the working directory" in capsys.readouterr().err
    assert (workdir / "artifacts/data/shards/file").exists()
