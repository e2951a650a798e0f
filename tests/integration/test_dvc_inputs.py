"""`dvc repro` of dvc.yaml in a fresh copy of this repository, when an input from outside it
changes: a pretrained base rewritten in place (the always-changed `base` stage) and the raw files
a source reads (the always-changed `sources` snapshot). Beside tests/integration/test_dvc.py, in a
file of its own so that the slow suite's two workers share them."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from forgeline.tasks.tracking import dvc_hash
from tests.integration.test_dvc import (  # noqa: F401  (prefect_api: the module's Prefect server)
    commit,
    dvc,
    forgeline_runs,
    fresh_repo,
    others,
    params,
    prefect_api,
    round_trip,
    stages_run,
    status,
    write_dvc_yaml,
)
from tests.integration.test_init_from import SHAPE, save_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.e2e]


def save_weights(directory: Path, vocab_size: int, seed: int) -> None:
    """A random Llama of the debug config's shape, saved as `save_pretrained` would."""
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**SHAPE, vocab_size=vocab_size, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                 rope_theta=10000.0)).save_pretrained(directory)


@pytest.mark.slow
def test_dvc_repro_trains_from_a_base_rewritten_in_place_and_not_again_from_an_unchanged_one(
        tmp_path: Path) -> None:
    """model.init_from names a Hugging Face directory. `dvc repro` -- whose `base` stage writes the
    base's identity on every run -- reruns nothing while the base stays the same; once its weights
    are rewritten in place (the same path, tokenizer and shape), it reruns data, which finds its
    output up to date (the tokenizer is the same), and train, which starts from the new weights
    instead of resuming its checkpoints. forgeline's stage cache decides alike."""
    base = tmp_path / "base"
    vocab_size = save_tokenizer(base)
    save_weights(base, vocab_size, seed=0)
    repo = fresh_repo(tmp_path)
    config = yaml.safe_load((repo / "configs" / "tiny.yaml").read_text())
    config["model"]["init_from"] = str(base)
    # As tests/integration/test_init_from.py trains from a base.
    config["train"] |= {"steps": 2, "document_masking": False, "val_every": 0, "warmup_steps": 0}
    (repo / "configs" / "tiny.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    write_dvc_yaml(repo)
    commit(repo, "a base")
    cfg = params(repo)
    assert others(stages_run(dvc(repo, "repro", "train").stdout)) == ["data", "train"]
    stamp = repo / f"{cfg.data.out_dir}.base.json"
    written = stamp.stat()
    trained = json.loads((repo / cfg.train.out_dir / "train.json").read_text())
    assert trained["base"]["weights_sha256"] == json.loads(stamp.read_text())["weights_sha256"]

    assert others(stages_run(dvc(repo, "repro", "train").stdout)) == []
    assert (stamp.stat().st_ino, stamp.stat().st_mtime_ns) == (written.st_ino, written.st_mtime_ns)

    save_weights(base, vocab_size, seed=1)
    data = dvc_hash(repo / cfg.data.out_dir)
    known: set[str] = set()
    forgeline_runs(repo, known)
    rerun = dvc(repo, "repro", "train")
    assert others(stages_run(rerun.stdout)) == ["data", "train"] == forgeline_runs(repo, known)
    assert dvc_hash(repo / cfg.data.out_dir) == data
    retrained = json.loads((repo / cfg.train.out_dir / "train.json").read_text())
    assert retrained["base"]["weights_sha256"] == json.loads(stamp.read_text())["weights_sha256"] \
        != trained["base"]["weights_sha256"]
    assert "started from the base" in rerun.stdout + rerun.stderr
    # The checkpoints of the old weights are set aside, intact, not deleted (#41).
    assert list((repo / cfg.train.out_dir / "checkpoints").glob("superseded-*/step-00000002/*"))
    assert status(repo, "data", "train") == {}


@pytest.mark.slow
def test_dvc_repro_of_the_data_stage_rebuilds_only_for_changed_raw_inputs_and_byte_identically(
        tmp_path: Path) -> None:
    repo = fresh_repo(tmp_path)
    # A local files source beside the packaged Shakespeare: raw input that can change.
    config = yaml.safe_load((repo / "configs" / "tiny.yaml").read_text())
    config["data"]["sources"].append({"kind": "files", "path": "notes/*.txt", "name": "notes"})
    (repo / "configs" / "tiny.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (repo / "notes").mkdir()
    for number in range(3):
        (repo / "notes" / f"{number}.txt").write_text(" ".join(f"note{number}-word{i}" for i in range(300)))
    write_dvc_yaml(repo)
    commit(repo, "a files source")
    raw, out = repo / params(repo).data.raw_dir, repo / params(repo).data.out_dir
    assert others(stages_run(dvc(repo, "repro", "data").stdout)) == ["data"]
    assert status(repo, "data") == {}

    def stamps() -> dict[str, tuple[int, int]]:
        return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [raw, *raw.iterdir()]}

    # Nothing changed: the sources are read again, the snapshot stays as it was, data is not rerun.
    before = stamps()
    again = dvc(repo, "repro", "data").stdout
    assert others(stages_run(again)) == [] and "Stage 'data' didn't change" in again
    assert stamps() == before

    # A raw file changes: a new snapshot, and the data stage reruns on it.
    (repo / "notes" / "1.txt").write_text(" ".join(f"rewritten-word{i}" for i in range(300)))
    manifest = json.loads((out / "manifest.json").read_text())
    assert others(stages_run(dvc(repo, "repro", "data").stdout)) == ["data"]
    assert json.loads((out / "manifest.json").read_text())["sources"]["notes"] != manifest["sources"]["notes"]
    assert status(repo, "data") == {}

    # The snapshot goes to the remote and comes back with the data.
    round_trip(repo, ("data.raw_dir", "data.out_dir"), "sources", "data")
    assert status(repo, "data") == {}

    def digests() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(out.rglob("*")) if p.is_file()}

    first = digests()
    shutil.rmtree(out)
    dvc(repo, "repro", "--force", "data")
    assert digests() == first
    assert any(name.startswith("train-") for name in first)
