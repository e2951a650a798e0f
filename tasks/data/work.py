"""The data build's parallel work, one partition or bucket at a time, in bounded memory.

Each function takes a small picklable work item and reads and writes files under the build's
work directory (inside the output's staging directory, so on the filesystem the output lands
on, which every worker sees). The executor (executor.py) runs them on Dask or a local pool. A
function reruns from scratch and writes the same bytes, so Dask recomputing the task of a lost
worker changes nothing. The phases, in build.py's order:

1. `clean_partition`: read a partition of the raw snapshot (a run of its gzip members), filter
   and clean each document, and write what the later phases need: the documents' dedup records
   hashed into buckets (exact key; one LSH band key per band of the MinHash signature), the
   signatures, a per-document summary, the validation documents in order, and each training
   document's copies (per its source's weight) under their mixing key, grouped into ranges of
   that key.
2. `exact_duplicates` / `near_duplicate_pairs`, per bucket across all partitions -- the shuffle:
   documents whose normalized text has the same key (all but the first in document order are
   exact duplicates); pairs sharing an LSH band, confirmed on the estimated Jaccard. Which
   near-duplicate pairs remove a document (the later one, if the earlier is kept) is decided
   in document order by build.py, exactly as one process offering the documents in order would.
3. `tokenize_piece`: a range of mixing keys (sorted: the training order) or a partition's
   validation documents, tokenized, each document followed by EOS -- or, for supervised
   fine-tuning, conversations rendered through the chat template (chat.py) with their loss
   masks, one longer than a row split at turn boundaries into pieces that fit (`render_pieces`);
   for preference tuning, each pair as its two conversations (`render_pair`), one after the
   other, the rejected one's mask 2 (shards.py), a pair longer than a row dropped (never cut).
4. `write_shard_group`: shards cut from the split's token stream -- the pieces in order -- with
   the sequences each source contributes to. Conversations are not cut: they are packed whole,
   several to a row, in stream order (`pack_rows`, decided by build.py over the whole split),
   the rest of a row padded and masked out; a pair's two conversations are packed as one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from forgeline.configs.schema import CleaningConfig
from forgeline.model.training.shards import CHOSEN, REJECTED, write_shard
from forgeline.tasks.data.chat import (
    ChatTemplateError,
    conversation_of,
    load_chat_tokenizer,
    pair_of,
    render_pair,
    render_pieces,
    trained_turns,
)
from forgeline.tasks.data.clean import Cleaned, clean_conversation, clean_document, clean_pair, lsh_bands
from forgeline.tasks.data.snapshot import Member, read_member

# Records of the shuffle: the bucket (which reducer), the key, the document.
KEYED = np.dtype([("bucket", "<u4"), ("key", "V32"), ("doc", "<i8")])
# Per document that passed the filters: what the manifest's counts need once dedup has decided.
SUMMARY = np.dtype([("doc", "<i8"), ("source", "<i2"), ("val", "?"), ("repaired", "?"),
                    ("boilerplate_lines", "<i8"), ("pii_replaced", "<i8")])
PIECE_DOCS = np.dtype([("length", "<i8"), ("source", "<i2")])  # per tokenized document
# Per rendered conversation (or piece of one, split at turn boundaries) of a token piece: beside
# its length and source, what the manifest counts. `first`: its conversation's first piece.
# Dropped conversations named per source, for the error of a source that loses too many.
EXAMPLES = 3
PIECE_CONVERSATIONS = np.dtype([("length", "<i8"), ("source", "<i2"), ("first", "?"),
                                ("loss_tokens", "<i8")])
# Per rendered conversation of a preference pair (its chosen one, then its rejected one): its
# length, source, which reply it holds (CHOSEN or REJECTED) and that reply's loss tokens.
PIECE_PAIRS = np.dtype([("length", "<i8"), ("source", "<i2"), ("reply", "u1"), ("loss_tokens", "<i8")])


@dataclass(frozen=True)
class Plan:
    """What every piece of work needs to know about the build."""

    work_dir: str
    raw_dir: str
    cleaning: CleaningConfig
    labels: tuple[str, ...]  # the sources, in order: documents carry their index
    weights: tuple[float, ...]
    val_fraction: float
    buckets: int  # reducers of the dedup shuffle
    partition_firsts: tuple[int, ...]  # the first document of each partition
    conversations: bool = False  # the documents are conversations (supervised fine-tuning)
    pairs: bool = False  # the documents are preference pairs (preference tuning)

    @property
    def counted(self) -> str:
        """What the manifest counts a source's kept documents as, per split."""
        return "pairs" if self.pairs else "documents"

    @property
    def ranges(self) -> int:
        """Ranges of the mixing key, the pieces of the training order: one per partition, so a
        range holds about a partition's training text."""
        return len(self.partition_firsts)

    def partition_dir(self, number: int) -> Path:
        return Path(self.work_dir) / f"partition-{number:06d}"

    def partition_of(self, docs: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.asarray(self.partition_firsts), docs, side="right") - 1


