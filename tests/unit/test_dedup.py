"""Deduplication across partitions equals one process offering the documents in order to
datasketch's MinHashLSH: exact duplicates (by the cleaned document's dedup key) of an earlier
document go, then a document goes when its estimated Jaccard similarity to an earlier *kept*
one, sharing an LSH band, reaches the threshold."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from datasketch import LeanMinHash, MinHash, MinHashLSH

from forgeline.configs import Config
from forgeline.configs.schema import CleaningConfig
from forgeline.model.training.shards import read_manifest
from forgeline.tasks.data import snapshot
from forgeline.tasks.data import work as w
from forgeline.tasks.data.build import build_dataset, deduplicate, near_duplicates, partition_members
from forgeline.tasks.data.clean import MINHASH_SCHEME, MINHASH_SEED, clean_document
from forgeline.tasks.data.executor import PoolExecutor
from forgeline.tasks.data.snapshot import load_snapshot, snapshot_members, take_snapshot
from tests.conftest import debug_config

LABEL = "generated"
MEMBER_BYTES = 16 << 10  # ~11 documents a member: ~50 members
FAMILIES = 50
WORDS_PER_DOC = 200


# -- near_duplicates: the decisions from the similar pairs ---------------------------------------


def sequential_decisions(pairs: list[tuple[int, int]], documents: int) -> list[int]:
    """Brute force: in document order, a document goes if a kept earlier one is similar."""
    similar = {(min(a, b), max(a, b)) for a, b in pairs}
    removed: list[int] = []
    for later in range(documents):
        if any((earlier, later) in similar and earlier not in removed for earlier in range(later)):
            removed.append(later)
    return removed


@pytest.mark.parametrize(("pairs", "removed"), [
    ([], []),
    ([(0, 1)], [1]),
    ([(0, 1), (1, 2)], [1]),  # a~b, b~c: b goes with a, c stays (its only match b is gone)
    ([(0, 1), (1, 2), (0, 2)], [1, 2]),  # ... unless a~c
    ([(1, 2), (0, 1)], [1]),  # the pairs' order does not matter
    ([(0, 1), (1, 2), (2, 3), (3, 4)], [1, 3]),  # a chain alternates
    ([(0, 3), (1, 3), (2, 3)], [3]),
    ([(1, 2), (0, 2)], [2]),  # 0 and 1 both kept: 2 goes
    ([(5, 9), (9, 12), (12, 20), (5, 20)], [9, 20]),
], ids=repr)
def test_near_duplicates_keeps_the_first_and_judges_against_kept_documents(pairs: list,
                                                                          removed: list) -> None:
    array = np.array(pairs, np.int64).reshape(-1, 2)
    assert near_duplicates(array).tolist() == removed
    assert near_duplicates(np.concatenate([array, array[::-1]])).tolist() == removed  # repeated pairs
    assert near_duplicates(array).dtype == np.int64


def test_near_duplicates_equal_sequential_decisions_on_random_pairs() -> None:
    rng = np.random.default_rng(0)
    for trial in range(200):
        documents = int(rng.integers(2, 40))
        earlier, later = np.triu_indices(documents, k=1)
        chosen = rng.random(len(earlier)) < rng.uniform(0.02, 0.3)
        pairs = np.stack([earlier[chosen], later[chosen]], axis=1).astype(np.int64)
        shuffled = pairs[rng.permutation(len(pairs))]
        expected = sequential_decisions([tuple(p) for p in pairs.tolist()], documents)
        assert near_duplicates(shuffled).tolist() == expected, f"trial {trial}: {pairs.tolist()}"


# -- the shuffle across partitions against a sequential reference --------------------------------


@dataclass(frozen=True)
class Reference:
    names: list[str]  # of every document, in document order
    exact: list[int]  # the documents removed as exact duplicates
    near: list[int]  # ... and as near duplicates
    val: list[str]  # names of the kept documents of the validation split, in document order
    train_documents: int
    rescued: int  # kept documents similar to an earlier one that near-dedup removed
    across: int  # near duplicates removed by a kept document of another partition (of the finest split)


def generated_documents(seed: int = 0) -> list[str]:
    """Families of documents: a base text of random words; copies with a few words changed (1 to
    3 changes stay above the 0.85 threshold, 4 straddle it, 8 are well below); chains of
    changes (a~b and b~c, not a~c); exact copies that differ in case and whitespace only -- of the
    base and of a near copy. Shuffled, so a family's members lie far apart."""
    rng = random.Random(seed)
    vocab = sorted({"".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 9)))
                    for _ in range(6000)})

    def edit(words: list[str], changes: int) -> list[str]:
        words = list(words)
        for position in rng.sample(range(len(words)), changes):
            words[position] = rng.choice(vocab)
        return words

    def text(words: list[str]) -> str:
        lines = [" ".join(words[i:i + 10]) for i in range(0, len(words), 10)]
        return "\n".join(line[0].upper() + line[1:] + "." for line in lines) + "\n"

    documents = []
    for _ in range(FAMILIES):
        base = rng.choices(vocab, k=WORDS_PER_DOC)
        near = [edit(base, changes) for changes in (1, 2, 3, 4, 8)]
        chain = edit(near[1], 2)  # base~near[1]~chain; base~chain at about 4 changes
        family = [text(words) for words in (base, *near, chain, edit(chain, 2))]
        family.append(text(base).upper())
        family.append(re.sub(r" ", "  ", text(near[0])).replace("\n", " \n\n"))
        documents += family
    rng.shuffle(documents)
    return documents


