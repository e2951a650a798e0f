import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from forgeline.model.fileio import sha256_file
from forgeline.model.training.shards import MANIFEST_NAME, read_manifest, read_shard, split_shards
from forgeline.tasks.data.build import build_dataset
from forgeline.tasks.data.sources import read_shakespeare
from forgeline.tasks.data.work import sequences_per_source
from tests.conftest import REPO_ROOT, debug_config


def scenes(count: int) -> list[str]:
    return [doc.data.decode() for doc in read_shakespeare("shakespeare")][:count]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """80 real scenes as separate text files: a small `files` corpus."""
    root = tmp_path_factory.mktemp("corpus")
    for number, text in enumerate(scenes(80)):
        (root / f"scene-{number:03d}.txt").write_text(text)
    return root


def files_config(root: Path, corpus: Path, *overrides: str):
    return debug_config(root, f"data.sources=[{{kind: files, path: '{corpus}/*.txt'}}]",
                        "data.samples_per_shard=100", *overrides)


def test_shakespeare_is_split_into_scenes() -> None:
    docs = list(read_shakespeare("shakespeare"))
    assert len(docs) > 700
    assert all(doc.data.startswith(b"### ") for doc in docs)
    assert {doc.name.split("#")[0] for doc in docs} >= {"hamlet", "macbeth", "the-tempest"}


def test_manifest_describes_verified_shards(data_root: Path) -> None:
    data_dir = data_root / "data"
    manifest = read_manifest(data_dir)
    for split in ("train", "val"):
        entry = manifest["splits"][split]
        assert entry["samples"] == sum(s["samples"] for s in entry["shards"]) > 0
        for shard in split_shards(data_dir, manifest, split):
            assert sha256_file(shard.path) == shard.sha256
            rows = read_shard(shard)
            assert rows.shape == (shard.samples, manifest["seq_len"] + 1)
            assert rows.max() < manifest["vocab_size"]
    assert manifest["tokenizer"]["sha256"] == sha256_file(data_dir / "tokenizer" / "tokenizer.json")
    assert manifest["sources"]["shakespeare"]["kept"] == (
        manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"])


def source_sequences(sources: list[str], lengths: np.ndarray, seq_len: int, first: int, end: int) -> dict:
    """sequences_per_source of documents given in stream order by source and token count."""
    ends = np.cumsum(np.asarray(lengths) + 1)
    labels = sorted(set(sources))
    codes = np.array([labels.index(s) for s in sources])
    counts = sequences_per_source(ends - np.asarray(lengths) - 1, ends, codes, seq_len, first, end)
    return {label: counts.get(code, 0) for code, label in enumerate(labels)}


def test_sequences_per_source_count_the_samples_holding_its_tokens() -> None:
    # seq_len 4; documents a (3 tokens), b (0), a (5), c (0), each followed by EOS: stream
    # positions a 0-3, b 4, a 5-10, c 11. Samples of 5 tokens with stride 4: positions 0-4 and
    # 4-8 (b's EOS is in both); 9-11 make no full sample.
    counts = source_sequences(["a", "b", "a", "c"], np.array([3, 0, 5, 0]), seq_len=4, first=0, end=2)
    assert counts == {"a": 2, "b": 2, "c": 0}
    # Against counting the samples directly, on random documents, whole and as shards add up.
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 40, 300)
    sources = [f"s{i}" for i in rng.integers(0, 4, 300)]
    owner = np.repeat(np.array(sources), lengths + 1)  # the source of every stream position
    seq_len = 16
    num_samples = (len(owner) - 1) // seq_len
    direct = {label: sum(label in owner[j * seq_len: j * seq_len + seq_len + 1] for j in range(num_samples))
              for label in sorted(set(sources))}
    assert source_sequences(sources, lengths, seq_len, 0, num_samples) == direct
    cuts = [0, 7, 8, 50, num_samples]
    shards = [source_sequences(sources, lengths, seq_len, a, b)
              for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    assert {label: sum(shard[label] for shard in shards) for label in direct} == direct


def test_manifest_counts_the_sequences_of_each_source(data_root: Path) -> None:
    manifest = read_manifest(data_root / "data")
    for split in ("train", "val"):
        samples = manifest["splits"][split]["samples"]
        counts = [entry[f"{split}_sequences"] for entry in manifest["sources"].values()]
        assert counts == [samples]  # one source: in every sample


def test_tokenizer_loads_in_transformers_and_round_trips(data_root: Path) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(data_root / "data" / "tokenizer"))
    text = "To be, or not to be: that is the question.\n  Whether 'tis nobler"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token == "<|endoftext|>"
    assert len(tokenizer) == read_manifest(data_root / "data")["vocab_size"] == 512


def test_packing_is_contiguous_with_eos_between_documents(data_root: Path) -> None:
    data_dir = data_root / "data"
    manifest = read_manifest(data_dir)
    rows = read_shard(split_shards(data_dir, manifest, "val")[0])
    # Consecutive samples overlap by one token: the last target is the next first input.
    assert (rows[:-1, -1] == rows[1:, 0]).all()
    assert (rows == manifest["eos_id"]).sum() > 0