@dataclass(frozen=True)
class PartitionWork:
    number: int
    members: tuple[Member, ...]
    plan: Plan

    def describe(self) -> str:
        first, last = self.members[0].first, self.members[-1].first + self.members[-1].documents - 1
        labels = sorted({member.label for member in self.members})
        return f"partition {self.number} (documents {first}..{last} of source(s) {', '.join(labels)})"


@dataclass(frozen=True)
class BucketWork:
    number: int
    partitions: int
    plan: Plan

    def describe(self) -> str:
        return f"dedup bucket {self.number} (over all {self.partitions} partitions)"


@dataclass(frozen=True)
class ChatWork:
    """How conversations are rendered: the Hugging Face tokenizer directory holding the chat
    template, the tokens of a row, which a longer conversation is split to fit, and the
    assistant turns trained (sft.train_on); or whether they are preference pairs."""

    tokenizer: str
    row_tokens: int
    train_on: str = "all_assistant"
    pairs: bool = False


@dataclass(frozen=True)
class PieceWork:
    number: int
    split: str  # train: a range of mixing keys over all partitions; val: one partition's documents
    partitions: int
    tokenizer: str
    eos_id: int
    dtype: str
    plan: Plan
    chat: ChatWork | None = None  # conversations: rendered through the template, not joined by EOS

    def describe(self) -> str:
        what = f"mixing-key range {self.number}" if self.split == "train" else f"partition {self.number}"
        return f"{self.split} piece {self.number} ({what})"

    @property
    def stem(self) -> Path:
        return Path(self.plan.work_dir) / "tokens" / f"{self.split}-{self.number:06d}"


@dataclass(frozen=True)
class ShardWork:
    number: int
    split: str
    shards: tuple[tuple[int, int, int], ...]  # (shard number, first sample, end sample)
    pieces: tuple[str, ...]  # the token pieces of the split, in stream order
    seq_len: int
    out_dir: str
    packing: str | None = None  # conversations: the stem of the split's packing (`write_packing`)
    pad_id: int = 0  # conversations: what fills a row after its last one

    def describe(self) -> str:
        return f"{self.split} shards {self.shards[0][0]}..{self.shards[-1][0]}"


@dataclass(frozen=True)
class CleanSummary:
    """Counts a partition's filters produced, per source index."""

    input_documents: dict[int, int]
    input_bytes: dict[int, int]
    removed: dict[int, dict[str, int]]
    examples: dict[int, list[str]]  # of what was removed: "name: reason", the first EXAMPLES


# -- 1. cleaning ---------------------------------------------------------------------------------


