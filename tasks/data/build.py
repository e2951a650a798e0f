"""Data stage: sources -> raw snapshot -> cleaning and dedup -> mixing -> byte-level BPE
tokenizer -> packed sequences -> webdataset shards.

Two steps: the snapshot of the raw inputs as read (snapshot.py, `data.raw_dir`), then the build
from that snapshot (this module; cleaning in clean.py, the shard format in
model/training/shards.py). `forgeline stage data` runs both; `--snapshot-only` and
`--from-snapshot` run one each (dvc.yaml's `sources` and `data` stages).

Output (`data.out_dir`): `tokenizer/` (loads with transformers.PreTrainedTokenizerFast),
`train-NNNNNN.tar` and `val-NNNNNN.tar` shards, `val_docs.jsonl` (held-out documents for
evaluation), `manifest.json` (sha256 per shard, tokenizer and config hashes, counts per split,
and per source its provenance, what each filter removed and, per split, its documents, tokens
and `sequences`: the packed samples holding at least one of its tokens -- samples mix sources,
so these add up to more than the split's samples) and `build.json` (a hash of the config, every
input document and the stage's code, and the sha256 of every file written). Every source is
checked and everything
computed before the first byte of either step's output is written; each is written to a
temporary directory and swapped in whole, so a failed run never leaves a half-written shard
under its final name. The same inputs, config and code give byte-identical output, and a rerun
on them rewrites nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from forgeline.configs import Config
from forgeline.configs.schema import CleaningConfig, DataConfig, SourceConfig
from forgeline.model.fileio import sha256_file
from forgeline.model.training.shards import FORMAT_VERSION, MANIFEST_NAME, write_shard
from forgeline.tasks.atomic import remove_stale_staging, replace_dir, staging_dir
from forgeline.tasks.data.clean import Cleaned, Deduplicator, clean_document
from forgeline.tasks.data.snapshot import SOURCES_NAME, check_snapshot, load_snapshot, take_snapshot
from forgeline.tasks.data.sources import RawDocument, preflight_sources
from forgeline.tasks.pretrained import resolve_base
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import DATA_VERSION_TAG, DATASET_NAME, RAW_VERSION_TAG, RunTracker, dvc_hash

log = logging.getLogger(__name__)

# Worker inputs, set before the pool forks so that workers inherit them instead of receiving
# pickled copies; only index ranges travel to the workers.
_WORK: dict = {}
CHUNKS_PER_WORKER = 8  # enough to even out documents of very different sizes
BUILD_NAME = "build.json"  # the build fingerprint of the output


@dataclass(frozen=True)
class Document:
    source: str
    name: str
    text: str
    sha256: str


@dataclass(frozen=True)
class DataResult:
    out_dir: str
    manifest_sha256: str
    documents: int
    train_tokens: int
    train_samples: int
    val_samples: int
    reused: bool  # the output was already up to date: nothing was rewritten


@dataclass(frozen=True)
class Packed:
    samples: np.ndarray  # (n, seq_len + 1) token ids
    starts: list[np.ndarray]  # per sample: offsets of the tokens that begin a document
    tokens: int


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
    every run, cache or not."""
    return build_from_snapshot(cfg)


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
    """The build step: the snapshot in data.raw_dir (each file checked against its sha256) to
    the shards, tokenizer and manifest in data.out_dir, unless that output is up to date."""
    dcfg = cfg.data
    started = time.perf_counter()
    out_dir = Path(dcfg.out_dir)
    remove_stale_staging(out_dir)  # also when nothing is rebuilt
    raw = load_snapshot(dcfg)
    build_key = build_fingerprint(cfg, raw)
    if (manifest := up_to_date_manifest(out_dir, build_key)) is not None:
        log.info("data: %s is up to date (build %s); nothing rewritten", out_dir, build_key[:12])
        return data_result(out_dir, manifest, reused=True)
    num_workers = dcfg.num_workers or len(os.sched_getaffinity(0))
    stats = {source.label: source_entry(source) for source in dcfg.sources}
    for doc in raw:
        stats[doc.source]["input"]["documents"] += 1
        stats[doc.source]["input"]["bytes"] += doc.size
    documents = clean_corpus(raw, dcfg.cleaning, stats, num_workers)
    del raw
    log.info("data: %d documents read, cleaned and deduplicated at %.1f s", len(documents),
             time.perf_counter() - started)
    train_docs, val_docs = split_documents(documents, dcfg.val_fraction)
    if not val_docs or not train_docs:
        raise ValueError(
            f"{len(documents)} documents split into {len(train_docs)} train / {len(val_docs)} "
            "val; add documents or change data.val_fraction so both are non-empty"
        )
    train_docs = mix(train_docs, {source.label: source.weight for source in dcfg.sources})
    source = tokenizer_source(cfg)
    tokenizer, eos_id = build_tokenizer(dcfg, train_docs, source)
    packed = {}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        stream, lengths = tokenize_documents(tokenizer, [d.text for d in docs], eos_id, num_workers)
        packed[split] = pack(stream, lengths, dcfg.seq_len, vocab_dtype(tokenizer))
        if len(packed[split].samples) == 0:
            raise ValueError(
                f"the {split} split has {packed[split].tokens} tokens, fewer than one sample of "
                f"data.seq_len + 1 = {dcfg.seq_len + 1}; lower data.seq_len or add text"
            )
        for doc, length in zip(docs, lengths, strict=True):
            stats[doc.source][f"{split}_documents"] += 1
            stats[doc.source][f"{split}_tokens"] += int(length) + 1  # + EOS
        covered = source_sequences([d.source for d in docs], lengths, dcfg.seq_len,
                                   len(packed[split].samples))
        for label, count in covered.items():
            stats[label][f"{split}_sequences"] = count
    log.info("data: tokenizer ready, documents tokenized and packed at %.1f s", time.perf_counter() - started)
    with staging_dir(out_dir) as tmp:
        hf_tokenizer = save_tokenizer(tokenizer, dcfg.special_tokens, tmp / "tokenizer")
        splits = {split: {"documents": len(docs), "tokens": packed[split].tokens,
                          "samples": len(packed[split].samples),
                          "shards": write_shards(packed[split], tmp, split, dcfg.samples_per_shard,
                                                    num_workers)}
                  for split, docs in (("train", train_docs), ("val", val_docs))}
        write_jsonl(tmp / "val_docs.jsonl", val_docs)
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
            "documents": len(documents),
            "sources": stats,
            "splits": splits,
            "heldout_docs": "val_docs.jsonl",
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        # Beside the manifest, not in it: a change to this stage's code that leaves the data as
        # it was must not change the manifest, which checkpoints are fingerprinted with.
        (tmp / BUILD_NAME).write_text(json.dumps({"build_sha256": build_key, "files": file_digests(tmp)},
                                                 indent=2, sort_keys=True) + "\n")
        replace_dir(tmp, out_dir)
    log.info("data: %d documents -> %d train / %d val samples in %s (%.1f s)", len(documents),
             splits["train"]["samples"], splits["val"]["samples"], out_dir, time.perf_counter() - started)
    return data_result(out_dir, manifest, reused=False)