def minhash(text: str, cleaning: CleaningConfig) -> LeanMinHash:
    words = re.findall(r"\w+", text.lower())
    n = cleaning.shingle_words
    shingles = {" ".join(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}
    m = MinHash(num_perm=cleaning.minhash_perms, seed=MINHASH_SEED, scheme=MINHASH_SCHEME)
    for shingle in shingles:
        m.update(shingle.encode())
    return LeanMinHash(m)


def similar_earlier(lsh: MinHashLSH, signature: LeanMinHash, signatures: dict[int, LeanMinHash],
                    threshold: float) -> list[int]:
    """The documents in `lsh` sharing a band with `signature`, confirmed on the estimate."""
    return [doc for doc in lsh.query(signature) if signature.jaccard(signatures[doc]) >= threshold]


def sequential_reference(cfg: Config, partition_firsts: list[int]) -> Reference:
    """One process, the documents in order: datasketch's MinHashLSH holds the kept documents."""
    cleaning = cfg.data.cleaning
    threshold = cleaning.near_dedup_threshold
    kept_lsh = MinHashLSH(threshold=threshold, num_perm=cleaning.minhash_perms)
    all_lsh = MinHashLSH(threshold=threshold, num_perm=cleaning.minhash_perms)  # for the diagnostics
    keys: dict[str, int] = {}
    signatures: dict[int, LeanMinHash] = {}
    exact, near, val, names = [], [], [], []
    train = rescued = across = 0

    def partition(doc: int) -> int:
        return int(np.searchsorted(partition_firsts, doc, side="right"))

    for number, raw in enumerate(load_snapshot(cfg.data)):
        names.append(raw.name)
        cleaned = clean_document(raw.data, cleaning, with_signature=False)
        assert cleaned.removed_by is None, (raw.name, cleaned.removed_by)  # dedup is all this tests
        if cleaned.dedup_key in keys:
            exact.append(number)
            continue
        keys[cleaned.dedup_key] = number
        signature = signatures[number] = minhash(cleaned.text, cleaning)
        matches = similar_earlier(kept_lsh, signature, signatures, threshold)
        similar = similar_earlier(all_lsh, signature, signatures, threshold)
        all_lsh.insert(number, signature)
        if matches:
            near.append(number)
            across += all(partition(doc) != partition(number) for doc in matches)
            continue
        rescued += bool(similar)
        kept_lsh.insert(number, signature)
        if w.is_val(cleaned.sha256, cfg.data.val_fraction):
            val.append(raw.name)
        else:
            train += 1
    return Reference(names, exact, near, val, train, rescued, across)


def generated_config(root: Path, raw_dir: Path, *overrides: str) -> Config:
    """The generated corpus (beside its snapshot `raw_dir`) as a `files` source."""
    source = {"kind": "files", "path": f"{raw_dir.parent / 'corpus'}/*.txt", "name": LABEL}
    return debug_config(root, f"data.sources={json.dumps([source])}", f"data.raw_dir={raw_dir}",
                        "data.executor=pool", "data.num_workers=2", "data.val_fraction=0.5",
                        "data.samples_per_shard=256", *overrides)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Reference]:
    """The generated corpus's snapshot in small members, and the sequential reference's decisions."""
    root = tmp_path_factory.mktemp("dedup")
    (root / "corpus").mkdir()
    for number, text in enumerate(generated_documents()):
        (root / "corpus" / f"doc-{number:04d}.txt").write_text(text)
    raw_dir = root / "raw"
    cfg = generated_config(root / "reference", raw_dir, "data.partition_mb=0.001")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(snapshot, "MEMBER_BYTES", MEMBER_BYTES)
        take_snapshot(cfg)
    finest = partition_members(snapshot_members(cfg.data), cfg.data.partition_mb)
    assert len(finest) >= 40
    reference = sequential_reference(cfg, [p[0].first for p in finest])
    # The input is what it should be: many decisions of each kind, many across partitions.
    assert len(reference.exact) >= 2 * FAMILIES and len(reference.near) >= 2 * FAMILIES
    assert reference.rescued >= 10 and reference.across >= FAMILIES
    kept = len(reference.names) - len(reference.exact) - len(reference.near)
    assert kept >= 3 * FAMILIES  # the copies below the threshold (and some straddling it) stay
    return raw_dir, reference


