"""The promotion lock and the records it protects, on a real sqlite registry: what a decision
names it was made against, a promotion that died between moving the alias and recording it, a
held lock, an expired one broken exactly once, and a lease that ran out. Concurrent promotions
from separate processes, against sqlite and a tracking server: tests/integration/
test_promotion_concurrency.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from forgeline.configs import Config
from forgeline.tasks import promote as gate
from forgeline.tasks.pretrained import COMPLETE, REGISTRATION_TAG
from forgeline.tasks.promote import (
    CHAMPION_ALIAS,
    DECISION_TAG,
    LOCK_EXPIRES_TAG,
    LOCK_HOLDER_TAG,
    LOCK_LEASE_S,
    LOCK_SUFFIX,
    PENDING_TAG,
    LockHolder,
    PromotionLockError,
    aliased,
    break_lock,
    promote,
)
from tests.unit.conftest import sqlite_registry

LOCK = "m" + LOCK_SUFFIX


@pytest.fixture
def registry(tmp_path: Path, empty_store: Path) -> tuple[Config, MlflowClient]:
    """Model `m` with versions 1 and 2, complete, in a sqlite registry."""
    return sqlite_registry(tmp_path, empty_store, {REGISTRATION_TAG: COMPLETE})


def decision_of(client: MlflowClient, version: str) -> str | None:
    return client.get_model_version("m", version).tags.get(DECISION_TAG)


def registered_models(client: MlflowClient) -> list[str]:
    return sorted(model.name for model in client.search_registered_models())


def hold_lock(client: MlflowClient, token: str, expires: float) -> None:
    client.create_registered_model(LOCK, tags={LOCK_HOLDER_TAG: f"elsewhere pid 1 token {token}",
                                               LOCK_EXPIRES_TAG: str(expires)})


def test_the_first_champion_and_a_forced_move_say_what_they_were_decided_against(registry) -> None:
    cfg, client = registry
    assert promote(cfg, client, "1").describe() == "m version 1 is now @champion (no champion before)"
    assert decision_of(client, "1") == "promoted: no champion before"
    assert promote(cfg, client, "2", force=True).promoted
    assert decision_of(client, "2") == "promoted: forced over version 1"
    assert str(aliased(client, "m", CHAMPION_ALIAS).version) == "2"
    # Asked again, the champion keeps its decision: nothing was decided.
    assert promote(cfg, client, "2").describe() == "m version 2 is already @champion"
    assert decision_of(client, "2") == "promoted: forced over version 1"
    assert registered_models(client) == ["m"]  # the lock is gone


def test_a_promotion_that_died_after_moving_the_alias_is_recorded_by_the_next(registry) -> None:
    cfg, client = registry
    promote(cfg, client, "1")
    pending = "promoted: versus version 1; overall +0.2000 [+0.1000, +0.3000] on 300 shared items"
    client.set_model_version_tag("m", "2", PENDING_TAG, pending)
    client.set_registered_model_alias("m", CHAMPION_ALIAS, "2")  # and then the process died
    assert decision_of(client, "2") is None
    assert promote(cfg, client, "2").describe() == "m version 2 is already @champion"
    tags = client.get_model_version("m", "2").tags
    assert tags[DECISION_TAG] == pending and PENDING_TAG not in tags


def test_a_held_lock_is_waited_for_and_an_expired_one_is_broken_once(
        registry, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, client = registry
    hold_lock(client, "t1", time.time() + LOCK_LEASE_S)
    monkeypatch.setattr(gate, "LOCK_WAIT_S", 2.0)
    held = f"the promotion lock {LOCK} in the registry at .* is held by elsewhere pid 1 token t1 until"
    with pytest.raises(PromotionLockError, match=held):
        promote(cfg, client, "1")
    assert aliased(client, "m", CHAMPION_ALIAS) is None and decision_of(client, "1") is None

    # Its holder died: once its lease has ended, the lock is broken -- renamed after its holder.
    client.set_registered_model_tag(LOCK, LOCK_EXPIRES_TAG, str(time.time() - 1))
    stale = LockHolder.of(client.get_registered_model(LOCK))
    assert promote(cfg, client, "1").promoted
    tombstone = f"{LOCK}.expired-t1"
    assert registered_models(client) == ["m", tombstone]

    # A second waiter that read the same expired lock cannot break the lock of the next holder.
    hold_lock(client, "t2", time.time() + LOCK_LEASE_S)
    break_lock(client, LOCK, stale)
    assert client.get_registered_model(LOCK).tags[LOCK_HOLDER_TAG] == "elsewhere pid 1 token t2"

    # A lease after the broken lock's ended, its tombstone goes with the next promotion.
    client.delete_registered_model(LOCK)
    client.set_registered_model_tag(tombstone, LOCK_EXPIRES_TAG, str(time.time() - LOCK_LEASE_S - 1))
    assert promote(cfg, client, "2", force=True).promoted
    assert registered_models(client) == ["m"]


def test_a_lease_that_ran_out_records_nothing(registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder past half its lease may have had its lock broken: it writes nothing more."""
    cfg, client = registry
    monkeypatch.setattr(gate, "LOCK_LEASE_S", 0.0)
    with pytest.raises(PromotionLockError, match="held for more than half its lease"):
        promote(cfg, client, "1")
    assert aliased(client, "m", CHAMPION_ALIAS) is None
    assert client.get_model_version("m", "1").tags == {REGISTRATION_TAG: COMPLETE}