def preflight_tokenizer(cfg: Config) -> None:
    """The tokenizer to load, if one is configured or comes with the base, exists (the sources
    and the snapshot are checked by the snapshot step's own preflight)."""
    tokenizer_source(cfg)


def tokenizer_source(cfg: Config) -> Path | None:
    """The tokenizer.json the stage loads: data.tokenizer_path's, else the base's when the run
    starts from one (model.init_from); None when it trains one on the corpus."""
    if cfg.data.tokenizer_path:
        return tokenizer_file(cfg.data.tokenizer_path)
    if cfg.model.init_from:
        return resolve_base(cfg).tokenizer / "tokenizer.json"
    return None


def data_result(out_dir: Path, manifest: dict, reused: bool) -> DataResult:
    splits = manifest["splits"]
    return DataResult(out_dir=str(out_dir), manifest_sha256=sha256_file(out_dir / MANIFEST_NAME),
                      documents=manifest["documents"], train_tokens=splits["train"]["tokens"],
                      train_samples=splits["train"]["samples"], val_samples=splits["val"]["samples"],
                      reused=reused)


def build_fingerprint(cfg: Config, raw: list[RawDocument]) -> str:
    """sha256 of everything the output depends on: what the data config computes, every input
    document and the stage's code (how the documents were read is in the documents)."""
    digest = hashlib.sha256(f"{FORMAT_VERSION}\n{cfg.content_hash('data')}\n".encode())
    digest.update(stage_named("data").code_hash().encode())
    if (source := tokenizer_source(cfg)) is not None:  # a loaded tokenizer counts by its content
        digest.update(f"tokenizer\0{sha256_file(source)}\0".encode())
    for doc in raw:
        digest.update(f"{doc.source}\0{doc.name}\0{doc.size}\0".encode())
        digest.update(hashlib.sha256(doc.data or b"").digest())
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


