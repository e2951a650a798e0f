"""Data stage: sources -> raw snapshot -> cleaning and dedup -> mixing -> byte-level BPE
tokenizer -> packed sequences -> webdataset shards.

Two steps: the snapshot of the raw inputs as read (snapshot.py, `data.raw_dir`), then the build
from that snapshot (this module; cleaning in clean.py, the partition work in work.py, the shard
format in model/training/shards.py). `forgeline stage data` runs both; `--snapshot-only` and
`--from-snapshot` run one each (dvc.yaml's `sources` and `data` stages).

The build streams: it reads the snapshot by partitions of `data.partition_mb`, and every phase
(work.py) holds a partition, a dedup bucket, a range of the training order or a group of shards
at a time, with files in a work directory between the phases -- memory does not grow with the
corpus. What runs the pieces is `data.executor` (executor.py): Prefect tasks on a Dask cluster,
local or remote, or a local pool. Deduplication is a shuffle across partitions (work.py); the
decisions only need document numbers, and are taken here in document order.

Output (`data.out_dir`): `tokenizer/` (loads with transformers.PreTrainedTokenizerFast),
`train-NNNNNN.tar` and `val-NNNNNN.tar` shards, `val_docs.jsonl` (held-out documents for
evaluation), `manifest.json` (sha256 per shard, tokenizer and config hashes, counts per split,
and per source its provenance, what each filter removed and, per split, its documents, tokens
and `sequences`: the packed samples holding at least one of its tokens -- samples mix sources,
so these add up to more than the split's samples) and `build.json` (a hash of the config, the
snapshot's files and the stage's code, and the sha256 of every file written).

With `sft` set the documents are conversations (chat.py): cleaned and deduplicated as such,
rendered through the chat template of the run's tokenizer (`data.chat_template`, else its own)
into token ids and loss masks (of the assistant turns `sft.train_on` names), packed whole,
several to a row, in training order (one longer than a row is split at turn boundaries into
pieces that fit, each with the system turn), the row padded with EOS; the shards carry the
masks, the manifest says so (`loss_masks`, `train_on`) and names the template by its sha256,
and the tokenizer is saved with the template.

With `preference` set the documents are preference pairs (chat.py `pair_text`), cleaned and
deduplicated as a whole, each rendered as two conversations (prompt + chosen, prompt + rejected)
through the template, and packed whole as one, several pairs to a row; the masks tell the
replies apart (shards.py: 1 chosen, 2 rejected). A pair that does not fit in a row is dropped
(too_long), never cut. The manifest says `preference: true` and counts per split its `pairs` and
their `loss_tokens` (and of each reply: `chosen_loss_tokens`, `rejected_loss_tokens`), per
source its pairs kept and dropped by reason; both splits must hold pairs.

The output is built in a temporary directory and swapped in whole, so a failed run never leaves a
half-written shard under its final name. The same inputs, config and code give byte-identical
output -- whatever the executor, the number of workers and `data.partition_mb` -- and a rerun on
them rewrites nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from forgeline.configs import Config
from forgeline.configs.schema import ConfigError, DataConfig, SourceConfig
from forgeline.model.fileio import sha256_file
from forgeline.model.training.shards import FORMAT_VERSION, LOSS_MASKS, MANIFEST_NAME, PREFERENCE
from forgeline.tasks.atomic import remove_stale_staging, replace_dir, staging_dir
from forgeline.tasks.data import work as w
from forgeline.tasks.data.chat import load_chat_tokenizer, resolve_template, template_sha256
from forgeline.tasks.data.clean import lsh_bands
from forgeline.tasks.data.executor import Executor, check_workers_code, close_local_clusters, executor_for
from forgeline.tasks.data.snapshot import (
    SOURCES_NAME,
    Member,
    check_snapshot,
    read_index,
    snapshot_members,
    take_snapshot,
)
from forgeline.tasks.data.sources import preflight_sources
from forgeline.tasks.pretrained import resolve_base, tokenizer_files
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import DATA_VERSION_TAG, DATASET_NAME, RAW_VERSION_TAG, RunTracker, dvc_hash

log = logging.getLogger(__name__)

BUILD_NAME = "build.json"  # the build fingerprint of the output
SHARD_GROUPS_PER_WORKER = 4  # shard-writing tasks per worker: enough to even out the last ones
RECORDS_PER_BUCKET = 2_000_000  # dedup records per reducer: about 90 MB of them, and their sort


@dataclass(frozen=True)
class DataResult:
    out_dir: str
    manifest_sha256: str
    documents: int
    train_tokens: int
    train_samples: int
    val_samples: int
    reused: bool  # the output was already up to date: nothing was rewritten


def build_dataset(cfg: Config, from_snapshot: bool = False) -> DataResult:
    """The data stage for `cfg.data` without tracking: the snapshot of the raw inputs (with
    `from_snapshot`, the one already in data.raw_dir is used), then the build from it. Returns
    what it wrote (or found up to date)."""
    if from_snapshot:
        check_snapshot(cfg)
    else:
        preflight_sources(cfg)
    preflight_tokenizer(cfg)
    if not from_snapshot:
        take_snapshot(cfg)
    return build_from_snapshot(cfg)


def build_stage(cfg: Config, run: RunTracker, parent: RunTracker | None) -> DataResult:
    """The data stage's function (tasks/stage.py): the build; the snapshot is taken before, on
    every run, cache or not. A local Dask cluster goes with the stage: its idle workers would
    share the cores with the next stage's training ranks."""
    try:
        return build_from_snapshot(cfg)
    finally:
        close_local_clusters()


