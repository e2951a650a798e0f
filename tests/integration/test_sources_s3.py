"""A `files` source in object storage, against a real S3-compatible server (moto) on 127.0.0.1:
listed and read through fsspec into the same documents as the same files on local disk, named
by their s3:// URLs, and checked by the preflight."""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import s3fs

from forgeline.configs.schema import SourceConfig
from forgeline.tasks.data.sources import SourceError, preflight_sources, read_source
from tests.conftest import debug_config
from tests.integration.conftest import make_bucket

pytestmark = pytest.mark.integration

MAX_CHARS = 2_000
PREFIX = "s3://corpus/web"


@pytest.fixture
def bucket(s3_endpoint: str) -> Iterator[None]:
    # fsspec caches filesystems per process: one from an earlier test still holds that test's endpoint.
    s3fs.S3FileSystem.clear_instance_cache()
    make_bucket("corpus")
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def local_corpus(root: Path) -> Path:
    """One file of each kind the `files` reader tells apart, some in a subdirectory."""
    (root / "pages").mkdir(parents=True)
    (root / "a.txt").write_text("A plain page.\n" * 20)
    (root / "empty.txt").write_text("")
    (root / "huge.txt").write_bytes(b"x" * (4 * MAX_CHARS + 1))  # too large to read: left unread
    (root / "pages" / "b.md.gz").write_bytes(gzip.compress(b"A compressed page.\n" * 20))
    (root / "pages" / "c.jsonl").write_bytes(b'{"text": "caf\\u00e9"}\n\n{"text": "raw \xe9\xff bytes"}\n')
    rows = pa.table({"text": [f"row {n}" for n in range(2500)] + [None]})
    pq.write_table(rows, root / "pages" / "d.parquet", row_group_size=1000)
    return root


def documents(pattern: str) -> list[tuple[str, bytes | None, int]]:
    source = SourceConfig(kind="files", path=pattern, name="web")
    return [(doc.name, doc.data, doc.size) for doc in read_source(source, MAX_CHARS)]


@pytest.mark.parametrize("glob", ["**/*", "pages/*.jsonl", "*.txt", "pages/d.parquet"])
def test_objects_read_as_the_same_files_on_disk(bucket: None, tmp_path: Path, glob: str) -> None:
    root = local_corpus(tmp_path / "corpus")
    fs = fsspec.filesystem("s3")
    fs.put(f"{root}/", PREFIX, recursive=True)

    remote = documents(f"{PREFIX}/{glob}")
    local = [(name.replace(str(root), PREFIX), data, size)
             for name, data, size in documents(f"{root}/{glob}")]
    assert remote == local and remote
    assert all(name.startswith(f"{PREFIX}/") for name, _, _ in remote)


def test_preflight_checks_objects(bucket: None, tmp_path: Path) -> None:
    root = local_corpus(tmp_path / "corpus")
    fs = fsspec.filesystem("s3")
    fs.put(f"{root}/", PREFIX, recursive=True)
    sources = [{"kind": "files", "path": f"{PREFIX}/**/*", "name": "web"}]
    preflight_sources(debug_config(tmp_path, f"data.sources={json.dumps(sources)}"))

    sources[0]["text_field"] = "body"
    with pytest.raises(SourceError, match=f"{PREFIX}/pages/d.parquet has no column 'body'"):
        preflight_sources(debug_config(tmp_path, f"data.sources={json.dumps(sources)}"))

    fs.pipe(f"{PREFIX}/damaged.parquet", b"PAR1 this is not parquet")
    sources = [{"kind": "files", "path": f"{PREFIX}/*.parquet", "name": "web"}]
    with pytest.raises(SourceError, match=f"{PREFIX}/damaged.parquet is not a readable parquet file"):
        preflight_sources(debug_config(tmp_path, f"data.sources={json.dumps(sources)}"))


@pytest.mark.parametrize("pattern", [f"{PREFIX}/nowhere/*.txt", "s3://no-such-bucket/*.txt"])
def test_a_prefix_without_objects_fails_naming_the_pattern(bucket: None, tmp_path: Path,
                                                           pattern: str) -> None:
    sources = [{"kind": "files", "path": pattern}]
    error = re.escape(f"no files match '{pattern}'")
    with pytest.raises(FileNotFoundError, match=error):
        preflight_sources(debug_config(tmp_path, f"data.sources={json.dumps(sources)}"))
    with pytest.raises(FileNotFoundError, match=error):
        documents(pattern)
