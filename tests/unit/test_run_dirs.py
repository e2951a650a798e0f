"""Runs that cannot collide (#41): each run's outputs live in a directory named for the run, data
in one named for what it is built from; a train directory holding another configuration's
checkpoints is refused before any work, touching nothing; nothing deletes committed checkpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from forgeline.configs import Config, ConfigError, load_config, shipped_configs
from forgeline.flows.cli import main
from forgeline.model.checkpoint.manager import MANIFEST_NAME, committed_checkpoints
from forgeline.tasks.dvc_yaml import check_dvc_outputs, render_dvc_yaml
from forgeline.tasks.tracking import dvc_hash
from forgeline.tasks.train.job import (
    RUN_RECORD,
    RunDirectoryTaken,
    check_run_directory,
    run_record,
    set_aside_superseded,
)


def test_a_run_is_named_by_its_config_and_what_its_checkpoints_are_computed_from(tmp_path: Path) -> None:
    tiny = load_config("tiny.yaml")
    assert re.fullmatch(r"tiny-[0-9a-f]{8}", tiny.run.name)
    assert (tiny.train.out_dir, tiny.eval.out_dir, tiny.registry.out_dir) == tuple(
        f"artifacts/{tiny.run.name}/{stage}" for stage in ("train", "eval", "register"))
    # Another recipe is another run, on the same data: nothing to rebuild.
    steps = load_config("tiny.yaml", ["train.steps=30", "train.warmup_steps=3"])
    assert steps.run.name != tiny.run.name and steps.train.out_dir != tiny.train.out_dir
    assert (steps.data.out_dir, steps.data.raw_dir) == (tiny.data.out_dir, tiny.data.raw_dir)
    assert steps.registry.model_name == tiny.registry.model_name  # its model line, facing its champion
    # The same run: what scores, registers or lays out the same checkpoints.
    for same in ("eval.dimensions.math.limit=3", "registry.promotion_margin=0.1", "parallel.pp=1",
                 "checkpoint.keep_last=1", "train.log_every=1"):
        assert load_config("tiny.yaml", [same]).train.out_dir == tiny.train.out_dir, same
    # A config that inherits another and changes its data: its own data and its own run.
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"inherit: tiny.yaml\ndata:\n  sources: [{{kind: files, path: '{tmp_path}/*.md'}}]\n")
    own = load_config(mine)
    assert own.run.name.startswith("mine-") and own.data.out_dir != tiny.data.out_dir
    assert own.data.raw_dir != tiny.data.raw_dir and own.registry.model_name == "forgeline-mine"
    # fine-tuning.md's my-sft.yaml: never the shipped example's directories.
    my_sft = tmp_path / "my-sft.yaml"
    my_sft.write_text("inherit: smollm2-sft.yaml\ndata:\n  sources: [{kind: files, path: chats/*.jsonl, "
                      "format: messages}]\nsft:\n  lora: {rank: 16, alpha: 32}\n")
    shipped, mine_sft = load_config("smollm2-sft.yaml"), load_config(my_sft)
    assert mine_sft.train.out_dir.startswith("artifacts/my-sft-")
    def directories(cfg: Config) -> set[str]:
        return {cfg.train.out_dir, cfg.eval.out_dir, cfg.registry.out_dir, cfg.data.out_dir}

    assert directories(mine_sft).isdisjoint(directories(shipped))
    # The same model in one process: its own directory all the same (another config file).
    assert load_config("tiny-single.yaml").train.out_dir != tiny.train.out_dir
    # run.name names the directory, whatever else changes; a directory given stays as given.
    named = load_config("tiny.yaml", ["run.name=shakespeare-v2", "train.steps=50", "train.warmup_steps=5"])
    assert named.train.out_dir == "artifacts/shakespeare-v2/train"
    assert load_config("tiny.yaml", ["train.out_dir=/scratch/t"]).train.out_dir == "/scratch/t"
    with pytest.raises(ConfigError, match=r"run.name '\.\./x' names a directory under artifacts/"):
        load_config("tiny.yaml", ["run.name=../x"])
    # Revalidated (a base's shape filled in, --upstream-run's directories) it stays the same run.
    assert tiny.with_values({"train.lr": 0.5}).train.out_dir == tiny.train.out_dir


def test_no_two_shipped_configs_share_a_run_directory_and_none_hard_codes_one() -> None:
    configs = {path.name: load_config(path) for path in shipped_configs()}
    for name, path in ((path.name, path) for path in shipped_configs()):
        for section in yaml.safe_load(path.read_text()).values():
            if isinstance(section, dict):
                assert not {"out_dir", "raw_dir"} & set(section), name
    train_dirs = [cfg.train.out_dir for cfg in configs.values()]
    assert len(set(train_dirs)) == len(train_dirs), train_dirs


def committed(root: Path, step: int, fingerprint: str) -> Path:
    """A committed checkpoint as the manager leaves it (its manifest last)."""
    path = root / "checkpoints" / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "model.distcp").write_bytes(b"weights")
    (path / MANIFEST_NAME).write_text(json.dumps({"step": step, "fingerprint": fingerprint, "files": {}}))
    return path


def test_a_train_directory_holding_another_configurations_checkpoints_is_refused_untouched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    first = load_config("debug.yaml")
    train_dir = Path(first.train.out_dir)
    committed(train_dir, 20, "resume-fingerprint")
    (train_dir / RUN_RECORD).write_text(json.dumps(run_record(first)))
    check_run_directory(first)  # its own run: resumed
    before = dvc_hash(train_dir)

    other = load_config("debug.yaml", ["run.name=" + first.run.name, "train.lr=0.1"])
    with pytest.raises(RunDirectoryTaken) as refused:
        check_run_directory(other)
    message = str(refused.value)
    assert str(train_dir) in message and "nothing in it was touched" in message
    assert "run.name" in message and f"forgeline clean {train_dir}" in message
    (train_dir / RUN_RECORD).unlink()  # an earlier forgeline's directory: whose, unknown
    with pytest.raises(RunDirectoryTaken, match=f"a run that recorded no {RUN_RECORD}"):
        check_run_directory(first)
    (train_dir / RUN_RECORD).write_text(json.dumps(run_record(first)))

    # The CLI: refused before any work (exit 2, no data built, no stage started), the message on stderr.
    assert main(["run", "--config", "debug.yaml", "--set", f"run.name={first.run.name}",
                 "--set", "train.lr=0.1"]) == 2
    assert "holds the checkpoints of another configuration" in capsys.readouterr().err
    assert not Path(first.data.out_dir).exists() and not Path(first.eval.out_dir).exists()
    assert dvc_hash(train_dir) == before


def test_checkpoints_of_this_run_on_changed_data_are_set_aside_not_deleted(tmp_path: Path) -> None:
    stale = committed(tmp_path, 10, "old-data")
    kept = committed(tmp_path, 20, "this-data")
    archive = set_aside_superseded(tmp_path / "checkpoints", "this-data")
    assert archive is not None and archive.name.startswith("superseded-")
    assert not stale.exists() and (archive / stale.name / "model.distcp").read_bytes() == b"weights"
    assert [info.path for info in committed_checkpoints(tmp_path / "checkpoints")] == [kept]
    assert set_aside_superseded(tmp_path / "checkpoints", "this-data") is None


def test_a_stage_dvc_runs_fails_when_the_config_moved_its_directories(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = tmp_path / "configs" / "tiny.yaml"
    params.parent.mkdir()
    params.write_text(Path(shipped_configs()[0].parent / "debug.yaml").read_text())
    (tmp_path / "dvc.yaml").write_text(render_dvc_yaml(root=tmp_path))
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.setenv("DVC_STAGE", "train")
    check_dvc_outputs(load_config(params), "configs/tiny.yaml")  # dvc.yaml names its directories
    check_dvc_outputs(load_config(params, ["eval.batch_size=2"]), "configs/tiny.yaml")  # the same run
    moved = load_config(params, ["train.lr=0.1"])
    with pytest.raises(ValueError, match=r"Run `forgeline stages --write` so that dvc.yaml follows"):
        check_dvc_outputs(moved, "configs/tiny.yaml")


def test_a_planned_config_names_a_run_of_its_own(tmp_path: Path) -> None:
    """`forgeline plan --write-config` writes no run.name or directory that tiny.yaml's load filled
    in: the planned file, another recipe (its global batch), trains in a directory of its own."""
    out = tmp_path / "planned.yaml"
    assert main(["plan", "--config", "tiny.yaml", "--nodes", "1", "--accelerators-per-node", "8",
                 "--memory-gib", "80", "--write-config", str(out)]) == 0
    written = yaml.safe_load(out.read_text())
    assert "name" not in written.get("run", {}) and "out_dir" not in written["train"]
    planned, tiny = load_config(out), load_config("tiny.yaml")
    assert planned.run.name.startswith("planned-") and planned.train.out_dir != tiny.train.out_dir
    assert planned.data.out_dir == tiny.data.out_dir  # the same data
