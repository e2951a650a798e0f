"""Packed token shards: the on-disk format, its writer (the data stage) and its reader (the
training loader, loader.py).

A shard is a tar in the webdataset layout -- webdataset's own reader reads it -- whose samples
each hold `tokens.npy`, seq_len + 1 token ids (inputs and the targets shifted by one), and
`starts.npy`, the offsets in it where a document begins (for document-level attention masks);
the samples of conversations (supervised fine-tuning) also hold `mask.npy`, seq_len + 1 uint8,
1 where that token is a loss target (an assistant's reply and its end-of-turn token) -- the
targets of inputs tokens[:-1] are tokens[1:], so their mask is mask[1:]. Its bytes are
deterministic: plain ustar headers with a fixed mtime, owner and mode, samples and fields in a
fixed order, so the same samples give the same shard. `manifest.json` beside the shards lists
every shard with its sample count and sha256, and says whether the samples carry masks
(`loss_masks`).

The samples of preference pairs (preference tuning; the manifest says `preference: true`, and
`loss_masks: true`) are laid out the same, and their mask tells the replies apart: a pair is two
documents, one after the other in the same row -- prompt + chosen reply, then prompt + rejected
reply, each rendered whole through the chat template and starting where `starts.npy` says --,
several pairs to a row and none cut, the rest of the row EOS. `mask.npy` is CHOSEN (1) on the
chosen reply's trained tokens (each assistant turn of it and its end-of-turn token), REJECTED
(2) on the rejected reply's, 0 elsewhere: on the prompt, the padding and each document's first
token. Every document of such a row has trained tokens, so documents 2k and 2k + 1 of a row are
its k-th pair, chosen first: the k-th document whose mask holds 1s goes with the k-th whose mask
holds 2s. Both documents of a pair hold the same tokens before their first trained one (the
prompt as the model reads it).
"""

from __future__ import annotations

import ast
import functools
import io
import json
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forgeline.model.fileio import sha256_file

MANIFEST_NAME = "manifest.json"
SAMPLE_FIELD = "tokens.npy"
STARTS_FIELD = "starts.npy"
MASK_FIELD = "mask.npy"
LOSS_MASKS = "loss_masks"  # the manifest's key: true when every sample carries MASK_FIELD
PREFERENCE = "preference"  # the manifest's key: true when the samples hold preference pairs
CHOSEN, REJECTED = 1, 2  # MASK_FIELD's values on the trained tokens of a pair's two replies
FORMAT_VERSION = "forgeline-shards/2"


class DataError(RuntimeError):
    """Missing, stale or corrupt data-stage output."""


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    samples: int
    sha256: str
    loss_masks: bool = False  # its samples carry MASK_FIELD
    pairs: bool = False  # they are preference pairs: MASK_FIELD says which reply of a pair a token is


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
    masks, pairs = bool(manifest.get(LOSS_MASKS, False)), bool(manifest.get(PREFERENCE, False))
    return [
        ShardInfo(Path(data_dir) / s["path"], s["samples"], s["sha256"], masks, pairs)
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


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def write_shard(directory: Path, split: str, number: int, samples: Sequence[np.ndarray],
                starts: Sequence[np.ndarray], first_index: int,
                loss_masks: Sequence[np.ndarray] | None = None) -> dict:
    """Write `split`'s shard `number`, holding the samples of global indexes first_index,
    first_index + 1, ... of the split (with their loss masks, if given); returns its manifest
    entry. Plain ustar headers: pax headers cost more to build than the samples do, and
    webdataset reads either."""
    name = f"{split}-{number:06d}.tar"
    masks = loss_masks if loss_masks is not None else [None] * len(samples)
    with tarfile.open(directory / name, "w", format=tarfile.USTAR_FORMAT) as tar:
        for offset, (tokens, doc_starts, mask) in enumerate(zip(samples, starts, masks, strict=True)):
            key = f"{split}-{first_index + offset:09d}"
            fields = ((SAMPLE_FIELD, tokens), (STARTS_FIELD, doc_starts))
            for field, array in fields if mask is None else (*fields, (MASK_FIELD, mask)):
                payload = npy_bytes(array)
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size, info.mode, info.uname, info.gname = len(payload), 0o444, "forgeline", "forgeline"
                tar.addfile(info, io.BytesIO(payload))
    return {"path": name, "samples": len(samples), "sha256": sha256_file(directory / name)}
