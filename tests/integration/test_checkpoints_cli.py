"""`forgeline checkpoints list | verify | rollback | export` on the checkpoints of a real run."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from forgeline.flows.cli import main
from forgeline.model.checkpoint.manager import MANIFEST_NAME, committed_checkpoints
from forgeline.model.checkpoint.tiers import PersistentTier
from forgeline.model.fileio import sha256_file
from forgeline.model.inference import load_bundle, load_from_checkpoint
from forgeline.tasks.train.job import train_model
from tests.conftest import debug_config

pytestmark = pytest.mark.integration

TOKENS = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])


@pytest.fixture(scope="module")
def trained(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt-cli")
    train_model(debug_config(root, f"data.out_dir={data_root / 'data'}", "train.peak_tflops=1"))
    return root


def cli(root: Path, data_root: Path, *args: str) -> int:
    return main(["checkpoints", *args, "--config", "debug.yaml", "--set", f"train.out_dir={root / 'train'}",
                 "--set", f"data.out_dir={data_root / 'data'}"])


def test_list_and_verify(trained: Path, data_root: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli(trained, data_root, "list") == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in listed] == ["20", "10"]
    assert cli(trained, data_root, "verify") == 0
    assert capsys.readouterr().out.split() == ["step", "20", "ok", "step", "10", "ok"]


def test_verify_reports_a_corrupt_file(trained: Path, data_root: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(trained / "train", copy / "train")
    shard = next((copy / "train" / "checkpoints" / "step-00000020").glob("*.distcp"))
    shard.write_bytes(b"x" + shard.read_bytes()[1:])
    assert cli(copy, data_root, "verify") == 1
    assert "step       20  CORRUPT" in capsys.readouterr().out


def test_export_as_bundle_and_as_hugging_face(trained: Path, data_root: Path, tmp_path: Path) -> None:
    checkpoint = trained / "train" / "checkpoints" / "step-00000020"
    expected = load_from_checkpoint(checkpoint)(TOKENS)
    assert cli(trained, data_root, "export", "20", "--out", str(tmp_path / "bundle")) == 0
    torch.testing.assert_close(load_bundle(tmp_path / "bundle")(TOKENS), expected, rtol=0, atol=0)
    assert (tmp_path / "bundle" / "tokenizer" / "tokenizer.json").is_file()
    assert cli(trained, data_root, "export", "20", "--out", str(tmp_path / "hf"), "--format", "hf") == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (hf(TOKENS).logits - expected).abs().max() < 1e-4
    assert cli(trained, data_root, "export", "20", "--out", str(tmp_path / "hf")) == 2  # never overwritten


def test_rollback_keeps_newer_versions_and_the_next_run_resumes_from_it(
        trained: Path, data_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    work = tmp_path / "work"
    shutil.copytree(trained / "train", work / "train")
    assert cli(work, data_root, "rollback", "10") == 0
    root = work / "train" / "checkpoints"
    assert [c.step for c in committed_checkpoints(root)] == [10]
    [archive] = root.glob("rolled-back-*")
    assert (archive / "step-00000020" / "forgeline-checkpoint.json").is_file()
    assert not (work / "train" / "train.json").exists()
    caplog.set_level(logging.INFO)
    result = train_model(debug_config(work, f"data.out_dir={data_root / 'data'}", "train.peak_tflops=1"))
    assert "step-00000010 (step 10)" in caplog.text and result.step == 20
    assert cli(work, data_root, "rollback", "15") == 2  # no such version: a clear error


@pytest.mark.slow  # trains twice: about 2 min
def test_rollback_moves_the_persistent_tiers_newer_copies_too(
        trained: Path, data_root: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    shutil.copytree(trained / "train", work / "train")
    root = work / "train" / "checkpoints"
    url = (tmp_path / "tier").as_uri()
    uploaded = PersistentTier(url, MANIFEST_NAME)
    uploaded.sync([info.path for info in committed_checkpoints(root)])  # as the run uploaded them
    uploaded.close()
    with_tier = ["--set", f"checkpoint.persistent_url={url}"]
    assert cli(work, data_root, "rollback", "10", *with_tier) == 0
    tier = PersistentTier(url, MANIFEST_NAME)
    assert tier.committed() == ["step-00000010"]
    [archive] = root.glob("rolled-back-*")
    assert (tmp_path / "tier" / archive.name / "step-00000020" / MANIFEST_NAME).is_file()

    # Retrained from step 10, the new step 20 is uploaded; a node without local copies pulls it.
    train_model(debug_config(work, f"data.out_dir={data_root / 'data'}", "train.peak_tflops=1",
                             f"checkpoint.persistent_url={url}"))
    assert tier.committed() == ["step-00000020", "step-00000010"]
    tier.close()
    assert sha256_file(tmp_path / "tier" / "step-00000020" / MANIFEST_NAME) == \
        sha256_file(root / "step-00000020" / MANIFEST_NAME)
