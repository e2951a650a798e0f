"""The stateful, resumable loader training reads the packed shards (shards.py) with.

It defines one global sample order per epoch (a seeded permutation of shards, then of samples
within each shard). Step s consumes global samples [s*G, (s+1)*G) with G the global batch size;
data-parallel rank r takes its contiguous slice. Its state is the global position, so a resume
continues at exactly the next unseen sample -- also with another dp degree. A background thread
opens the next shard of the order (sha256 check, decode, shuffle) while the current one is
consumed.

With `document_starts` it also reads each sample's document starts (shards.py STARTS_FIELD) and
yields a DocumentBatch: the tokens and the document each token belongs to, for document masking
(`train.document_masking`, resolved by `Config.masks_documents`). Shards of conversations carry
loss masks (shards.py MASK_FIELD, `ShardInfo.loss_masks` from the manifest): then every batch is
a DocumentBatch with its `loss_mask` (without `document_starts`, all of a row is one document).
Shards of preference pairs (`ShardInfo.pairs`) carry in their masks which reply of a pair each
trained token is (preference.py); the batch keeps them as `sides`, with the reference model's
log-probabilities of its targets (`reference`: one array per split, by sample, computed before
training) where the loader is given them.

Validation (`train.val_every`) reads the validation split with the same loader under a fixed
seed: its first `train.val_batches` global batches, the same for every run and layout.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders

from forgeline.model.training.shards import (
    MASK_FIELD,
    SAMPLE_FIELD,
    STARTS_FIELD,
    DataError,
    ShardInfo,
    iter_shard,
    read_shard,
    verify_shard,
)


@dataclass(frozen=True)
class Row:
    """One sample: its tokens, documents and loss mask (None where not read), and its number in
    its split (the order of the manifest's shards and of the samples in each)."""

    tokens: np.ndarray
    documents: np.ndarray | None
    mask: np.ndarray | None
    sample_id: int


@dataclass(frozen=True)
class Rows:
    """A shard's samples, as Row's fields stacked."""

    tokens: np.ndarray
    documents: np.ndarray | None
    masks: np.ndarray | None
    sample_ids: np.ndarray

    def ordered(self, order: np.ndarray) -> Rows:
        def picked(array: np.ndarray | None) -> np.ndarray | None:
            return array[order] if array is not None else None

        return Rows(self.tokens[order], picked(self.documents), picked(self.masks), self.sample_ids[order])

    def row(self, offset: int) -> Row:
        return Row(self.tokens[offset], None if self.documents is None else self.documents[offset],
                   None if self.masks is None else self.masks[offset], int(self.sample_ids[offset]))

    def each(self) -> Iterator[Row]:
        return (self.row(offset) for offset in range(len(self.tokens)))


@dataclass
class DocumentBatch:
    """Packed samples and, per token, a number for its document: equal within a document,
    increasing along the sample (the tokens before the sample's first document start, the tail
    of an earlier document, count as one)."""

    tokens: torch.Tensor  # (B, T + 1) int64
    documents: torch.Tensor  # (B, T + 1) int32, non-decreasing along T
    loss_mask: torch.Tensor | None = None  # (B, T + 1) bool: the tokens that are loss targets (SFT)
    sides: torch.Tensor | None = None  # (B, T + 1) uint8: preference pairs' CHOSEN or REJECTED, 0 elsewhere
    reference: torch.Tensor | None = None  # (B, T) float32: the reference's log-probability of each target

    def to(self, device: torch.device | str) -> DocumentBatch:
        def moved(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return tensor.to(device) if tensor is not None else None

        return DocumentBatch(self.tokens.to(device), self.documents.to(device), moved(self.loss_mask),
                             moved(self.sides), moved(self.reference))

    def rows(self, index: slice | torch.Tensor) -> DocumentBatch:
        """The batch of these rows."""
        def picked(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return tensor[index] if tensor is not None else None

        return DocumentBatch(self.tokens[index], self.documents[index], picked(self.loss_mask),
                             picked(self.sides), picked(self.reference))


class ShardedSampleLoader:
    """Deterministic, resumable batches of packed samples for one data-parallel rank."""

    def __init__(self, shards: list[ShardInfo], local_batch_size: int, dp_rank: int,
                 dp_size: int, seed: int, document_starts: bool = False, reference: np.ndarray | None = None):
        self.shards = shards
        self.document_starts = document_starts
        self.loss_masks = any(shard.loss_masks for shard in shards)
        self.pairs = any(shard.pairs for shard in shards)
        self.reference = reference  # (samples of the split, T) float32, by the split's sample order
        self.first_ids = np.concatenate([[0], np.cumsum([shard.samples for shard in shards])])[:-1]
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
        self._current: tuple[int, Rows] | None = None  # (slot in the order, its samples)
        self._pending: dict[int, Future[Rows]] = {}  # slot -> shard being opened
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

    def next_batch(self) -> torch.Tensor | DocumentBatch:
        """The next (local_batch_size, seq_len + 1) int64 batch of this rank; with
        `document_starts` or loss masks, a DocumentBatch of it."""
        if self.position + self.global_batch_size > self.samples_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
            self._reset_order()
        start = self.position + self.dp_rank * self.local_batch_size
        rows = [self._sample(start + i) for i in range(self.local_batch_size)]
        self.position += self.global_batch_size
        return self.batch_of(rows)

    def batch_of(self, rows: list[Row]) -> torch.Tensor | DocumentBatch:
        """Samples as a (B, T + 1) batch, or a DocumentBatch of them with their documents, masks,
        sides and reference log-probabilities where the loader has them."""
        tokens = torch.from_numpy(np.stack([row.tokens for row in rows]).astype(np.int64))
        if not self.document_starts and not self.loss_masks:
            return tokens
        documents = (torch.from_numpy(np.stack([row.documents for row in rows]))
                     if self.document_starts else torch.zeros(tokens.shape, dtype=torch.int32))
        masks = torch.from_numpy(np.stack([row.mask for row in rows])) if self.loss_masks else None
        sides = masks if self.pairs else None
        reference = None
        if self.reference is not None:
            reference = torch.from_numpy(np.stack([self.reference[row.sample_id] for row in rows]))
        return DocumentBatch(tokens, documents, masks.bool() if masks is not None else None, sides, reference)

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

    def _sample(self, index: int) -> Row:
        shard_order, cumulative = self._epoch_order()
        slot = bisect.bisect_right(cumulative, index)
        offset = index - (cumulative[slot - 1] if slot else 0)
        if self._current is None or self._current[0] != slot:
            self._current = (slot, self._open(slot).result())  # keep one shard resident
            self._pending.pop(slot)
            if slot + 1 < len(shard_order):
                self._open(slot + 1)  # the next shard loads while this one is consumed
        return self._current[1].row(offset)

    def _open(self, slot: int) -> Future[Rows]:
        if slot not in self._pending:
            shard_id = int(self._epoch_order()[0][slot])
            self._pending[slot] = self._prefetcher.submit(self._shuffled_shard, self.epoch, shard_id)
        return self._pending[slot]

    def _shuffled_shard(self, epoch: int, shard_id: int) -> Rows:
        if shard_id not in self._verified:
            verify_shard(self.shards[shard_id])
            self._verified.add(shard_id)
        rows = self.read(shard_id)
        return rows.ordered(np.random.default_rng([self.seed, epoch, shard_id]).permutation(len(rows.tokens)))

    def read(self, shard_id: int) -> Rows:
        """The samples of shard `shard_id`, in its order: their (samples, seq_len + 1) tokens;
        with `document_starts`, each token's document index (1 at every document start, summed
        along the sample); with loss masks, the samples' masks; and their numbers in the split."""
        shard = self.shards[shard_id]
        ids = self.first_ids[shard_id] + np.arange(shard.samples)
        if not self.document_starts and not self.loss_masks:
            return Rows(read_shard(shard), None, None, ids)
        samples = list(iter_shard(shard))
        if len(samples) != shard.samples:
            raise DataError(f"shard {shard.path} has {len(samples)} samples, manifest says {shard.samples}")
        tokens = np.stack([sample[SAMPLE_FIELD] for sample in samples])
        masks = np.stack([sample[MASK_FIELD] for sample in samples]) if self.loss_masks else None
        if not self.document_starts:
            return Rows(tokens, None, masks, ids)
        starts = [sample[STARTS_FIELD] for sample in samples]
        documents = np.zeros(tokens.shape, np.int32)
        rows = np.repeat(np.arange(len(starts)), [len(s) for s in starts])
        documents[rows, np.concatenate(starts).astype(np.int64)] = 1
        return Rows(tokens, np.cumsum(documents, axis=1, dtype=np.int32), masks, ids)

    def every_sample(self) -> Iterator[tuple[np.ndarray, torch.Tensor | DocumentBatch]]:
        """Every sample of the split once, in its order, as this rank's slices of global batches
        (the last one filled up with the split's first samples): (the numbers of this slice's
        samples, -1 for those filling up; the slice). What the reference log-probabilities are
        computed over."""
        rows = [row for shard_id in range(len(self.shards)) for row in self.read(shard_id).each()]
        size, mine = self.global_batch_size, slice(self.dp_rank * self.local_batch_size,
                                                   (self.dp_rank + 1) * self.local_batch_size)
        for start in range(0, len(rows), size):
            positions = list(range(start, start + size))[mine]
            batch = [rows[position % len(rows)] for position in positions]
            ids = [row.sample_id if position < len(rows) else -1 for row, position in zip(batch, positions,
                                                                                           strict=True)]
            yield np.array(ids), self.batch_of(batch)


VAL_SEED = 0  # the order validation batches are read in: the same for every run and layout


def num_validation_batches(manifest: dict, global_batch_size: int, val_batches: int) -> int:
    """Global batches one validation reads: `val_batches`, or as many whole ones as the
    validation split holds; checked before launch."""
    samples = manifest["splits"].get("val", {}).get("samples", 0)
    if samples < global_batch_size:
        raise DataError(
            f"train.val_every is set, but the data's validation split holds {samples} samples, fewer "
            f"than one global batch (train.global_batch_size={global_batch_size}); raise "
            "data.val_fraction and rerun the data stage, or set train.val_every=0"
        )
    return min(val_batches, samples // global_batch_size)


def validation_batches(shards: list[ShardInfo], num_batches: int, like: ShardedSampleLoader,
                       reference: np.ndarray | None = None) -> list[torch.Tensor | DocumentBatch]:
    """This rank's slices of the first `num_batches` global batches of the validation split,
    cut and shaped as the training loader `like` cuts its own, in the order of epoch 0 under
    VAL_SEED (with the split's `reference` log-probabilities, for preference pairs)."""
    loader = ShardedSampleLoader(shards, like.local_batch_size, like.dp_rank,
                                 like.global_batch_size // like.local_batch_size, VAL_SEED,
                                 like.document_starts, reference)
    return [loader.next_batch() for _ in range(num_batches)]


def token_byte_lengths(tokenizer_dir: Path) -> np.ndarray:
    """Per token id, the UTF-8 bytes of the text it stands for; 0 for special tokens (EOS
    marks a document boundary, no text). Exact for byte-level BPE -- the data stage's, and
    most Hugging Face tokenizers' -- whose every vocabulary character is one byte; for other
    tokenizers, each token decoded on its own."""
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    lengths = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), np.int64)
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    if isinstance(tokenizer.decoder, decoders.ByteLevel):
        for token, index in vocab.items():
            lengths[index] = len(token)
    else:
        ids = sorted(vocab.values())
        for index, text in zip(ids, tokenizer.decode_batch([[i] for i in ids]), strict=True):
            lengths[index] = len(text.encode())
    for index, added in tokenizer.get_added_tokens_decoder().items():
        lengths[index] = 0 if added.special else len(added.content.encode())
    return lengths
