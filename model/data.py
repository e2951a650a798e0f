"""Packed token shards: their on-disk format and the stateful loader training reads them with.

A shard is a webdataset tar whose samples each hold `tokens.npy`, seq_len + 1 token ids (inputs
and the targets shifted by one), and `starts.npy`, the offsets in it where a document begins
(for document-level attention masks). `manifest.json` beside the shards lists every shard with
its sample count and sha256.

The loader defines one global sample order per epoch (a seeded permutation of shards, then of
samples within each shard). Step s consumes global samples [s*G, (s+1)*G) with G the global
batch size; data-parallel rank r takes its contiguous slice. Its state is the global position,
so a resume continues at exactly the next unseen sample -- also with another dp degree.
A background thread opens the next shard of the order (sha256 check, decode, shuffle) while
the current one is consumed.
"""

from __future__ import annotations

import ast
import bisect
import functools
import io
import json
import tarfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from forgeline.model.fileio import sha256_file

MANIFEST_NAME = "manifest.json"
SAMPLE_FIELD = "tokens.npy"
STARTS_FIELD = "starts.npy"
FORMAT_VERSION = "forgeline-shards/2"


class DataError(RuntimeError):
    """Missing, stale or corrupt data-stage output."""


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    samples: int
    sha256: str


def read_manifest(data_dir: str | Path) -> dict:
    path = Path(data_dir) / MANIFEST_NAME
    if not path.is_file():
        raise DataError(
            f"{path} not found: run the data stage first (`forgeline stage data`), "
            "or point data.out_dir at its output"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise DataError(
            f"{path} has format {manifest.get('format')!r}, expected {FORMAT_VERSION!r}; "
            "rerun the data stage"
        )
    return manifest


def split_shards(data_dir: str | Path, manifest: dict, split: str) -> list[ShardInfo]:
    return [
        ShardInfo(Path(data_dir) / s["path"], s["samples"], s["sha256"])
        for s in manifest["splits"][split]["shards"]
    ]


def verify_shard(shard: ShardInfo) -> None:
    actual = sha256_file(shard.path)
    if actual != shard.sha256:
        raise DataError(
            f"shard {shard.path} is corrupt: sha256 {actual} != {shard.sha256} in the manifest; "
            "rerun the data stage (or `dvc checkout`)"
        )


@functools.lru_cache(maxsize=64)
def _npy_header(header: bytes) -> tuple[np.dtype, tuple[int, ...]] | None:
    fields = ast.literal_eval(header.decode("latin1"))
    return None if fields["fortran_order"] else (np.dtype(fields["descr"]), fields["shape"])


def decode_npy(payload: bytes) -> np.ndarray:
    """np.load of an in-memory .npy, minus its per-call header parsing (which dominates for
    samples this small): every sample of a shard has one of a few headers."""
    if payload[6] == 1:  # format version 1.0: a 2-byte header length
        end = 10 + int.from_bytes(payload[8:10], "little")
        if (parsed := _npy_header(payload[10:end])) is not None:
            dtype, shape = parsed
            return np.frombuffer(payload, dtype, offset=end).reshape(shape)
    return np.load(io.BytesIO(payload))


def iter_shard(shard: ShardInfo) -> Iterator[dict[str, np.ndarray]]:
    """The samples of a shard in order, each as {field: array}."""
    sample: dict[str, np.ndarray] = {}
    key = None
    with tarfile.open(shard.path) as tar:
        for member in tar:
            member_key, field = member.name.split(".", 1)
            if member_key != key and sample:
                yield sample
                sample = {}
            key = member_key
            sample[field] = decode_npy(tar.extractfile(member).read())
    if sample:
        yield sample


def read_shard(shard: ShardInfo) -> np.ndarray:
    """All samples of a shard as a (samples, seq_len + 1) array."""
    rows = [sample[SAMPLE_FIELD] for sample in iter_shard(shard)]
    if len(rows) != shard.samples:
        raise DataError(f"shard {shard.path} has {len(rows)} samples, manifest says {shard.samples}")
    return np.stack(rows)


class ShardedSampleLoader:
    """Deterministic, resumable batches of packed samples for one data-parallel rank."""

    def __init__(self, shards: list[ShardInfo], local_batch_size: int, dp_rank: int,
                 dp_size: int, seed: int):
        self.shards = shards
        self.local_batch_size = local_batch_size
        self.global_batch_size = local_batch_size * dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        total = sum(s.samples for s in shards)
        if total < self.global_batch_size:
            raise DataError(
                f"{total} training samples cannot fill one global batch of "
                f"{self.global_batch_size}; use a larger corpus or a smaller train.global_batch_size"
            )
        self.epoch = 0
        self.position = 0  # global samples consumed in this epoch
        self._order: tuple[np.ndarray, np.ndarray] | None = None  # (shard order, cumulative)
        self._current: tuple[int, np.ndarray] | None = None  # (slot in the order, its samples)
        self._pending: dict[int, Future[np.ndarray]] = {}  # slot -> shard being opened
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-prefetch")
        self._verified: set[int] = set()  # shards whose sha256 was checked on first open

    @property
    def samples_per_epoch(self) -> int:
        """Whole global batches only; the remainder of an epoch is dropped."""
        total = sum(s.samples for s in self.shards)
        return total - total % self.global_batch_size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise DataError(f"loader state was saved with seed {state['seed']}, now {self.seed}")
        self.epoch, self.position = state["epoch"], state["position"]
        self._reset_order()

    def next_batch(self) -> torch.Tensor:
        """The next (local_batch_size, seq_len + 1) int64 batch of this rank."""
        if self.position + self.global_batch_size > self.samples_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
            self._reset_order()
        start = self.position + self.dp_rank * self.local_batch_size
        rows = [self._sample(start + i) for i in range(self.local_batch_size)]
        self.position += self.global_batch_size
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def _epoch_order(self) -> tuple[np.ndarray, np.ndarray]:
        if self._order is None:
            rng = np.random.default_rng([self.seed, self.epoch])
            shard_order = rng.permutation(len(self.shards))
            cumulative = np.cumsum([self.shards[i].samples for i in shard_order])
            self._order = (shard_order, cumulative)
        return self._order

    def _reset_order(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._order, self._current, self._pending = None, None, {}

    def _sample(self, index: int) -> np.ndarray:
        shard_order, cumulative = self._epoch_order()
        slot = bisect.bisect_right(cumulative, index)
        offset = index - (cumulative[slot - 1] if slot else 0)
        if self._current is None or self._current[0] != slot:
            self._current = (slot, self._open(slot).result())  # keep one shard resident
            self._pending.pop(slot)
            if slot + 1 < len(shard_order):
                self._open(slot + 1)  # the next shard loads while this one is consumed
        return self._current[1][offset]

    def _open(self, slot: int) -> Future[np.ndarray]:
        if slot not in self._pending:
            shard_id = int(self._epoch_order()[0][slot])
            self._pending[slot] = self._prefetcher.submit(self._shuffled_shard, self.epoch, shard_id)
        return self._pending[slot]

    def _shuffled_shard(self, epoch: int, shard_id: int) -> np.ndarray:
        if shard_id not in self._verified:
            verify_shard(self.shards[shard_id])
            self._verified.add(shard_id)
        rows = read_shard(self.shards[shard_id])
        rng = np.random.default_rng([self.seed, epoch, shard_id])
        return rows[rng.permutation(len(rows))]
