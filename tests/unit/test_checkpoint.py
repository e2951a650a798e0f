import fcntl
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from forgeline.configs.schema import CheckpointConfig, ModelConfig
from forgeline.model.checkpoint.manager import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointManager,
    ModelState,
    OptimizerState,
    RNGState,
    StaleGenerationError,
    claim_generation,
    committed_checkpoints,
    generation_owner,
    latest_valid_checkpoint,
    load_model_weights,
    verify_checkpoint,
)
from forgeline.model.checkpoint.tiers import PersistentTier
from forgeline.model.transformer import Transformer

ARGS = ModelConfig(vocab_size=50, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=16)


def trained_state(seed: int) -> tuple[Transformer, torch.optim.Optimizer, dict]:
    torch.manual_seed(seed)
    model = Transformer(ARGS)
    model.init_weights(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 50, (2, 8))).sum().backward()
    optimizer.step()
    return model, optimizer, {"model": ModelState([model]), "optim": OptimizerState([model], [optimizer])}


def manager(root: Path, fingerprint: str = "f1", **cfg: object) -> CheckpointManager:
    return CheckpointManager(root, CheckpointConfig(**cfg), rank=0, world_size=1, fingerprint=fingerprint)


def save_steps(root: Path, steps: list[int], **cfg: object) -> CheckpointManager:
    saver = manager(root, **{"keep_last": 5, **cfg})
    for step in steps:
        _, _, state = trained_state(step)
        saver.save(step, state, {"loss": 1.0, "layout": {"world_size": 1}})
    saver.close()
    return saver


def test_save_commits_a_verifying_manifest(tmp_path: Path, process_group: None) -> None:
    save_steps(tmp_path, [10])
    path = tmp_path / "step-00000010"
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["step"] == 10 and manifest["fingerprint"] == "f1" and manifest["loss"] == 1.0
    assert ".metadata" in manifest["files"]
    assert verify_checkpoint(path) == []
    assert not list(tmp_path.glob(".*partial"))


def test_a_later_attempt_fences_an_earlier_one_out_of_the_checkpoints(tmp_path: Path,
                                                                      process_group: None) -> None:
    """A stale attempt (its launcher killed, a retry started) can neither start a save nor commit
    one already in flight; the retry's checkpoints carry its generation."""
    _, _, state = trained_state(1)
    stale = manager(tmp_path, async_save=True)
    stale.save(10, state, {"layout": {"world_size": 1}})  # in flight when the retry starts
    retry = manager(tmp_path, async_save=True)
    with pytest.raises(StaleGenerationError, match="belongs to another training attempt"):
        stale.wait()
    with pytest.raises(StaleGenerationError):
        stale.save(20, state, {"layout": {"world_size": 1}})
    assert not (tmp_path / "step-00000010").exists() and not (tmp_path / "step-00000020").exists()
    retry.save(10, state, {"layout": {"world_size": 1}})
    retry.close()
    manifest = json.loads((tmp_path / "step-00000010" / MANIFEST_NAME).read_text())
    assert manifest["generation"] == retry.generation != stale.generation
    assert not (tmp_path / ".generation").exists()  # released by the retry's close
    assert verify_checkpoint(tmp_path / "step-00000010") == []


