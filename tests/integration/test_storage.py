"""The persistent checkpoint tier, against a real S3-compatible server (moto) on 127.0.0.1 and
a file:// URL: committed checkpoints are uploaded in the background, and a job whose local
copies are gone resumes from the newest fully uploaded one."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import fsspec
import pytest

from forgeline.model.checkpoint.manager import MANIFEST_NAME
from forgeline.tasks.train.job import train_model
from tests.conftest import debug_config
from tests.integration.conftest import make_bucket

pytestmark = pytest.mark.integration


@pytest.fixture
def s3_url(s3_endpoint: str) -> str:
    make_bucket("checkpoints")
    return "s3://checkpoints/runs/debug"


@pytest.mark.parametrize("tier", ["s3", "file"])
def test_checkpoints_reach_the_persistent_tier_and_come_back(
        tier: str, data_root: Path, tmp_path: Path, request: pytest.FixtureRequest,
        caplog: pytest.LogCaptureFixture) -> None:
    url = request.getfixturevalue("s3_url") if tier == "s3" else (tmp_path / "persistent").as_uri()
    cfg = debug_config(tmp_path, f"data.out_dir={data_root / 'data'}", "parallel.dp_shard=2",
                       f"checkpoint.persistent_url={url}", "train.peak_tflops=1")
    first = train_model(cfg)

    fs, root = fsspec.core.url_to_fs(url)
    uploaded = sorted(Path(p).name for p in fs.ls(root, detail=False))
    assert uploaded == ["step-00000010", "step-00000020"]
    local = Path(first.checkpoint)
    for path in local.iterdir():
        assert fs.cat_file(f"{root}/{local.name}/{path.name}") == path.read_bytes()

    # An upload cut short (no manifest) is never pulled back.
    fs.makedirs(f"{root}/step-00000030", exist_ok=True)
    fs.pipe_file(f"{root}/step-00000030/__0_0.distcp", b"half an upload")
    shutil.rmtree(tmp_path / "train" / "checkpoints")  # a new node: nothing on local disk
    caplog.set_level(logging.INFO)
    again = train_model(cfg)
    assert f"pulled {url}/step-00000020" in caplog.text and "resumed from" in caplog.text
    assert again == first
    assert (local / MANIFEST_NAME).read_bytes() == fs.cat_file(f"{root}/step-00000020/{MANIFEST_NAME}")
