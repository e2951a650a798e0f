"""The persistent checkpoint tier: committed checkpoints are copied from local disk to an
fsspec URL (file://, s3://, ...) in the background, and pulled back when the local copy is
gone (a new node, a wiped disk).

A copy is committed the same way a local checkpoint is: its manifest is uploaded last, so a
directory without a manifest -- an upload cut short -- is never pulled. Like a local one, a
committed copy is never overwritten: an upload of a step the tier holds already (another
training attempt's, on another node) is skipped. The tier has no lock: two uploads of one step at
the same moment can mix their files, and such a copy fails its manifest's sha256 check when
pulled and is skipped.
"""

from __future__ import annotations

import logging
import queue
import tempfile
import threading
from pathlib import Path

import fsspec

log = logging.getLogger(__name__)


class PersistentTier:
    """Mirror of a local checkpoint root at `url`; uploads run on one background thread."""

    def __init__(self, url: str, manifest_name: str):
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.manifest_name = manifest_name
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._errors: list[BaseException] = []
        self._worker = threading.Thread(target=self._upload_loop, name="checkpoint-upload", daemon=True)
        self._worker.start()

    def upload_later(self, checkpoint: Path) -> None:
        self._queue.put(checkpoint)

    def sync(self, committed_locally: list[Path]) -> None:
        """Queue the local committed checkpoints the tier lacks -- uploads a crash or a failed
        attempt left undone."""
        uploaded = set(self.committed())
        for checkpoint in committed_locally:
            if checkpoint.name not in uploaded:
                self.upload_later(checkpoint)

    def committed(self) -> list[str]:
        """Names of fully uploaded checkpoints, newest first."""
        self.fs.invalidate_cache()  # listings may be cached; uploads come from other processes
        if not self.fs.exists(self.root):
            return []
        names = [Path(entry).name for entry in self.fs.ls(self.root, detail=False)]
        return sorted((n for n in names if self.fs.exists(f"{self.root}/{n}/{self.manifest_name}")),
                      reverse=True)

    def download(self, name: str, local_root: Path) -> Path:
        """Copy `name` into `local_root`, whole or not at all."""
        local_root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{name}.pull-", dir=local_root) as scratch:
            staging = Path(scratch) / name
            self.fs.get(f"{self.root}/{name}/", str(staging), recursive=True)
            final = local_root / name
            staging.rename(final)
        log.info("pulled %s/%s to %s", self.url, name, final)
        return final

    def set_aside(self, names: list[str], archive: str) -> None:
        """Move the copies `names` -- committed or cut short -- into `archive` in the tier, where
        `committed()` no longer finds them: the copies a rollback discarded locally."""
        if not names:
            return
        self.fs.makedirs(f"{self.root}/{archive}", exist_ok=True)
        for name in names:
            self.fs.mv(f"{self.root}/{name}", f"{self.root}/{archive}/{name}", recursive=True)
        log.info("moved %s in %s to %s/", ", ".join(names), self.url, archive)

    def steps(self) -> list[str]:
        """Names of every checkpoint copy in the tier, uploaded whole or not."""
        self.fs.invalidate_cache()
        if not self.fs.exists(self.root):
            return []
        return sorted(name for name in (Path(e).name for e in self.fs.ls(self.root, detail=False))
                      if name.startswith("step-"))

    def delete(self, name: str) -> None:
        self.fs.rm(f"{self.root}/{name}", recursive=True)

    def close(self) -> None:
        """Wait for queued uploads; raise if any failed."""
        self._queue.put(None)
        self._worker.join()
        if self._errors:
            raise RuntimeError(f"uploading checkpoints to {self.url} failed: {self._errors[0]!r}") \
                from self._errors[0]

    def _upload_loop(self) -> None:
        while (checkpoint := self._queue.get()) is not None:
            try:
                self._upload(checkpoint)
            except Exception as err:  # noqa: BLE001 -- reported by close(), training goes on
                log.error("uploading %s to %s failed: %r", checkpoint, self.url, err)
                self._errors.append(err)

    def _upload(self, checkpoint: Path) -> None:
        target = f"{self.root}/{checkpoint.name}"
        self.fs.invalidate_cache(target)  # another process may have uploaded it
        if self.fs.exists(f"{target}/{self.manifest_name}"):
            log.warning("not uploading %s: %s holds a committed copy of it already (another training "
                        "attempt's), which is never overwritten", checkpoint, target)
            return
        files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
        for path in sorted(files, key=lambda p: p.name == self.manifest_name):  # manifest last
            destination = f"{target}/{path.relative_to(checkpoint)}"
            self.fs.makedirs(destination.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(path), destination)
        log.info("uploaded %s to %s", checkpoint.name, target)