class ClaimDuring:
    """Another training attempt (a thread) claims `root` the first time the stale attempt is
    about to `act` (a patched function: the commit's rename, a prune's removal, a release's
    unlink) on a path `when` accepts -- or tries to: the act goes on once that claim has either
    landed or is blocked on the root's lock. The act asserts the root is still the stale
    attempt's at that moment."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, stale: CheckpointManager,
                 owner: object, act: str, when: Callable[[Path], bool]):
        self.root, self.stale, self.blocked = root, stale, threading.Event()
        self.thread: threading.Thread | None = None
        real_flock, real_act = fcntl.flock, getattr(owner, act)

        def flock(fd: object, operation: int) -> None:  # notes that the claim waits for the lock
            try:
                real_flock(fd, operation | fcntl.LOCK_NB)
            except BlockingIOError:
                self.blocked.set()
                real_flock(fd, operation)

        def patched_act(path: os.PathLike, *args: object, **kwargs: object) -> object:
            if self.thread is None and when(Path(path)):
                self._claim()
            return real_act(path, *args, **kwargs)

        real_broadcast = dist.broadcast_object_list

        def broadcast(*args: object, **kwargs: object) -> None:  # the claim's rank has no one to tell
            if threading.current_thread() is not self.thread:
                real_broadcast(*args, **kwargs)

        monkeypatch.setattr(fcntl, "flock", flock)
        monkeypatch.setattr(owner, act, patched_act)
        monkeypatch.setattr(dist, "broadcast_object_list", broadcast)

    def _claim(self) -> None:
        self.thread = threading.Thread(target=claim_generation, args=(self.root, 0))
        self.thread.start()
        deadline = time.monotonic() + 30
        while self.thread.is_alive() and not self.blocked.is_set():
            assert time.monotonic() < deadline, "the other attempt's claim neither landed nor waited"
            time.sleep(0.01)
        owner = generation_owner(self.root)
        assert owner == self.stale.generation, \
            f"a claim (generation {owner}) came between the stale attempt's check and its act"

    def retry_generation(self) -> str:
        self.thread.join(timeout=30)
        return generation_owner(self.root)


def test_no_claim_comes_between_a_commits_check_and_its_rename(tmp_path: Path, process_group: None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The stale attempt commits only while the root is its own: a retry's claim waits for the
    rename, and the retry then sees the committed step."""
    _, _, state = trained_state(1)
    stale = manager(tmp_path, async_save=False, keep_last=5)
    claim = ClaimDuring(monkeypatch, tmp_path, stale, os, "replace",
                        lambda path: path.name.endswith(".partial"))
    try:
        stale.save(10, state, {"layout": {"world_size": 1}})
    except StaleGenerationError:
        pass  # the retry's claim came before the prune that follows the commit
    retry = claim.retry_generation()
    assert retry not in (None, stale.generation)
    manifest = json.loads((tmp_path / "step-00000010" / MANIFEST_NAME).read_text())
    assert manifest["generation"] == stale.generation
    assert verify_checkpoint(tmp_path / "step-00000010") == []