def clean_partition(work: PartitionWork) -> CleanSummary:
    plan, cfg = work.plan, work.plan.cleaning
    out = plan.partition_dir(work.number)
    out.mkdir(parents=True, exist_ok=True)
    code = {label: index for index, label in enumerate(plan.labels)}
    summary = CleanSummary({}, {}, {}, {})
    kept: list[tuple[int, int, Cleaned, str]] = []
    clean = clean_pair if plan.pairs else clean_conversation if plan.conversations else clean_document
    for member in work.members:
        for offset, raw in enumerate(read_member(Path(plan.raw_dir), member)):
            source = code[raw.source]
            summary.input_documents[source] = summary.input_documents.get(source, 0) + 1
            summary.input_bytes[source] = summary.input_bytes.get(source, 0) + raw.size
            cleaned = clean(raw.data, cfg, with_signature=bool(cfg.near_dedup_threshold))
            if cleaned.removed_by is not None:
                counts = summary.removed.setdefault(source, {})
                counts[cleaned.removed_by] = counts.get(cleaned.removed_by, 0) + 1
                add_example(summary.examples, source, f"{raw.name}: {cleaned.removed_by}")
                continue
            kept.append((member.first + offset, source, cleaned, raw.name))
    val = [is_val(c.sha256, plan.val_fraction) for _, _, c, _ in kept]
    write_array(out / "summary.npy", np.array(
        [(doc, source, in_val, c.repaired, c.boilerplate_lines, c.pii_replaced)
         for (doc, source, c, _), in_val in zip(kept, val, strict=True)], dtype=SUMMARY))
    write_array(out / "exact.npy", keyed([(bytes.fromhex(c.dedup_key), doc) for doc, _, c, _ in kept],
                                         plan.buckets))
    if cfg.near_dedup_threshold:
        bands = lsh_bands(cfg)
        band_records = [(band_key(c.signature, band, span), doc) for doc, _, c, _ in kept
                        for band, span in enumerate(bands)]
        write_array(out / "bands.npy", keyed(band_records, plan.buckets))
        write_array(out / "signatures.npy", np.array([c.signature for _, _, c, _ in kept], dtype=np.uint64)
                    .reshape(len(kept), cfg.minhash_perms))
    write_pickle(out / "val.pkl", [(doc, source, name, c.text) for (doc, source, c, name), in_val
                                   in zip(kept, val, strict=True) if in_val])
    copies = sorted((mixing_key(c.sha256, copy), doc, source, c.sha256, c.text)
                    for (doc, source, c, _), in_val in zip(kept, val, strict=True) if not in_val
                    for copy in range(copies_of(c.sha256, plan.weights[source])))
    write_ranges(out / "train", copies, plan.ranges)
    return summary


def add_example(examples: dict[int, list[str]], source: int, example: str) -> None:
    mine = examples.setdefault(source, [])
    if len(mine) < EXAMPLES:
        mine.append(example)


def is_val(sha256: str, val_fraction: float) -> bool:
    """The split of a document, by a hash of its text."""
    return int(sha256[:16], 16) / 2**64 < val_fraction