def test_heldout_documents_are_exactly_the_val_split(data_root: Path) -> None:
    lines = (data_root / "data" / "val_docs.jsonl").read_text().splitlines()
    manifest = read_manifest(data_root / "data")
    assert len(lines) == manifest["splits"]["val"]["documents"]
    assert all(json.loads(line)["text"] for line in lines)


def test_same_inputs_give_byte_identical_output(tmp_path: Path, corpus: Path) -> None:
    first = build_dataset(files_config(tmp_path / "a", corpus))
    second = build_dataset(files_config(tmp_path / "b", corpus))
    digests = [{p.name: sha256_file(p) for p in Path(r.out_dir).glob("*") if p.is_file()}
               for r in (first, second)]
    assert digests[0] == digests[1]
    assert first.manifest_sha256 == second.manifest_sha256


def test_a_file_edited_by_hand_is_written_again(tmp_path: Path, corpus: Path) -> None:
    build_dataset(files_config(tmp_path, corpus))
    data_dir = tmp_path / "data"
    before = {p.name: sha256_file(p) for p in data_dir.rglob("*") if p.is_file()}
    assert build_dataset(files_config(tmp_path, corpus)).reused
    with open(data_dir / "val_docs.jsonl", "a") as f:
        f.write('{"text": "added by hand"}\n')
    assert not build_dataset(files_config(tmp_path, corpus)).reused
    assert {p.name: sha256_file(p) for p in data_dir.rglob("*") if p.is_file()} == before


def test_rerun_replaces_output_whole(tmp_path: Path, corpus: Path) -> None:
    build_dataset(files_config(tmp_path, corpus))
    build_dataset(files_config(tmp_path, corpus, "data.samples_per_shard=50"))
    data_dir = tmp_path / "data"
    listed = {s["path"] for split in read_manifest(data_dir)["splits"].values() for s in split["shards"]}
    on_disk = {p.name for p in data_dir.glob("*.tar")}
    assert listed == on_disk
    assert not list(tmp_path.glob(".data.*"))  # no staging or old directories left behind


def test_missing_files_fail_before_anything_is_written(tmp_path: Path) -> None:
    cfg = files_config(tmp_path, tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no files match"):
        build_dataset(cfg)
    assert not (tmp_path / "data").exists()


def test_unreadable_input_keeps_the_previous_output(tmp_path: Path, corpus: Path) -> None:
    build_dataset(files_config(tmp_path, corpus))
    before = sha256_file(tmp_path / "data" / MANIFEST_NAME)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "ok.txt").write_text("fine text " * 100)
    (bad / "broken.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(ValueError, match=r"broken.gz cannot be read"):
        build_dataset(files_config(tmp_path, bad, f"data.sources=[{{kind: files, path: '{bad}/*'}}]"))
    assert sha256_file(tmp_path / "data" / MANIFEST_NAME) == before


def test_corpus_too_small_for_one_sample_is_explained(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    for i in range(40):
        (tiny / f"{i}.txt").write_text(f"document number {i}")
    with pytest.raises(ValueError, match="fewer than one sample"):
        build_dataset(files_config(tmp_path, tiny, "data.val_fraction=0.5"))


def test_samples_are_stored_compactly(data_root: Path) -> None:
    manifest = read_manifest(data_root / "data")
    rows = read_shard(split_shards(data_root / "data", manifest, "train")[0])
    assert rows.dtype == np.uint16


def test_killed_while_writing_shards_leaves_the_previous_output_intact(tmp_path: Path, corpus: Path) -> None:
    build_dataset(files_config(tmp_path, corpus))
    data_dir = tmp_path / "data"
    before = {p.name: sha256_file(p) for p in data_dir.rglob("*") if p.is_file()}
    # One sample per shard: a write long enough to be caught in.
    script = ("from forgeline.tasks.data.build import build_dataset; "
              "from tests.unit.test_data import files_config; from pathlib import Path; "
              f"build_dataset(files_config(Path({str(tmp_path)!r}), Path({str(corpus)!r}), "
              "'data.samples_per_shard=1'))")
    writer = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".data.tmp-*/train-*.tar")):
            assert writer.poll() is None and time.monotonic() < deadline, "the stage ended before writing"
            time.sleep(0.01)
    finally:
        os.killpg(writer.pid, signal.SIGKILL)
        writer.wait()
    assert {p.name: sha256_file(p) for p in data_dir.rglob("*") if p.is_file()} == before
    # Its staging directory stays behind, named after it, until the next run removes it.
    [stale] = tmp_path.glob(".data.tmp-*")
    assert stale.name.startswith(f".data.tmp-{socket.gethostname()}-{writer.pid}-")
    assert build_dataset(files_config(tmp_path, corpus)).reused
    assert not stale.exists()
