from pathlib import Path

import pytest
import torch

from forgeline.model.training.loader import ShardedSampleLoader
from forgeline.model.training.shards import DataError, ShardInfo, read_manifest, split_shards


def shards_of(data_root: Path) -> list[ShardInfo]:
    data_dir = data_root / "data"
    return split_shards(data_dir, read_manifest(data_dir), "val")  # small: fast epochs


def global_stream(shards, dp: int, local_batch: int, steps: int, seed: int = 0) -> list[tuple]:
    """Samples per step across all dp ranks, in rank order."""
    loaders = [ShardedSampleLoader(shards, local_batch, rank, dp, seed) for rank in range(dp)]
    out = []
    for _ in range(steps):
        for loader in loaders:
            out.extend(tuple(row.tolist()) for row in loader.next_batch())
    return out


def test_ranks_read_disjoint_slices_of_one_global_order(data_root: Path) -> None:
    shards = shards_of(data_root)
    single = global_stream(shards, dp=1, local_batch=8, steps=10)
    split = global_stream(shards, dp=2, local_batch=4, steps=10)
    assert single == split
    assert len(set(single)) == len(single)


def test_resume_continues_at_the_next_unseen_sample(data_root: Path) -> None:
    shards = shards_of(data_root)
    uninterrupted = global_stream(shards, dp=1, local_batch=8, steps=12)
    first = ShardedSampleLoader(shards, 8, 0, 1, seed=0)
    seen = [tuple(r.tolist()) for _ in range(5) for r in first.next_batch()]
    state = first.state_dict()
    # Resume with another data-parallel degree: 4 ranks of 2.
    resumed = [ShardedSampleLoader(shards, 2, rank, 4, seed=0) for rank in range(4)]
    for loader in resumed:
        loader.load_state_dict(state)
    rest = [tuple(r.tolist()) for _ in range(7) for loader in resumed for r in loader.next_batch()]
    assert seen + rest == uninterrupted


def test_epochs_reshuffle_and_drop_the_remainder(data_root: Path) -> None:
    shards = shards_of(data_root)
    loader = ShardedSampleLoader(shards, 16, 0, 1, seed=0)
    per_epoch = loader.samples_per_epoch // 16
    epoch0 = [loader.next_batch() for _ in range(per_epoch)]
    assert loader.epoch == 0
    epoch1_first = loader.next_batch()
    assert loader.epoch == 1 and loader.position == 16
    assert not torch.equal(epoch0[0], epoch1_first)


def test_different_seeds_give_different_orders(data_root: Path) -> None:
    shards = shards_of(data_root)
    assert not torch.equal(ShardedSampleLoader(shards, 8, 0, 1, seed=0).next_batch(),
                           ShardedSampleLoader(shards, 8, 0, 1, seed=1).next_batch())


def test_corrupt_shard_is_detected_on_first_open(data_root: Path, tmp_path: Path) -> None:
    shard = shards_of(data_root)[0]
    copy = tmp_path / shard.path.name
    data = bytearray(shard.path.read_bytes())
    data[1000] ^= 0xFF
    copy.write_bytes(bytes(data))
    loader = ShardedSampleLoader([ShardInfo(copy, shard.samples, shard.sha256)], 8, 0, 1, seed=0)
    with pytest.raises(DataError, match="is corrupt: sha256"):
        loader.next_batch()


def test_too_little_data_for_one_batch(data_root: Path) -> None:
    shards = shards_of(data_root)
    total = sum(s.samples for s in shards)
    with pytest.raises(DataError, match="cannot fill one global batch"):
        ShardedSampleLoader(shards, total, 0, 2, seed=0)


def test_resume_across_an_epoch_with_another_dp_degree_has_no_gap_or_duplicate(data_root: Path) -> None:
    shards = shards_of(data_root)
    per_epoch = ShardedSampleLoader(shards, 12, 0, 1, seed=3).samples_per_epoch // 12
    steps = per_epoch + 3  # crosses into the second epoch
    uninterrupted = global_stream(shards, dp=2, local_batch=6, steps=steps, seed=3)
    for saved_at in (1, per_epoch - 1, per_epoch + 1):
        first = [ShardedSampleLoader(shards, 6, rank, 2, seed=3) for rank in range(2)]
        seen = [tuple(r.tolist()) for _ in range(saved_at) for loader in first for r in loader.next_batch()]
        state = first[0].state_dict()
        assert state == first[1].state_dict()  # one global position, the same on every rank
        resumed = [ShardedSampleLoader(shards, 4, rank, 3, seed=3) for rank in range(3)]
        for loader in resumed:
            loader.load_state_dict(state)
        rest = [tuple(r.tolist()) for _ in range(steps - saved_at) for loader in resumed
                for r in loader.next_batch()]
        assert seen + rest == uninterrupted