def unit_hash(key: str) -> float:
    """A uniform number in [0, 1) from a string: deterministic decisions per document."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def copies_of(sha256: str, weight: float) -> int:
    """How often a training document appears: its source's weight, the fraction for a hash-chosen
    share of its documents."""
    return int(weight) + (unit_hash(f"mix:{sha256}") < weight - int(weight))


def mixing_key(sha256: str, copy: int) -> bytes:
    """The training order: copies sorted by this hash, which interleaves the sources."""
    return hashlib.sha256(f"{sha256}:{copy}".encode()).digest()


def key_range(key: bytes, ranges: int) -> int:
    """The range of a uniformly distributed key: ranges in key order partition the sorted keys."""
    return int.from_bytes(key[:8], "big") * ranges >> 64


def band_key(signature: np.ndarray, band: int, span: tuple[int, int]) -> bytes:
    """A band of a MinHash signature (its index and values), hashed: equal keys, equal bands."""
    return hashlib.blake2b(band.to_bytes(4, "little") + signature[span[0]:span[1]].tobytes(),
                           digest_size=32).digest()


def keyed(records: list[tuple[bytes, int]], buckets: int) -> np.ndarray:
    """Shuffle records, sorted by bucket (a bucket's records are one slice)."""
    array = np.array([(int.from_bytes(key[8:16], "little") % buckets, key, doc) for key, doc in records],
                     dtype=KEYED)
    return array[np.argsort(array["bucket"], kind="stable")]


def bucket_slice(path: Path, bucket: int) -> np.ndarray:
    array = np.load(path, mmap_mode="r")
    lo, hi = np.searchsorted(array["bucket"], [bucket, bucket + 1])
    return np.array(array[lo:hi])


def write_ranges(stem: Path, records: list[tuple], ranges: int) -> None:
    """Records sorted by key, as one pickle per key range in one file, with their offsets."""
    starts = np.searchsorted([key_range(record[0], ranges) for record in records], np.arange(ranges + 1))
    chunks = [pickle.dumps(records[a:b], protocol=pickle.HIGHEST_PROTOCOL)
              for a, b in zip(starts[:-1], starts[1:], strict=True)]
    write_bytes(stem.with_suffix(".bin"), b"".join(chunks))
    write_array(stem.with_suffix(".offsets.npy"), np.concatenate([[0], np.cumsum([len(c) for c in chunks])]))


def read_range(stem: Path, number: int) -> list[tuple]:
    offsets = np.load(stem.with_suffix(".offsets.npy"))
    with open(stem.with_suffix(".bin"), "rb") as f:
        f.seek(int(offsets[number]))
        return pickle.loads(f.read(int(offsets[number + 1] - offsets[number])))


# -- 2. dedup across partitions ------------------------------------------------------------------


def exact_duplicates(work: BucketWork) -> np.ndarray:
    """The documents of this bucket whose key an earlier document has."""
    records = np.concatenate([bucket_slice(work.plan.partition_dir(p) / "exact.npy", work.number)
                              for p in range(work.partitions)])
    records = records[np.lexsort((records["doc"], records["key"]))]
    repeat = np.zeros(len(records), bool)
    repeat[1:] = records["key"][1:] == records["key"][:-1]
    return np.sort(records["doc"][repeat])


def near_duplicate_pairs(work: BucketWork) -> np.ndarray:
    """Pairs (earlier, later) of documents that share a band in this bucket and whose estimated
    Jaccard similarity reaches the threshold; exact duplicates take no part."""
    plan = work.plan
    exact = np.load(Path(plan.work_dir) / "exact-duplicates.npy")
    records = np.concatenate([bucket_slice(plan.partition_dir(p) / "bands.npy", work.number)
                              for p in range(work.partitions)])
    records = records[~np.isin(records["doc"], exact)]
    records = records[np.lexsort((records["doc"], records["key"]))]
    # Most keys are one document's: only the groups of two or more are split off.
    shared = np.zeros(len(records), bool)
    shared[1:] = records["key"][1:] == records["key"][:-1]
    shared[:-1] |= shared[1:]
    records = records[shared]
    pairs = []
    boundaries = np.flatnonzero(records["key"][1:] != records["key"][:-1]) + 1
    for group in np.split(records["doc"], boundaries) if len(records) else []:
        first, second = np.triu_indices(len(group), k=1)
        pairs.append(np.stack([group[first], group[second]], axis=1))
    if not pairs:
        return np.zeros((0, 2), np.int64)
    pairs = np.unique(np.concatenate(pairs), axis=0)
    left, right = signatures_of(plan, pairs[:, 0]), signatures_of(plan, pairs[:, 1])
    # As datasketch's estimate: the share of equal hash values.
    similar = (left == right).sum(axis=1) / left.shape[1] >= plan.cleaning.near_dedup_threshold
    return pairs[similar]


def signatures_of(plan: Plan, docs: np.ndarray) -> np.ndarray:
    signatures = np.zeros((len(docs), plan.cleaning.minhash_perms), np.uint64)
    owner = plan.partition_of(docs)
    for partition in np.unique(owner):
        directory = plan.partition_dir(int(partition))
        rows = np.searchsorted(np.load(directory / "summary.npy")["doc"], docs[owner == partition])
        signatures[owner == partition] = np.load(directory / "signatures.npy", mmap_mode="r")[rows]
    return signatures


# -- 3. tokenizing -------------------------------------------------------------------------------


def training_range(plan: Plan, number: int, partitions: int) -> list[tuple]:
    """The training copies whose mixing key falls in range `number`, in training order, without
    the removed documents."""
    removed = np.load(Path(plan.work_dir) / "removed.npy")
    records = [record for partition in range(partitions)
               for record in read_range(plan.partition_dir(partition) / "train", number)]
    docs = np.array([record[1] for record in records], np.int64)
    keep = ~np.isin(docs, removed)
    return sorted((record for record, kept in zip(records, keep, strict=True) if kept),
                  key=lambda record: (record[0], record[1]))


def validation_documents(plan: Plan, partition: int) -> list[tuple]:
    removed = np.load(Path(plan.work_dir) / "removed.npy")
    records = read_pickle(plan.partition_dir(partition) / "val.pkl")
    keep = ~np.isin(np.array([record[0] for record in records], np.int64), removed)
    return [record for record, kept in zip(records, keep, strict=True) if kept]


def tokenize_piece(work: PieceWork) -> dict[int, list[int]]:
    """Token ids of the piece's documents in order, each followed by EOS, and per document its
    length and source; returns per source index [documents, tokens (EOS included)]."""
    plan = work.plan
    if work.split == "train":
        records = training_range(plan, work.number, work.partitions)
        texts_sources = [(text, source) for _, _, source, _, text in records]
    else:
        records = validation_documents(plan, work.number)
        texts_sources = [(text, source) for _, source, _, text in records]
        if work.chat is None:
            write_bytes(work.stem.with_suffix(".jsonl"), "".join(
                json.dumps({"source": plan.labels[source], "name": name, "text": text}) + "\n"
                for _, source, name, text in records).encode())
    if work.chat is not None:
        names = ([f"{plan.labels[source]} document {doc}" for _, doc, source, _, _ in records]
                 if work.split == "train" else [name for _, _, name, _ in records])
        return (render_pair_piece if work.chat.pairs else render_piece)(work, texts_sources, names)
    tokenizer = load_tokenizer(work.tokenizer)
    # The _fast variant skips character offsets, which packing does not need.
    encodings = tokenizer.encode_batch_fast([text for text, _ in texts_sources], add_special_tokens=False)
    docs = np.array([(len(e.ids), source) for e, (_, source) in zip(encodings, texts_sources, strict=True)],
                    dtype=PIECE_DOCS)
    ids = np.full(int(docs["length"].sum()) + len(docs), work.eos_id, dtype=work.dtype)
    position = 0
    for encoding, length in zip(encodings, docs["length"], strict=True):
        ids[position:position + length] = encoding.ids
        position += length + 1  # the EOS after it is already there
    write_array(Path(f"{work.stem}.ids.npy"), ids)
    write_array(Path(f"{work.stem}.docs.npy"), docs)
    counts: dict[int, list[int]] = {}
    for source in np.unique(docs["source"]):
        mine = docs["length"][docs["source"] == source]
        counts[int(source)] = [len(mine), int(mine.sum()) + len(mine)]
    return counts


def render_piece(work: PieceWork, texts_sources: list[tuple[str, int]], names: list[str],
                 ) -> dict[int, list]:
    """The piece's conversations rendered through the chat template, one longer than a row split at
    turn boundaries into pieces that fit: their token ids and loss masks one after the other, and
    per conversation piece its length, source, whether it is its conversation's first and its loss
    tokens; the validation split's pieces also as text (val_docs.jsonl). A conversation the
    template rejects is dropped (template_rejects; tool_calls_not_rendered where it writes no
    tool call of a turn that makes one), one of which no exchange fits in a row
    (too_long), and one whose messages' `"train": false` leave no reply trained (no_trained_turn),
    not the stage. Returns per source index [conversations, tokens, conversations
    split, loss tokens, dropped conversations by reason, exchanges dropped, examples of drops]."""
    plan, tokenizer = work.plan, load_chat_tokenizer(work.chat.tokenizer)
    rendered, dropped, dropped_turns, several, examples = [], {}, {}, {}, {}
    for (text, source), name in zip(texts_sources, names, strict=True):
        messages = conversation_of(text)
        try:
            split = render_pieces(tokenizer, messages, work.chat.row_tokens, train_on=work.chat.train_on)
        except ChatTemplateError as err:
            reason, why = err.reason, str(err)
        else:
            reason, why = ((None, "") if split.rendered
                           else ("too_long", "no exchange fits in a row")
                           if trained_turns(messages, work.chat.train_on)
                           else ("no_trained_turn", 'every assistant turn says "train": false'))
        if reason is not None:
            count_drop(dropped, examples, source, f"{name}: {reason} ({why})", reason)
            continue
        dropped_turns[source] = dropped_turns.get(source, 0) + split.dropped_turns
        several[source] = several.get(source, 0) + (len(split.rendered) > 1)
        for number, (messages, chat) in enumerate(split.rendered):
            part = f" (part {number + 1} of {len(split.rendered)})" if len(split.rendered) > 1 else ""
            rendered.append((source, name + part, messages, chat, number == 0))
    if work.split == "val":
        write_bytes(work.stem.with_suffix(".jsonl"), "".join(
            json.dumps({"source": plan.labels[source], "name": name, "text": chat.text,
                        "messages": messages}) + "\n"
            for source, name, messages, chat, _ in rendered).encode())
    docs = np.array([(len(chat.ids), source, first, int(chat.mask.sum()))
                     for source, _, _, chat, first in rendered], dtype=PIECE_CONVERSATIONS)
    write_array(Path(f"{work.stem}.ids.npy"), np.concatenate(
        [chat.ids for _, _, _, chat, _ in rendered] or [np.zeros(0, np.int64)]).astype(work.dtype))
    write_array(Path(f"{work.stem}.mask.npy"), np.concatenate(
        [chat.mask for _, _, _, chat, _ in rendered] or [np.zeros(0, np.uint8)]))
    write_array(Path(f"{work.stem}.docs.npy"), docs)
    counts: dict[int, list] = {}
    for source in sorted({*np.unique(docs["source"]).tolist(), *dropped}):
        mine = docs[docs["source"] == source]
        counts[int(source)] = [int(mine["first"].sum()), int(mine["length"].sum()), several.get(source, 0),
                               int(mine["loss_tokens"].sum()), dropped.get(source, {}),
                               dropped_turns.get(source, 0), examples.get(source, [])]
    return counts


def render_pair_piece(work: PieceWork, texts_sources: list[tuple[str, int]], names: list[str],
                      ) -> dict[int, list]:
    """The piece's preference pairs rendered through the chat template (chat.py `render_pair`):
    per pair its chosen conversation then its rejected one, their token ids one after the other,
    their masks with the rejected one's trained tokens REJECTED (2) and the chosen one's CHOSEN
    (1), and per conversation its length, source, reply and loss tokens; the validation split's
    pairs also as text (val_docs.jsonl: `text` the chosen conversation, `rejected_text` the
    other). A pair that the template does not render as trained is dropped by the reason chat.py
    gives (template_rejects, tool_calls_not_rendered, prompt_not_shared), one whose two
    conversations together do not fit in a row as too_long -- never cut. Returns per source index
    [pairs, tokens, chosen loss tokens, rejected loss tokens, dropped pairs by reason, examples of
    drops]."""
    plan, tokenizer = work.plan, load_chat_tokenizer(work.chat.tokenizer)
    rendered, dropped, examples = [], {}, {}
    for (text, source), name in zip(texts_sources, names, strict=True):
        pair = pair_of(text)
        try:
            both = render_pair(tokenizer, pair)
        except ChatTemplateError as err:
            count_drop(dropped, examples, source, f"{name}: {err.reason} ({err})", err.reason)
            continue
        if (length := len(both.chosen.ids) + len(both.rejected.ids)) > work.chat.row_tokens:
            count_drop(dropped, examples, source, f"{name}: too_long ({length} tokens for the two "
                       f"conversations, a row holds {work.chat.row_tokens})", "too_long")
            continue
        rendered.append((source, name, pair, both))
    if work.split == "val":
        write_bytes(work.stem.with_suffix(".jsonl"), "".join(
            json.dumps({"source": plan.labels[source], "name": name, "text": both.chosen.text,
                        "rejected_text": both.rejected.text, **pair}) + "\n"
            for source, name, pair, both in rendered).encode())
    sequences = [(source, reply, chat) for source, _, _, both in rendered
                 for reply, chat in ((CHOSEN, both.chosen), (REJECTED, both.rejected))]
    docs = np.array([(len(chat.ids), source, reply, int(chat.mask.sum()))
                     for source, reply, chat in sequences], dtype=PIECE_PAIRS)
    write_array(Path(f"{work.stem}.ids.npy"), np.concatenate(
        [chat.ids for _, _, chat in sequences] or [np.zeros(0, np.int64)]).astype(work.dtype))
    write_array(Path(f"{work.stem}.mask.npy"), np.concatenate(
        [chat.mask * np.uint8(reply) for _, reply, chat in sequences] or [np.zeros(0, np.uint8)]))
    write_array(Path(f"{work.stem}.docs.npy"), docs)
    counts: dict[int, list] = {}
    for source in sorted({*np.unique(docs["source"]).tolist(), *dropped}):
        mine = docs[docs["source"] == source]
        chosen, rejected = mine[mine["reply"] == CHOSEN], mine[mine["reply"] == REJECTED]
        counts[int(source)] = [len(chosen), int(mine["length"].sum()), int(chosen["loss_tokens"].sum()),
                               int(rejected["loss_tokens"].sum()), dropped.get(source, {}),
                               examples.get(source, [])]
    return counts


def count_drop(dropped: dict[int, dict[str, int]], examples: dict[int, list[str]], source: int, example: str,
               reason: str) -> None:
    """A record of `source` dropped by `reason` counted, and kept as an example while there are few."""
    counts = dropped.setdefault(source, {})
    counts[reason] = counts.get(reason, 0) + 1
    add_example(examples, source, example)


@functools.lru_cache(maxsize=1)
def load_tokenizer(path: str) -> Tokenizer:
    """One tokenizer per worker process and build. A tokenizer loaded afresh for every piece and
    dropped after a large batch left ~5 MB behind each time (tokenizers 0.23): a worker grew by
    250 MB over the pieces of a 4x corpus-docs build."""
    return Tokenizer.from_file(path)


def piece_tokens(stem: str) -> int:
    return len(np.load(f"{stem}.ids.npy", mmap_mode="r"))


# -- 4. shards -----------------------------------------------------------------------------------


def write_shard_group(work: ShardWork) -> tuple[list[dict], dict[int, int]]:
    """The group's shards, and per source index the number of its samples holding its tokens."""
    if work.packing is not None:
        return write_conversation_shard_group(work)
    stream = TokenStream(work.pieces)
    entries, sequences = [], {}
    seq_len = work.seq_len
    for number, first, end in work.shards:
        lo, hi = first * seq_len, end * seq_len + 1
        tokens = stream.tokens(lo, hi)
        starts, ends, sources = stream.documents(lo, hi)
        offsets = seq_len * np.arange(first, end)
        index = np.arange(seq_len + 1)[None, :] + (offsets - lo)[:, None]
        # The documents beginning in each sample, relative to it (starts are in stream order).
        begin, stop = np.searchsorted(starts, offsets), np.searchsorted(starts, offsets + seq_len + 1)
        sample_starts = [(starts[a:b] - offset).astype(np.int32)
                         for offset, a, b in zip(offsets, begin, stop, strict=True)]
        entries.append(write_shard(Path(work.out_dir), work.split, number, tokens[index], sample_starts,
                                   first))
        for source, count in sequences_per_source(starts, ends, sources, seq_len, first, end).items():
            sequences[source] = sequences.get(source, 0) + count
    return entries, sequences


def pack_rows(lengths: np.ndarray, row_tokens: int) -> np.ndarray:
    """Conversations of these token lengths (each at most `row_tokens`), in order, packed into
    rows of `row_tokens`: a row takes the next one while it fits. Returns the first conversation
    of each row, and their number at the end."""
    firsts, used = [0], 0
    for number, length in enumerate(lengths.tolist()):
        if used + length > row_tokens:
            firsts.append(number)
            used = 0
        used += length
    return np.array(firsts + [len(lengths)], np.int64)


def write_packing(stem: Path, pieces: tuple[str, ...], row_tokens: int, per_unit: int = 1) -> int:
    """Packs a split's conversations (its pieces in order) into rows, written beside `stem`: the
    conversations' stream offsets and sources, each row's first conversation. Each `per_unit`
    consecutive conversations are packed as one (2: a preference pair's, which share a row).
    Returns the rows."""
    docs = np.concatenate([np.load(f"{piece}.docs.npy") for piece in pieces])
    write_array(stem.with_suffix(".offsets.npy"), np.concatenate([[0], np.cumsum(docs["length"])]))
    write_array(stem.with_suffix(".sources.npy"), docs["source"])
    rows = pack_rows(docs["length"].reshape(-1, per_unit).sum(axis=1), row_tokens) * per_unit
    write_array(stem.with_suffix(".rows.npy"), rows)
    return len(rows) - 1


def write_conversation_shard_group(work: ShardWork) -> tuple[list[dict], dict[int, int]]:
    """Shards of packed conversations (`write_packing`): per row its tokens, padded to seq_len + 1,
    the conversation starts, and the loss mask -- 0 on the padding, and on each conversation's
    first token, which nothing in its own conversation predicts."""
    stem = Path(work.packing)
    offsets, sources = np.load(stem.with_suffix(".offsets.npy")), np.load(stem.with_suffix(".sources.npy"))
    rows = np.load(stem.with_suffix(".rows.npy"))
    tokens, masks = TokenStream(work.pieces), TokenStream(work.pieces, "mask")
    row_tokens = work.seq_len + 1
    entries, sequences = [], {}
    for number, first, end in work.shards:
        lo, hi = int(offsets[rows[first]]), int(offsets[rows[end]])
        shard_tokens, shard_masks = tokens.tokens(lo, hi), masks.tokens(lo, hi)
        samples, starts, loss_masks = [], [], []
        for row in range(first, end):
            a, b = rows[row], rows[row + 1]
            begin, stop = int(offsets[a]) - lo, int(offsets[b]) - lo
            sample = np.full(row_tokens, work.pad_id, dtype=shard_tokens.dtype)
            sample[:stop - begin] = shard_tokens[begin:stop]
            mask = np.zeros(row_tokens, np.uint8)
            mask[:stop - begin] = shard_masks[begin:stop]
            row_starts = (offsets[a:b] - offsets[a]).astype(np.int32)
            mask[row_starts] = 0
            samples.append(sample)
            starts.append(row_starts)
            loss_masks.append(mask)
            for source in np.unique(sources[a:b]).tolist():
                sequences[source] = sequences.get(source, 0) + 1
        entries.append(write_shard(Path(work.out_dir), work.split, number, samples, starts, first,
                                   loss_masks))
    return entries, sequences


class TokenStream:
    """The concatenated token pieces of a split (or another per-token array of theirs, such as
    the loss masks), read by position without loading them."""

    def __init__(self, pieces: tuple[str, ...], field: str = "ids"):
        self.pieces, self.field = pieces, field
        sizes = [piece_tokens(stem) for stem in pieces]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def overlapping(self, lo: int, hi: int) -> range:
        first = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        last = int(np.searchsorted(self.offsets, hi, side="left"))
        return range(max(first, 0), min(last, len(self.pieces)))

    def tokens(self, lo: int, hi: int) -> np.ndarray:
        parts = []
        for k in self.overlapping(lo, hi):
            ids = np.load(f"{self.pieces[k]}.{self.field}.npy", mmap_mode="r")
            base = self.offsets[k]
            parts.append(np.array(ids[max(lo - base, 0):min(hi - base, len(ids))]))
        return np.concatenate(parts)

    def documents(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Start and end stream positions (EOS included) and source of the documents that
        overlap [lo, hi)."""
        starts, ends, sources = [], [], []
        for k in self.overlapping(lo, hi):
            docs = np.load(f"{self.pieces[k]}.docs.npy")
            end = self.offsets[k] + np.cumsum(docs["length"] + 1)
            start = end - docs["length"] - 1
            mine = (start < hi) & (end > lo)
            starts.append(start[mine])
            ends.append(end[mine])
            sources.append(docs["source"][mine])
        return np.concatenate(starts), np.concatenate(ends), np.concatenate(sources)


def sequences_per_source(starts: np.ndarray, ends: np.ndarray, sources: np.ndarray, seq_len: int,
                         first: int, end: int) -> dict[int, int]:
    """Per source, how many of samples first..end-1 hold at least one of its tokens. A document
    spans stream positions [b, e); sample j holds positions [j*seq_len, j*seq_len + seq_len],
    so it overlaps the document for ceil(b/seq_len) - 1 <= j <= (e-1)//seq_len. Samples mix
    sources: the counts of all sources add up to at least the number of samples."""
    lo = np.maximum(-(-starts // seq_len) - 1, first)
    hi = np.minimum((ends - 1) // seq_len, end - 1)  # < lo: the document is outside these samples
    counts = {}
    for source in np.unique(sources):
        mine = (sources == source) & (lo <= hi)
        coverage = np.zeros(end - first + 1, np.int64)  # +1 where a document's samples begin, -1 after
        np.add.at(coverage, lo[mine] - first, 1)
        np.add.at(coverage, hi[mine] + 1 - first, -1)
        counts[int(source)] = int((np.cumsum(coverage[:-1]) > 0).sum())
    return counts


# -- files ---------------------------------------------------------------------------------------


def write_array(path: Path, array: np.ndarray) -> None:
    """Whole or not at all: a rerun of the task (its worker lost) replaces it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_pickle(path: Path, value: object) -> None:
    write_bytes(path, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def read_pickle(path: Path) -> object:
    return pickle.loads(path.read_bytes())
