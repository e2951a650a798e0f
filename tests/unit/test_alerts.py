"""Training alerts: the rank's line round-trips through the launcher's parser, the forwarder
rate-limits per kind (a fake clock) and counts what it held back, and a notification that cannot
go out -- a dead webhook, a block that does not load, one that hangs -- costs a warning only."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import pytest
from prefect.blocks.notifications import CustomWebhookNotificationBlock

from forgeline.configs.schema import TrainConfig
from forgeline.model.training.alerts import ALERT_PREFIX, emit_alert, make_alert, parse_alert
from forgeline.model.training.callbacks import StabilityCallback, TrainingUnstable
from forgeline.tasks.train.alerts import AlertForwarder
from tests.integration.helpers import free_port


class FakeBlock:
    def __init__(self) -> None:
        self.posts: list[tuple[str, str]] = []

    def notify(self, body: str, subject: str | None = None) -> None:
        self.posts.append((subject, body))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def forwarder(block: object, interval_s: float = 60.0, clock: FakeClock | None = None,
              **kwargs: object) -> AlertForwarder:
    return AlertForwarder("custom-webhook/alerts", interval_s, "train.out_dir=/tmp/run",
                          clock=clock or FakeClock(), load=lambda name: block, **kwargs)


def test_an_emitted_alert_parses_back_whole(capsys: pytest.CaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    emit_alert("nonfinite", "non-finite loss or gradient: update skipped (1 in a row)", step=12)
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith(ALERT_PREFIX)
    alert = parse_alert(line)
    assert (alert.kind, alert.rank, alert.host, alert.step) == ("nonfinite", 3, socket.gethostname(), 12)
    assert alert.message.endswith("(1 in a row)") and abs(alert.time - time.time()) < 60
    assert parse_alert("[rank0]: 0: " + line) == alert  # a launcher's label before it
    straggler = make_alert("straggler", "slow", step=5, rank=1, host="node-b")
    assert parse_alert(straggler.line()) == straggler  # about another rank and host than the emitter's


@pytest.mark.parametrize("line", ["step 5/20  loss 3.2", ALERT_PREFIX + "{not json",
                                  ALERT_PREFIX + '{"kind": "nonfinite"}',
                                  make_alert("rollback", "x").line().replace('"rollback"', '"coffee"')])
def test_other_lines_are_no_alerts(line: str) -> None:
    assert parse_alert(line) is None


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="none of nonfinite, rollback"):
        make_alert("coffee", "x")  # type: ignore[arg-type]


class FakeMetrics:
    def log_event(self, step: int, message: str, counters: dict[str, float]) -> None:
        pass


@pytest.mark.parametrize("rank", [0, 1])
def test_stability_decisions_are_alerted_by_rank_0_only(rank: int, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    stability = StabilityCallback(TrainConfig(), None, {}, FakeMetrics(), tmp_path / "unstable.json",
                                  fingerprint="f", rank=rank)
    stability._event(14, "rollback", "rolled back to step 10")
    with pytest.raises(TrainingUnstable):
        stability._give_up(15, "loss spike; rollback limit train.max_rollbacks=3 reached")
    alerts = [parse_alert(line) for line in capsys.readouterr().out.splitlines()]
    if rank:
        assert alerts == []
    else:
        assert [(a.kind, a.step, a.rank) for a in alerts] == [("rollback", 14, 0), ("unstable", 15, 0)]
        assert alerts[1].message == ("training gave up: loss spike; rollback limit train.max_rollbacks=3 "
                                     "reached")


def test_one_post_per_kind_per_interval_and_the_held_back_are_counted() -> None:
    block, clock = FakeBlock(), FakeClock()
    alerts = forwarder(block, interval_s=60, clock=clock)
    for step in (12, 13, 14):  # three non-finite steps in a row: one post, two held back
        alerts.on_line(make_alert("nonfinite", f"skipped ({step - 11} in a row)", step=step, rank=0).line())
        clock.now += 1
    alerts.on_line(make_alert("rollback", "rolled back to step 10", step=14, rank=0).line())  # its own kind
    clock.now += 60
    alerts.on_line(make_alert("nonfinite", "skipped (1 in a row)", step=30, rank=0).line())  # carries the 2
    alerts.on_line(make_alert("nonfinite", "skipped (2 in a row)", step=31, rank=0).line())  # held back
    alerts.report("hang", "no step progress for 5 s", rank=1, host="node-b")
    alerts.on_line("an ordinary line")
    alerts.close()  # the one held back: a summary
    subjects = [subject for subject, _ in block.posts]
    host = socket.gethostname()
    assert subjects == [f"forgeline alert: nonfinite on rank 0 ({host}) at step 12",
                        f"forgeline alert: rollback on rank 0 ({host}) at step 14",
                        f"forgeline alert: nonfinite on rank 0 ({host}) at step 30",
                        "forgeline alert: hang on rank 1 (node-b)",
                        "forgeline alert: 1 alert(s) held back until the end of the job"]
    first, _, carrying, hang, summary = (body for _, body in block.posts)
    assert first.startswith("nonfinite: skipped (1 in a row)\nrank 0 on host ") and "held back" not in first
    assert "run train.out_dir=/tmp/run" in first
    assert "2 more nonfinite alert(s) were held back since the last (ops.alert_interval_s=60)" in carrying
    assert "rank 1 on host node-b" in hang
    assert summary.startswith(f"1 nonfinite, the last: rank 0 on host {host} at step 31")


def test_a_hang_names_every_rank_whose_watchdog_fired() -> None:
    block = FakeBlock()
    alerts = forwarder(block, interval_s=0)
    alerts.report_hang([0, 1], timeout_s=5)
    alerts.close()
    host = socket.gethostname()
    assert [s for s, _ in block.posts] == [f"forgeline alert: hang on rank {r} ({host})" for r in (0, 1)]
    assert block.posts[0][1].startswith("hang: made no step progress for 5 s (train.hang_timeout_s), nor did "
                                        "rank(s) 1: one is stuck, the others wait on it; the threads")


def test_without_a_block_nothing_is_posted() -> None:
    def load(name: str) -> None:
        raise AssertionError("no block to load")

    alerts = AlertForwarder("", 0, "run", load=load)
    alerts.on_line(make_alert("rollback", "x").line())
    alerts.report("hang", "x", rank=0)
    alerts.close()
    assert alerts._poster is None


def test_a_dead_webhook_costs_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    dead = CustomWebhookNotificationBlock(name="forgeline", url=f"http://127.0.0.1:{free_port()}/hook",
                                          allow_private_urls=True, json_data={"text": "{{subject}}"})
    alerts = forwarder(dead, interval_s=0)
    alerts.on_line(make_alert("rollback", "rolled back", step=3).line())
    alerts.on_line(make_alert("rollback", "rolled back again", step=9).line())
    alerts.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("could not post 'forgeline alert: rollback" in w for w in warnings)
    assert "ConnectError" in warnings[0]


def test_a_block_that_does_not_load_costs_a_warning_and_is_tried_again(
        caplog: pytest.LogCaptureFixture) -> None:
    block, tries = FakeBlock(), []

    def load(name: str) -> FakeBlock:
        tries.append(name)
        if len(tries) == 1:
            raise ValueError(f"Unable to find block document named {name}")
        return block

    alerts = AlertForwarder("custom-webhook/alerts", 0, "run", load=load)
    alerts.report("hang", "stuck", rank=1)
    alerts.report("hang", "stuck again", rank=1)
    alerts.close()
    assert "Unable to find block document" in caplog.text
    assert len(tries) == 2
    assert [s for s, _ in block.posts] == [f"forgeline alert: hang on rank 1 ({socket.gethostname()})"]


class GatedBlock:
    """A block whose posts hang until the test opens the gate (at most GATE_S: code that waited
    on a post would see it finish, and the assertions on `posts` would fail, not hang)."""

    GATE_S = 60.0

    def __init__(self) -> None:
        self.posts: list[tuple[str, str]] = []
        self.gate = threading.Event()

    def notify(self, body: str, subject: str | None = None) -> None:
        self.gate.wait(self.GATE_S)
        self.posts.append((subject, body))


def test_the_caller_never_waits_on_a_post_and_close_waits_a_bounded_time(
        caplog: pytest.LogCaptureFixture) -> None:
    # Shown by order, not by a wall-clock figure a loaded machine could miss: every call returns
    # while the posts it made are still held at the gate.
    block = GatedBlock()
    alerts = forwarder(block, interval_s=0, close_timeout_s=0.5)
    try:
        for step in range(5):
            alerts.on_line(make_alert("straggler", "slow", step=step, rank=1, host="node-b").line())
        assert block.posts == []
        alerts.close()
        assert block.posts == []
    finally:
        block.gate.set()
    # One in flight, four waiting; the poster (a daemon) is left to its post.
    assert "gave up on 5 training alert(s) to custom-webhook/alerts not posted within 0.5 s" in caplog.text
    # Released, it posts them and ends: its log lines must not outlive the test's streams.
    alerts._poster.join(30)
    assert len(block.posts) == 5 and not alerts._poster.is_alive()