def source_entry(source: SourceConfig) -> dict:
    """The manifest's record of one source: provenance, then counts filled in as documents flow."""
    where = {"path": source.path} if source.path else {"dataset": source.dataset} if source.dataset else {}
    return {"kind": source.kind, **where, "license": source.provenance or "unspecified",
            "weight": source.weight, "input": {"documents": 0, "bytes": 0}, "removed": {},
            "repaired_utf8": 0, "boilerplate_lines": 0, "pii_replaced": 0, "kept": 0,
            "train_documents": 0, "train_tokens": 0, "train_sequences": 0,
            "val_documents": 0, "val_tokens": 0, "val_sequences": 0}


def clean_corpus(raw: list[RawDocument], cfg: CleaningConfig, stats: dict[str, dict],
                 num_workers: int) -> list[Document]:
    """Per-document filters in parallel, then dedup in document order; counts go to `stats`."""
    with worker_pool(num_workers, raw=raw, cleaning=cfg) as pool:
        cleaned = [c for part in pool.map(_clean_range, chunk_ranges([d.size for d in raw], num_workers))
                   for c in part]
    dedup = Deduplicator(cfg)
    documents = []
    for doc, result in zip(raw, cleaned, strict=True):
        entry = stats[doc.source]
        reason = result.removed_by or dedup.check(result)
        if reason is not None:
            entry["removed"][reason] = entry["removed"].get(reason, 0) + 1
            continue
        entry["kept"] += 1
        entry["repaired_utf8"] += result.repaired
        entry["boilerplate_lines"] += result.boilerplate_lines
        entry["pii_replaced"] += result.pii_replaced
        documents.append(Document(doc.source, doc.name, result.text, result.sha256))
    if not documents:
        raise ValueError(f"no document of data.sources survived cleaning; removed: "
                         f"{ {label: entry['removed'] for label, entry in stats.items()} }")
    return documents


def _clean_range(bounds: tuple[int, int]) -> list[Cleaned]:
    raw, cfg = _WORK["raw"], _WORK["cleaning"]
    with_signature = bool(cfg.near_dedup_threshold)
    return [clean_document(raw[i].data, cfg, with_signature) for i in range(*bounds)]