def test_no_claim_comes_between_a_prunes_check_and_its_removal(tmp_path: Path, process_group: None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale attempt never removes a checkpoint once a retry owns the root (it may be the one
    the retry resumes from)."""
    _, _, state = trained_state(1)
    stale = manager(tmp_path, async_save=False, keep_last=1)
    stale.save(10, state, {"layout": {"world_size": 1}})
    claim = ClaimDuring(monkeypatch, tmp_path, stale, shutil, "rmtree",
                        lambda path: path.name == "step-00000010")
    stale.save(20, state, {"layout": {"world_size": 1}})
    assert claim.retry_generation() not in (None, stale.generation)
    assert [c.step for c in committed_checkpoints(tmp_path)] == [20]


def test_no_claim_comes_between_a_releases_check_and_its_unlink(tmp_path: Path, process_group: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished attempt releasing the root never removes a retry's claim made meanwhile."""
    stale = manager(tmp_path, async_save=False)
    claim = ClaimDuring(monkeypatch, tmp_path, stale, Path, "unlink", lambda path: path.name == ".generation")
    stale.close()
    assert claim.retry_generation() not in (None, stale.generation)  # the retry's claim stands


def test_a_fenced_save_leaves_no_partial_behind(tmp_path: Path, process_group: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A retry claims the root while the stale attempt writes its save: the stale one stops at
    its commit and removes what it wrote (no later claim may come to clean it up)."""
    _, _, state = trained_state(1)
    stale = manager(tmp_path, async_save=False)
    real_save = dcp.save

    def save_while_a_retry_claims(*args: object, **kwargs: object) -> object:
        claim_generation(tmp_path, 0)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", save_while_a_retry_claims)
    with pytest.raises(StaleGenerationError):
        stale.save(10, state, {"layout": {"world_size": 1}})
    assert not list(tmp_path.glob(".step-*")) and not (tmp_path / "step-00000010").exists()


def test_the_persistent_tier_never_overwrites_a_committed_copy(tmp_path: Path) -> None:
    """Another attempt (on another node, its own local disk) uploaded step 10 already: this
    attempt's step 10 leaves that copy as it is."""
    tier_root = tmp_path / "tier" / "step-00000010"
    tier_root.mkdir(parents=True)
    (tier_root / "__0_0.distcp").write_text("theirs")
    (tier_root / MANIFEST_NAME).write_text('{"generation": "theirs"}')
    ours = tmp_path / "local" / "step-00000010"
    ours.mkdir(parents=True)
    (ours / "__0_0.distcp").write_text("ours")
    (ours / MANIFEST_NAME).write_text('{"generation": "ours"}')
    tier = PersistentTier((tmp_path / "tier").as_uri(), MANIFEST_NAME)
    tier.upload_later(ours)
    tier.close()
    assert (tier_root / "__0_0.distcp").read_text() == "theirs"
    assert (tier_root / MANIFEST_NAME).read_text() == '{"generation": "theirs"}'


def test_a_copy_in_the_persistent_tier_that_fails_its_manifest_is_never_resumed(
        tmp_path: Path, process_group: None, caplog: pytest.LogCaptureFixture) -> None:
    """Two uploads of one step at once can mix their files: such a copy is skipped when pulled."""
    tier = (tmp_path / "tier").as_uri()
    save_steps(tmp_path / "local", [10, 20], persistent_url=tier)
    shard = next((tmp_path / "tier" / "step-00000020").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")  # another attempt's file
    shutil.rmtree(tmp_path / "local")  # a new node: nothing on local disk
    _, _, state = trained_state(0)
    assert manager(tmp_path / "local", persistent_url=tier).load_latest(state).step == 10
    assert "skipping step-00000020 from" in caplog.text and "sha256 mismatch" in caplog.text


@pytest.mark.parametrize("async_save", [True, False])
def test_resume_restores_model_optimizer_and_rng_exactly(tmp_path: Path, process_group: None,
                                                          async_save: bool) -> None:
    model, optimizer, state = trained_state(7)
    saver = manager(tmp_path, async_save=async_save)
    torch.manual_seed(1234)
    saver.save(3, state | {"rng": RNGState(0)}, {"layout": {"world_size": 1}})
    expected_draw = torch.rand(3)
    saver.close()
    fresh_model, fresh_optimizer, fresh_state = trained_state(99)
    info = manager(tmp_path).load_latest(fresh_state | {"rng": RNGState(0)})
    assert torch.equal(torch.rand(3), expected_draw)
    assert info.step == 3
    for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    exp_avg = lambda opt: [s["exp_avg"] for s in opt.state.values()]  # noqa: E731
    for a, b in zip(exp_avg(optimizer), exp_avg(fresh_optimizer), strict=True):
        assert torch.equal(a, b)


def test_the_last_k_and_every_mth_are_kept(tmp_path: Path, process_group: None) -> None:
    save_steps(tmp_path, [10, 20, 30, 40, 50], keep_last=2, keep_every=20)
    assert [c.step for c in committed_checkpoints(tmp_path)] == [50, 40, 20]


def test_a_committed_step_is_never_overwritten(tmp_path: Path, process_group: None) -> None:
    save_steps(tmp_path, [10])
    _, _, state = trained_state(0)
    with pytest.raises(CheckpointError, match="step-00000010 exists: checkpoints are never overwritten"):
        manager(tmp_path).save(10, state, {})


def test_uncommitted_and_corrupt_checkpoints_are_skipped(tmp_path: Path, process_group: None,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    save_steps(tmp_path, [10, 20])
    (tmp_path / ".step-00000030.partial").mkdir()  # a crash mid-save: never a candidate
    shard = next((tmp_path / "step-00000020").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")
    assert latest_valid_checkpoint(tmp_path).step == 10
    assert "step-00000020" in caplog.text and "sha256 mismatch" in caplog.text
    _, _, state = trained_state(0)
    assert manager(tmp_path).load_latest(state).step == 10
    assert list(tmp_path.glob(".step-00000020.corrupt-*"))  # kept for inspection, out of the way


def test_checkpoint_of_another_configuration_is_refused(tmp_path: Path, process_group: None) -> None:
    save_steps(tmp_path, [10])
    _, _, state = trained_state(0)
    with pytest.raises(CheckpointError, match="another model/training/data configuration"):
        manager(tmp_path, fingerprint="other").load_latest(state)


def test_weights_load_into_a_plain_model_without_a_process_group(tmp_path: Path,
                                                                  process_group: None) -> None:
    model, _, state = trained_state(5)
    saver = manager(tmp_path)
    saver.save(1, state, {})
    saver.close()
    dist.destroy_process_group()
    try:
        plain = Transformer(ARGS)
        load_model_weights(plain, tmp_path / "step-00000001")
        for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True):
            assert torch.equal(a, b)
    finally:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg2'}", rank=0, world_size=1)