def record_data(cfg: Config, run: RunTracker, parent: RunTracker | None, result: DataResult) -> None:
    """Counts, the data version (DVC md5) and the raw snapshot it was built from, the manifest,
    sources and tokenizer; the pipeline's parent run gets the lineage and counts too."""
    metrics = {"documents": result.documents, "train_tokens": result.train_tokens,
               "train_samples": result.train_samples, "val_samples": result.val_samples}
    lineage = {DATA_VERSION_TAG: dvc_hash(result.out_dir),
               "forgeline.data.manifest_sha256": result.manifest_sha256}
    run.log_metrics(metrics)
    run.set_tags({**lineage, RAW_VERSION_TAG: dvc_hash(cfg.data.raw_dir)})
    run.log_dataset(DATASET_NAME, result.out_dir, lineage[DATA_VERSION_TAG], "output")
    run.log_artifact(Path(result.out_dir) / MANIFEST_NAME, "data")
    run.log_artifact(Path(cfg.data.raw_dir) / SOURCES_NAME, "data")
    run.log_artifact(Path(result.out_dir) / "tokenizer", "data/tokenizer")
    if parent:
        parent.set_tags(lineage)
        parent.log_dataset(DATASET_NAME, result.out_dir, lineage[DATA_VERSION_TAG], "training")
        parent.log_metrics({f"data/{k}": v for k, v in metrics.items()})