def partitioned_decisions(cfg: Config, work_dir: Path, buckets: int) -> tuple[int, dict[str, list[int]]]:
    """The build's dedup alone, as build.py runs it: clean the partitions, then the shuffle."""
    dcfg = cfg.data
    partitions = partition_members(snapshot_members(dcfg), dcfg.partition_mb)
    plan = w.Plan(work_dir=str(work_dir), raw_dir=dcfg.raw_dir, cleaning=dcfg.cleaning,
                  labels=tuple(s.label for s in dcfg.sources), weights=tuple(s.weight for s in dcfg.sources),
                  val_fraction=dcfg.val_fraction, buckets=buckets,
                  partition_firsts=tuple(p[0].first for p in partitions))
    with PoolExecutor(dcfg.num_workers) as executor:
        executor.map("clean", w.clean_partition, [w.PartitionWork(n, tuple(members), plan)
                                                   for n, members in enumerate(partitions)])
        removed = deduplicate(plan, executor, len(partitions))
    return len(partitions), {reason: docs.tolist() for reason, docs in removed.items()}


@pytest.mark.parametrize(("partition_mb", "partitions", "buckets"),
                         [(0.001, (40, 100), 3), (0.001, (40, 100), 64), (0.1, (4, 8), 5), (100, (1, 1), 1)])
def test_partitioned_dedup_decides_as_one_sequential_process(
        tmp_path: Path, generated: tuple[Path, Reference], partition_mb: float,
        partitions: tuple[int, int], buckets: int) -> None:
    raw_dir, reference = generated
    cfg = generated_config(tmp_path, raw_dir, f"data.partition_mb={partition_mb}")
    count, removed = partitioned_decisions(cfg, tmp_path / "work", buckets)
    assert partitions[0] <= count <= partitions[1]
    for reason, expected in (("exact_duplicate", reference.exact), ("near_duplicate", reference.near)):
        # by name: a failure shows which documents
        assert [reference.names[doc] for doc in removed[reason]] == [reference.names[doc] for doc in expected]


def test_built_dataset_counts_and_holds_the_sequentially_kept_documents(
        tmp_path: Path, generated: tuple[Path, Reference]) -> None:
    raw_dir, reference = generated
    cfg = generated_config(tmp_path, raw_dir, "data.partition_mb=0.001")
    build_dataset(cfg, from_snapshot=True)
    manifest = read_manifest(cfg.data.out_dir)
    entry = manifest["sources"][LABEL]
    assert entry["removed"] == {"exact_duplicate": len(reference.exact),
                                "near_duplicate": len(reference.near)}
    assert entry["kept"] == manifest["documents"] == len(reference.val) + reference.train_documents
    assert manifest["splits"]["train"]["documents"] == reference.train_documents
    lines = (Path(cfg.data.out_dir) / "val_docs.jsonl").read_text().splitlines()
    assert [json.loads(line)["name"] for line in lines] == reference.val


def test_sources_without_documents_are_explained(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "blank.jsonl").write_text("\n\n")
    cfg = debug_config(tmp_path, f"data.sources=[{{kind: files, path: '{tmp_path}/src/*.jsonl'}}]",
                       "data.executor=pool", "data.num_workers=1")
    with pytest.raises(ValueError, match="data.sources hold no document"):
        build_dataset(cfg)
