"""The stateful, resumable loader training reads the packed shards (shards.py) with.

It defines one global sample order per epoch (a seeded permutation of shards, then of samples
within each shard). Step s consumes global samples [s*G, (s+1)*G) with G the global batch size;
data-parallel rank r takes its contiguous slice. Its state is the global position, so a resume
continues at exactly the next unseen sample -- also with another dp degree. A background thread
opens the next shard of the order (sha256 check, decode, shuffle) while the current one is
consumed.
"""

from __future__ import annotations

import bisect
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from forgeline.model.training.shards import DataError, ShardInfo, read_shard, verify_shard


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