@contextmanager
def worker_pool(num_workers: int, **inputs: object) -> Iterator[Executor]:
    """Forked worker processes that see `inputs` in _WORK. Fork, not spawn: a spawned worker
    would re-import the entry point's modules (Prefect, MLflow: seconds each) and receive its
    inputs pickled. Each worker tokenizes on one thread; parallelism comes from the processes."""
    _WORK.update(inputs)
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # inherited at fork; the parent restores its own
    try:
        with ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("fork")) as pool:
            yield pool
    finally:
        _WORK.clear()
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def chunk_ranges(sizes: list[int], num_workers: int) -> list[tuple[int, int]]:
    """Contiguous index ranges of roughly equal total size, CHUNKS_PER_WORKER per worker."""
    target = max(1, sum(sizes) // (num_workers * CHUNKS_PER_WORKER))
    ranges, start, acc = [], 0, 0
    for index, size in enumerate(sizes):
        acc += size
        if acc >= target:
            ranges.append((start, index + 1))
            start, acc = index + 1, 0
    if start < len(sizes):
        ranges.append((start, len(sizes)))
    return ranges


def unit_hash(key: str) -> float:
    """A uniform number in [0, 1) from a string: deterministic decisions per document."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Deterministic split by a hash of each document's text."""
    train, val = [], []
    for doc in docs:
        (val if int(doc.sha256[:16], 16) / 2**64 < val_fraction else train).append(doc)
    return train, val


def mix(docs: list[Document], weights: dict[str, float]) -> list[Document]:
    """Each document repeated per its source's weight (the fraction for a hash-chosen share),
    in a hash order that interleaves the sources."""
    copies = []
    for doc in docs:
        weight = weights[doc.source]
        count = int(weight) + (unit_hash(f"mix:{doc.sha256}") < weight - int(weight))
        copies += [(hashlib.sha256(f"{doc.sha256}:{copy}".encode()).digest(), doc) for copy in range(count)]
    return [doc for _key, doc in sorted(copies, key=lambda pair: pair[0])]


def tokenizer_file(path: str) -> Path:
    """`tokenizer.json` itself, or inside a Hugging Face tokenizer directory."""
    candidate = Path(path)
    file = candidate / "tokenizer.json" if candidate.is_dir() else candidate
    if not file.is_file():
        raise FileNotFoundError(f"data.tokenizer_path: no tokenizer.json at {file} (a fast tokenizer's "
                                "tokenizer.json, or a directory saved by save_pretrained)")
    return file


def build_tokenizer(dcfg: DataConfig, train_docs: list[Document],
                    source: Path | None = None) -> tuple[Tokenizer, int]:
    """The tokenizer (loaded from `source`, or trained on the training documents) and its EOS id."""
    eos = dcfg.special_tokens[0]
    if source is not None:
        tokenizer = Tokenizer.from_file(str(source))
    else:
        tokenizer = train_tokenizer(sample_texts(train_docs, dcfg.tokenizer_train_chars), dcfg.vocab_size,
                                    dcfg.special_tokens)
    eos_id = tokenizer.token_to_id(eos)
    if eos_id is None:
        raise ValueError(f"the tokenizer at {source} has no token {eos!r}; set "
                         "data.special_tokens to start with its end-of-text token")
    return tokenizer, eos_id


def sample_texts(docs: list[Document], max_chars: int) -> list[str]:
    """Distinct documents in hash order (so a sample mixes the sources) up to `max_chars`."""
    texts, total = [], 0
    for doc in sorted({d.sha256: d for d in docs}.values(), key=lambda d: d.sha256):
        if total >= max_chars:
            break
        texts.append(doc.text)
        total += len(doc.text)
    return texts


def train_tokenizer(texts: list[str], vocab_size: int, special_tokens: list[str]) -> Tokenizer:
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


def tokenize_documents(tokenizer: Tokenizer, texts: list[str], eos_id: int,
                       num_workers: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of all documents in order, each followed by EOS, tokenized by `num_workers`
    processes; and each document's length (without its EOS)."""
    with worker_pool(num_workers, texts=texts, tokenizer=tokenizer, eos_id=eos_id) as pool:
        parts = list(pool.map(_tokenize_range, chunk_ranges([len(t) for t in texts], num_workers)))
    stream = np.concatenate([ids for ids, _ in parts]) if parts else np.zeros(0, np.uint32)
    lengths = np.concatenate([n for _, n in parts]) if parts else np.zeros(0, np.int64)
    return stream, lengths


def _tokenize_range(bounds: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    start, stop = bounds
    # The _fast variant skips character offsets, which packing does not need.
    encodings = _WORK["tokenizer"].encode_batch_fast(_WORK["texts"][start:stop], add_special_tokens=False)
    lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
    ids = np.full(int(lengths.sum()) + len(encodings), _WORK["eos_id"], dtype=np.uint32)
    position = 0
    for encoding, length in zip(encodings, lengths, strict=True):
        ids[position:position + length] = encoding.ids
        position += length + 1  # the EOS after it is already there
    return ids, lengths


def pack(stream: np.ndarray, lengths: np.ndarray, seq_len: int, dtype: type) -> Packed:
    """Cut samples of seq_len + 1 tokens with stride seq_len from the token stream, so every
    token but the first is a target exactly once; record where documents begin in each."""
    n_samples = max(0, (len(stream) - 1) // seq_len)
    index = np.arange(seq_len + 1)[None, :] + seq_len * np.arange(n_samples)[:, None]
    doc_starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]]) if len(lengths) else np.zeros(0, np.int64)
    lo = np.searchsorted(doc_starts, seq_len * np.arange(n_samples))
    hi = np.searchsorted(doc_starts, seq_len * np.arange(n_samples) + seq_len + 1)
    starts = [(doc_starts[a:b] - i * seq_len).astype(np.int32)
              for i, (a, b) in enumerate(zip(lo, hi, strict=True))]
    return Packed(stream[index].astype(dtype), starts, len(stream))


def source_sequences(sources: list[str], lengths: np.ndarray, seq_len: int,
                     num_samples: int) -> dict[str, int]:
    """Per source, how many of the `num_samples` packed samples hold at least one of its tokens,
    from the documents' sources and token counts in stream order. Document i (its tokens and
    EOS) spans stream positions [b, e); sample j holds positions [j*seq_len, j*seq_len + seq_len],
    so it overlaps the document for ceil(b/seq_len) - 1 <= j <= (e-1)//seq_len. Samples mix
    sources: the counts of all sources add up to at least the number of samples."""
    sizes = np.asarray(lengths, dtype=np.int64) + 1
    ends = np.cumsum(sizes)
    first = np.maximum(-(-(ends - sizes) // seq_len) - 1, 0)
    last = np.minimum((ends - 1) // seq_len, num_samples - 1)  # < first: only in the dropped tail
    labels = np.array(sources)
    counts = {}
    for label in dict.fromkeys(sources):
        mine = (labels == label) & (first <= last)
        coverage = np.zeros(num_samples + 1, np.int64)  # +1 where a document's samples begin, -1 after
        np.add.at(coverage, first[mine], 1)
        np.add.at(coverage, last[mine] + 1, -1)
        counts[label] = int((np.cumsum(coverage[:-1]) > 0).sum())
    return counts


def write_shards(packed: Packed, directory: Path, split: str, per_shard: int, num_workers: int) -> list[dict]:
    """Write the shards of a split, in parallel; returns their manifest entries in order."""
    bounds = [(start, min(start + per_shard, len(packed.samples)))
              for start in range(0, len(packed.samples), per_shard)]
    ranges = chunk_ranges([1] * len(bounds), num_workers)
    with worker_pool(num_workers, packed=packed, directory=directory, split=split, bounds=bounds) as pool:
        return [entry for part in pool.map(_write_shard_range, ranges) for entry in part]


def _write_shard_range(numbers: tuple[int, int]) -> list[dict]:
    packed, entries = _WORK["packed"], []
    for number in range(*numbers):
        start, stop = _WORK["bounds"][number]
        entries.append(write_shard(_WORK["directory"], _WORK["split"], number, packed.samples[start:stop],
                                   packed.starts[start:stop], start))
    return entries


def write_jsonl(path: Path, docs: list[Document]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"source": doc.source, "name": doc.name, "text": doc.text}) + "\n")