def build_from_snapshot(cfg: Config) -> DataResult:
    """The build step: the snapshot in data.raw_dir (each member checked against its sha256) to
    the shards, tokenizer and manifest in data.out_dir, unless that output is up to date."""
    dcfg = cfg.data
    started = time.perf_counter()
    out_dir = Path(dcfg.out_dir)
    remove_stale_staging(out_dir)  # also when nothing is rebuilt
    build_key = build_fingerprint(cfg, read_index(dcfg))
    if (manifest := up_to_date_manifest(out_dir, build_key)) is not None:
        log.info("data: %s is up to date (build %s); nothing rewritten", out_dir, build_key[:12])
        return data_result(out_dir, manifest, reused=True)
    members = snapshot_members(dcfg)
    if not members:
        raise ValueError(f"data.sources hold no document (sources {[s.label for s in dcfg.sources]}); "
                         "check their paths and text fields")
    partitions = partition_members(members, dcfg.partition_mb)
    num_workers = dcfg.num_workers or len(os.sched_getaffinity(0))
    if dcfg.executor == "dask" and dcfg.dask_address:  # a local cluster runs this checkout
        check_workers_code(dcfg.dask_address, w.__name__)
    with staging_dir(out_dir) as tmp, executor_for(dcfg.executor, dcfg.dask_address, num_workers) as executor:
        plan = w.Plan(work_dir=str(tmp / ".work"), raw_dir=dcfg.raw_dir, cleaning=dcfg.cleaning,
                      labels=tuple(source.label for source in dcfg.sources),
                      weights=tuple(source.weight for source in dcfg.sources), val_fraction=dcfg.val_fraction,
                      buckets=dedup_buckets(members, dcfg, num_workers),
                      partition_firsts=tuple(p[0].first for p in partitions), conversations=bool(cfg.sft),
                      pairs=bool(cfg.preference))
        Path(plan.work_dir, "tokens").mkdir(parents=True)
        stats = {source.label: source_entry(source, plan) for source in dcfg.sources}
        work = [w.PartitionWork(n, tuple(partition), plan) for n, partition in enumerate(partitions)]
        cleaned = executor.map("clean", w.clean_partition, work)
        examples = count_filters(plan, cleaned, stats)
        removed = deduplicate(plan, executor, len(partitions))
        documents = count_kept(plan, len(partitions), removed, stats)
        log.info("data: %d documents read, cleaned and deduplicated at %.1f s", documents["all"],
                 time.perf_counter() - started)
        source = tokenizer_source(cfg)
        tokenizer, eos_id = build_tokenizer(dcfg, source, training_texts(plan, len(partitions)))
        chat = None
        if cfg.fine_tuning:
            chat_template = chat_template_of(cfg)
            hf_tokenizer = save_chat_tokenizer(source, chat_template, tmp / "tokenizer")
            chat = w.ChatWork(str(tmp / "tokenizer"), dcfg.seq_len + 1, pairs=plan.pairs,
                              **({"train_on": cfg.sft.train_on} if cfg.sft else {}))
        else:
            hf_tokenizer = save_tokenizer(tokenizer, dcfg.special_tokens, tmp / "tokenizer")
        tokenizer_json = str(Path(plan.work_dir) / "tokenizer.json")
        tokenizer.save(tokenizer_json)
        dtype = np.dtype(vocab_dtype(tokenizer)).str
        # Both splits' pieces at once, and a split's shards as soon as its pieces are done: no
        # worker waits for the last piece of a phase it has no part in.
        pieces = {split: [w.PieceWork(n, split, len(partitions), tokenizer_json, eos_id, dtype, plan, chat)
                          for n in range(len(partitions))] for split in ("train", "val")}
        tokenizing = {split: executor.submit(f"tokenize-{split}", w.tokenize_piece, pieces[split])
                      for split in pieces}
        stems = {split: tuple(str(piece.stem) for piece in pieces[split]) for split in pieces}
        packings = {split: str(Path(plan.work_dir, f"packing-{split}")) if chat else None for split in pieces}
        splits = {}
        for split, submitted in tokenizing.items():
            tokens = count_tokens(plan, submitted.results(), split, stats, examples)
            rendered = rendered_counts(plan, split, stats) if chat else {}
            rows_a_unit = 2 if chat and chat.pairs else 1  # a pair's two replies
            samples = (w.write_packing(Path(packings[split]), stems[split], chat.row_tokens, rows_a_unit)
                       if chat else max(0, (tokens - 1) // dcfg.seq_len))
            if samples == 0:
                raise ValueError(f"the {split} split has {tokens} tokens, fewer than one sample of "
                                 f"data.seq_len + 1 = {dcfg.seq_len + 1}; lower data.seq_len or add text")
            splits[split] = {"documents": documents[split], "tokens": tokens, "samples": samples, **rendered}
        if chat:  # decided before any shard is written: a refusal leaves no write in flight
            unit = "pairs" if plan.pairs else "conversations"
            check_dropped(stats, examples, dcfg.max_dropped_fraction, unit)
        writing = {split: executor.submit(f"shards-{split}", w.write_shard_group, shard_groups(
            split, stems[split], splits[split]["samples"], dcfg, tmp, num_workers, packings[split], eos_id))
            for split in splits}
        for split, submitted in writing.items():
            splits[split]["shards"] = shard_entries(submitted.results(), split, plan, stats)
        log.info("data: tokenizer ready, documents tokenized and packed at %.1f s",
                 time.perf_counter() - started)
        concatenate([Path(plan.work_dir, "tokens", f"val-{n:06d}.jsonl") for n in range(len(partitions))],
                    tmp / "val_docs.jsonl")
        shutil.rmtree(plan.work_dir)
        manifest = {
            "format": FORMAT_VERSION,
            "config_sha256": cfg.content_hash("data"),
            "seq_len": dcfg.seq_len,
            "vocab_size": len(hf_tokenizer),
            "eos_id": eos_id,
            "tokenizer": {"dir": "tokenizer",
                          "sha256": sha256_file(tmp / "tokenizer" / "tokenizer.json"),
                          # what training from a base checks its tokenizer against
                          **({"source_sha256": sha256_file(source)} if source else {})},
            "documents": documents["all"],
            "sources": stats,
            "splits": splits,
            "heldout_docs": "val_docs.jsonl",
            **(chat_manifest(cfg, chat_template) if chat else {}),
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        # Beside the manifest, not in it: a change to this stage's code that leaves the data as
        # it was must not change the manifest, which checkpoints are fingerprinted with.
        (tmp / BUILD_NAME).write_text(json.dumps({"build_sha256": build_key, "files": file_digests(tmp)},
                                                 indent=2, sort_keys=True) + "\n")
        replace_dir(tmp, out_dir)
    log.info("data: %d documents -> %d train / %d val samples in %s (%.1f s)", documents["all"],
             splits["train"]["samples"], splits["val"]["samples"], out_dir, time.perf_counter() - started)
    return data_result(out_dir, manifest, reused=False)


def chat_manifest(cfg: Config, chat_template: str) -> dict:
    """What the manifest says of rendered conversations or pairs: the samples carry loss masks,
    rendered through this template; sft's turns trained, or that they hold preference pairs."""
    rendered = {LOSS_MASKS: True, "chat_template_sha256": template_sha256(chat_template)}
    return {**rendered, PREFERENCE: True} if cfg.preference else {**rendered, "train_on": cfg.sft.train_on}


def partition_members(members: list[Member], partition_mb: float) -> list[list[Member]]:
    """Consecutive members of about `partition_mb` raw megabytes each."""
    partitions, current, size = [], [], 0
    for member in members:
        current.append(member)
        size += member.bytes
        if size >= partition_mb * 2**20:
            partitions.append(current)
            current, size = [], 0
    if current:
        partitions.append(current)
    return partitions


def dedup_buckets(members: list[Member], dcfg: DataConfig, num_workers: int) -> int:
    """Reducers of the dedup shuffle: enough for the workers, and for each to hold at most
    RECORDS_PER_BUCKET records (a document has one per LSH band). Sized by the records, not one
    per partition: each reducer reads its slice of every partition, so the reads are
    partitions x buckets, which one bucket per partition made quadratic in the corpus. Which
    bucket a key falls in decides nothing: the output does not depend on their number."""
    documents = sum(member.documents for member in members)
    per_document = len(lsh_bands(dcfg.cleaning)) if dcfg.cleaning.near_dedup_threshold else 1
    return max(num_workers, -(-documents * per_document // RECORDS_PER_BUCKET))


def count_filters(plan: w.Plan, cleaned: list[w.CleanSummary],
                  stats: dict[str, dict]) -> dict[str, list[str]]:
    """Adds the partitions' input and removals to `stats`; returns per source the first removed
    documents, named with their reason."""
    examples: dict[str, list[str]] = {label: [] for label in plan.labels}
    for summary in cleaned:
        for source, named in summary.examples.items():
            examples[plan.labels[source]] = (examples[plan.labels[source]] + named)[:w.EXAMPLES]
        for source, count in summary.input_documents.items():
            stats[plan.labels[source]]["input"]["documents"] += count
            stats[plan.labels[source]]["input"]["bytes"] += summary.input_bytes[source]
        for source, counts in summary.removed.items():
            removed = stats[plan.labels[source]]["removed"]
            for reason, count in counts.items():
                removed[reason] = removed.get(reason, 0) + count
    return examples


def deduplicate(plan: w.Plan, executor: Executor, partitions: int) -> dict[str, np.ndarray]:
    """The documents dedup removes, by reason: exact duplicates of an earlier document, then
    near duplicates of an earlier kept one -- decided in document order, as one process offering
    the documents in order would."""
    buckets = [w.BucketWork(n, partitions, plan) for n in range(plan.buckets)]
    exact = np.zeros(0, np.int64)
    if plan.cleaning.exact_dedup:
        exact = np.sort(np.concatenate(executor.map("exact-dedup", w.exact_duplicates, buckets)))
    w.write_array(Path(plan.work_dir) / "exact-duplicates.npy", exact)
    near = np.zeros(0, np.int64)
    if plan.cleaning.near_dedup_threshold:
        pairs = np.concatenate(executor.map("near-dedup", w.near_duplicate_pairs, buckets))
        near = near_duplicates(pairs)
    w.write_array(Path(plan.work_dir) / "removed.npy", np.union1d(exact, near))
    return {"exact_duplicate": exact, "near_duplicate": near}


def near_duplicates(pairs: np.ndarray) -> np.ndarray:
    """The later document of each similar pair whose earlier one is kept, in document order:
    an earlier document's fate is settled before any later one's."""
    removed: set[int] = set()
    pairs = np.unique(pairs, axis=0)  # sorted by the earlier document
    for earlier, later in pairs[np.argsort(pairs[:, 1], kind="stable")]:
        if later not in removed and earlier not in removed:
            removed.add(int(later))
    return np.array(sorted(removed), np.int64)


def count_kept(plan: w.Plan, partitions: int, removed: dict[str, np.ndarray],
               stats: dict[str, dict]) -> dict[str, int]:
    """Per source what dedup removed and what the kept documents' cleaning did; the numbers of
    documents kept, in all and per split (which must not be empty)."""
    totals = {"all": 0, "train": 0, "val": 0}
    for partition in range(partitions):
        summary = np.load(plan.partition_dir(partition) / "summary.npy")
        gone = np.zeros(len(summary), bool)
        for reason, docs in removed.items():
            mine = np.isin(summary["doc"], docs)
            gone |= mine
            for source, count in zip(*np.unique(summary["source"][mine], return_counts=True), strict=True):
                entry = stats[plan.labels[source]]["removed"]
                entry[reason] = entry.get(reason, 0) + int(count)
        kept = summary[~gone]
        for source in np.unique(kept["source"]):
            rows, entry = kept[kept["source"] == source], stats[plan.labels[source]]
            entry["kept"] += len(rows)
            entry["repaired_utf8"] += int(rows["repaired"].sum())
            entry["boilerplate_lines"] += int(rows["boilerplate_lines"].sum())
            entry["pii_replaced"] += int(rows["pii_replaced"].sum())
        totals["all"] += int((~gone).sum())
        totals["val"] += int((~gone & summary["val"]).sum())
    totals["train"] = totals["all"] - totals["val"]
    if not totals["all"]:
        raise ValueError(f"no document of data.sources survived cleaning; removed: "
                         f"{ {label: entry['removed'] for label, entry in stats.items()} }")
    if not totals["val"] or not totals["train"]:
        raise ValueError(
            f"{totals['all']} documents split into {totals['train']} train / {totals['val']} "
            "val; add documents or change data.val_fraction so both are non-empty"
        )
    return totals


def training_texts(plan: w.Plan, partitions: int) -> Iterator[tuple[str, str]]:
    """(sha256, text) of the training documents in training order, one key range at a time."""
    for number in range(plan.ranges):
        for record in w.training_range(plan, number, partitions):
            yield record[3], record[4]


def count_tokens(plan: w.Plan, counts: list[dict[int, list]], split: str, stats: dict[str, dict],
                 examples: dict[str, list[str]]) -> int:
    """Adds each source's documents (or pairs) and tokens of the split's pieces to `stats` -- for
    conversations also those split at turn boundaries, their loss tokens and the exchanges left
    out; for pairs each reply's loss tokens; for both, those dropped (the template rejects them,
    or they do not fit in a row), with examples. Returns the split's tokens."""
    tokens = 0
    for piece in counts:
        for source, (documents, source_tokens, *rendered) in piece.items():
            label = plan.labels[source]
            entry = stats[label]
            entry[f"{split}_{plan.counted}"] += documents
            entry[f"{split}_tokens"] += source_tokens
            if plan.pairs:
                chosen, rejected, dropped, named = rendered
                entry[f"{split}_chosen_loss_tokens"] += chosen
                entry[f"{split}_rejected_loss_tokens"] += rejected
            elif rendered:
                several, loss, dropped, dropped_turns, named = rendered
                entry[f"{split}_split"] += several
                entry[f"{split}_loss_tokens"] += loss
                entry[f"{split}_dropped_turns"] += dropped_turns
            if rendered:
                removed = entry["removed"]
                for reason, count in dropped.items():
                    entry["kept"] -= count
                    removed[reason] = removed.get(reason, 0) + count
                examples[label] = (examples[label] + named)[:w.EXAMPLES]
            tokens += source_tokens
    return tokens


def check_dropped(stats: dict[str, dict], examples: dict[str, list[str]], max_fraction: float,
                  records: str = "conversations") -> None:
    """Logs per source the conversations (or pairs: `records`) dropped, by reason; fails when a
    source loses more than `max_fraction` of them to reasons other than ALLOWED_DROPS, before any
    training on what is left."""
    for label, entry in stats.items():
        read, removed = entry["input"]["documents"], entry["removed"]
        counted = sum(count for reason, count in removed.items() if reason not in ALLOWED_DROPS)
        line = f"{read} {records} read, {entry['kept']} kept, dropped {dict(sorted(removed.items()))}"
        if records == "conversations":
            split, turns = (sum(entry.get(f"{part}_{key}", 0) for part in ("train", "val"))
                            for key in ("split", "dropped_turns"))
            line += (f"; split at turn boundaries (longer than a row) {split}, exchanges left out (alone "
                     f"longer than a row) {turns}")
        log.info("data: source %s: %s", label, line)
        if read and counted / read > max_fraction:
            raise ValueError(
                f"data source {label} loses {counted} of its {read} {records} ({counted / read:.1%}), "
                f"more than data.max_dropped_fraction={max_fraction}: dropped "
                f"{dict(sorted(removed.items()))}; e.g. {examples[label]}. Fix the records (role names: "
                "the source's `roles`; too_long: raise data.seq_len), or raise data.max_dropped_fraction")


# Drops that lose nothing a model could learn from -- a copy of a kept conversation, one with no
# assistant turn (a single speaker's messages), a pair of identical replies (no preference: its
# loss has no gradient) -- are reported but count against no limit.
ALLOWED_DROPS = frozenset({"exact_duplicate", "near_duplicate", "no_assistant_turn", "identical_replies"})


def rendered_counts(plan: w.Plan, split: str, stats: dict[str, dict]) -> dict[str, int]:
    """What the manifest counts of a split's rendered conversations (their loss tokens) or
    preference pairs (`pair_counts`)."""
    return pair_counts(plan, split, stats) if plan.pairs else {"loss_tokens": loss_tokens(plan, split, stats)}


def loss_tokens(plan: w.Plan, split: str, stats: dict[str, dict]) -> int:
    """The split's loss tokens; training needs some."""
    total = sum(stats[label][f"{split}_loss_tokens"] for label in plan.labels)
    if split == "train" and not total:
        raise ValueError("the training conversations hold no assistant token to train on")
    return total


def pair_counts(plan: w.Plan, split: str, stats: dict[str, dict]) -> dict[str, int]:
    """The split's pairs and loss tokens, of both replies and of each. Both splits need pairs:
    training learns from them, validation measures the preference on pairs it did not see."""
    counts = {key: sum(stats[label][f"{split}_{key}"] for label in plan.labels)
              for key in ("pairs", "chosen_loss_tokens", "rejected_loss_tokens")}
    if not counts["pairs"]:
        removed = {label: entry["removed"] for label, entry in stats.items()}
        raise ValueError(f"the {split} split holds no preference pair that renders in a row (data.seq_len "
                         f"+ 1 tokens); removed: {removed}. Add pairs, raise data.seq_len (too_long) or "
                         "change data.val_fraction")
    return {**counts, "loss_tokens": counts["chosen_loss_tokens"] + counts["rejected_loss_tokens"]}


def shard_groups(split: str, pieces: tuple[str, ...], samples: int, dcfg: DataConfig, directory: Path,
                 num_workers: int, packing: str | None = None, pad_id: int = 0) -> list[w.ShardWork]:
    """A split's shards, in groups for the workers to write; conversations by their `packing`."""
    per_shard = dcfg.samples_per_shard
    shards = [(number, start, min(start + per_shard, samples))
              for number, start in enumerate(range(0, samples, per_shard))]
    size = -(-len(shards) // (num_workers * SHARD_GROUPS_PER_WORKER))
    return [w.ShardWork(n, split, tuple(shards[i:i + size]), pieces, dcfg.seq_len, str(directory), packing,
                        pad_id) for n, i in enumerate(range(0, len(shards), size))]


def shard_entries(written: list[tuple[list[dict], dict[int, int]]], split: str, plan: w.Plan,
                  stats: dict[str, dict]) -> list[dict]:
    """The manifest entries of the shards the groups wrote, in order; each source's sequences are
    added to `stats`."""
    entries = []
    for group_entries, sequences in written:
        entries += group_entries
        for source, count in sequences.items():
            stats[plan.labels[source]][f"{split}_sequences"] += count
    return entries


def concatenate(parts: list[Path], path: Path) -> None:
    with open(path, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out)


def preflight_tokenizer(cfg: Config) -> None:
    """The tokenizer to load, if one is configured or comes with the base, exists -- and for
    conversations and preference pairs, with a chat template (the sources and the snapshot are
    checked by the snapshot step's own preflight)."""
    tokenizer_source(cfg)
    if cfg.fine_tuning:
        chat_template_of(cfg)


def chat_template_of(cfg: Config) -> str:
    """The template conversations (and preference pairs) are rendered with: data.chat_template,
    else the run's tokenizer's."""
    source = tokenizer_source(cfg)
    if source is None:
        raise ConfigError(f"{cfg.objective} renders conversations through the base's tokenizer and its chat "
                          "template: set model.init_from (or data.tokenizer_path to a tokenizer directory)")
    directory = str(source.parent)
    return resolve_template(cfg.data.chat_template, load_chat_tokenizer(directory), directory)


def save_chat_tokenizer(source: Path, chat_template: str, directory: Path) -> PreTrainedTokenizerBase:
    """The run's tokenizer as it is -- its special tokens are those the template names -- with the
    template the conversations were rendered with, saved in the transformers layout."""
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent))  # a copy: the cached one stays as it is
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return tokenizer


def tokenizer_source(cfg: Config) -> Path | None:
    """The tokenizer.json the stage loads: data.tokenizer_path's, else the base's when the run
    starts from one (model.init_from); None when it trains one on the corpus."""
    if cfg.data.tokenizer_path:
        return tokenizer_file(cfg.data.tokenizer_path)
    if cfg.model.init_from:
        return resolve_base(cfg).tokenizer / "tokenizer.json"
    return None


def files_named_by_path(cfg: Config) -> dict[str, dict[str, str] | str | None]:
    """The files outside the repository that the config names by path, by content (the data
    stage's cache key; DVC sees only the paths): data.tokenizer_path's tokenizer -- its chat
    template and special tokens too -- and a data.chat_template .jinja file (None: missing)."""
    named: dict[str, dict[str, str] | str | None] = {}
    if cfg.data.tokenizer_path:
        path = Path(cfg.data.tokenizer_path)
        named["data.tokenizer_path"] = tokenizer_files(path) if path.is_dir() else (
            tokenizer_files(path.parent) | ({path.name: sha256_file(path)} if path.is_file() else {}))
    if cfg.data.chat_template and cfg.data.chat_template.endswith(".jinja"):
        path = Path(cfg.data.chat_template)
        named["data.chat_template"] = sha256_file(path) if path.is_file() else None
    return named


def data_result(out_dir: Path, manifest: dict, reused: bool) -> DataResult:
    splits = manifest["splits"]
    return DataResult(out_dir=str(out_dir), manifest_sha256=sha256_file(out_dir / MANIFEST_NAME),
                      documents=manifest["documents"], train_tokens=splits["train"]["tokens"],
                      train_samples=splits["train"]["samples"], val_samples=splits["val"]["samples"],
                      reused=reused)


def build_fingerprint(cfg: Config, index: dict) -> str:
    """sha256 of everything the output depends on: what the data config computes, the
    snapshot's files (by their sha256, which every read checks) and the stage's code."""
    digest = hashlib.sha256(f"{FORMAT_VERSION}\n{cfg.content_hash('data')}\n".encode())
    digest.update(stage_named("data").code_hash().encode())
    if (source := tokenizer_source(cfg)) is not None:  # a loaded tokenizer counts by its content
        digest.update(f"tokenizer\0{sha256_file(source)}\0".encode())
    if cfg.fine_tuning:
        digest.update(f"chat_template\0{template_sha256(chat_template_of(cfg))}\0".encode())
    if cfg.sft:
        digest.update(f"train_on\0{cfg.sft.train_on}\0".encode())
    for entry in index["sources"]:
        digest.update(f"{entry['label']}\0{entry['sha256']}\0".encode())
    return digest.hexdigest()


def file_digests(out_dir: Path) -> dict[str, str]:
    """sha256 of every file of an output but its build.json, by relative path."""
    return {str(path.relative_to(out_dir)): sha256_file(path) for path in sorted(out_dir.rglob("*"))
            if path.is_file() and path.name != BUILD_NAME}


def up_to_date_manifest(out_dir: Path, build_key: str) -> dict | None:
    """The existing output's manifest if it was built from exactly these inputs and holds exactly
    the files it was written with, intact."""
    try:
        build = json.loads((out_dir / BUILD_NAME).read_text())
        manifest = json.loads((out_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if build.get("build_sha256") != build_key or build.get("files") != file_digests(out_dir):
        return None
    return manifest


def source_entry(source: SourceConfig, plan: w.Plan) -> dict:
    """The manifest's record of one source: provenance, then counts filled in as documents flow,
    per split its documents (of preference pairs: `pairs`), tokens and sequences; of
    conversations also, per split, those split at turn boundaries, the loss tokens and the
    exchanges left out (alone longer than a row); of pairs, the loss tokens of each reply."""
    where = {"path": source.path} if source.path else {"dataset": source.dataset} if source.dataset else {}
    rendered = (("chosen_loss_tokens", "rejected_loss_tokens") if plan.pairs
                else ("split", "loss_tokens", "dropped_turns") if plan.conversations else ())
    return {"kind": source.kind, **where, "license": source.provenance or "unspecified",
            "weight": source.weight, "input": {"documents": 0, "bytes": 0}, "removed": {},
            "repaired_utf8": 0, "boilerplate_lines": 0, "pii_replaced": 0, "kept": 0,
            **{f"{split}_{key}": 0 for split in ("train", "val")
               for key in (plan.counted, "tokens", "sequences", *rendered)}}


def tokenizer_file(path: str) -> Path:
    """`tokenizer.json` itself, or inside a Hugging Face tokenizer directory."""
    candidate = Path(path)
    file = candidate / "tokenizer.json" if candidate.is_dir() else candidate
    if not file.is_file():
        raise FileNotFoundError(f"data.tokenizer_path: no tokenizer.json at {file} (a fast tokenizer's "
                                "tokenizer.json, or a directory saved by save_pretrained)")
    return file


def build_tokenizer(dcfg: DataConfig, source: Path | None,
                    training: Iterator[tuple[str, str]]) -> tuple[Tokenizer, int]:
    """The tokenizer (loaded from `source`, or trained on the training documents) and its EOS id."""
    eos = dcfg.special_tokens[0]
    if source is not None:
        tokenizer = Tokenizer.from_file(str(source))
    else:
        tokenizer = train_tokenizer(sample_texts(training, dcfg.tokenizer_train_chars), dcfg.vocab_size,
                                    dcfg.special_tokens)
    eos_id = tokenizer.token_to_id(eos)
    if eos_id is None:
        raise ValueError(f"the tokenizer at {source} has no token {eos!r}; set "
                         "data.special_tokens to start with its end-of-text token")
    return tokenizer, eos_id


def sample_texts(training: Iterator[tuple[str, str]], max_chars: int) -> Iterator[str]:
    """Distinct training documents in training order (a hash order: a sample mixes the
    sources) up to `max_chars`, streamed to the trainer."""
    seen, total = set(), 0
    for sha256, text in training:
        if total >= max_chars:
            break
        if sha256 not in seen:
            seen.add(sha256)
            total += len(text)
            yield text


def train_tokenizer(texts: Iterator[str], vocab_size: int, special_tokens: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, special_tokens: list[str],
                   directory: Path) -> PreTrainedTokenizerFast:
    """Save in the transformers layout; EOS doubles as BOS and padding token."""
    eos, *extra = special_tokens
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, bos_token=eos, pad_token=eos,
                                 additional_special_tokens=extra)
    hf.save_pretrained(directory)
    return hf


def vocab_dtype(tokenizer: Tokenizer) -> type[np.unsignedinteger]:
    return np.uint16 if tokenizer.get_vocab_size(with_added_tokens=True) <= 2**16 else np.uint32


