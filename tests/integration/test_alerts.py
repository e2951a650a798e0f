"""Training alerts reach the notification block of `ops.notify_block`, naming rank and host: a
real train stage (two torchrun ranks) whose weights turn NaN (non-finite steps, a rollback) and
whose rank 1 hangs (the watchdog; the launcher reports it), posting through a real
CustomWebhookNotificationBlock saved in a real (temporary) Prefect API to an HTTP server on
127.0.0.1 -- at most one post per kind per ops.alert_interval_s, the rest counted. And a
straggler is alerted by rank 0 with the slow rank's own host (gloo ranks on "two hosts")."""

from __future__ import annotations

import argparse
import contextlib
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from forgeline.model.parallel.mesh import init_distributed
from forgeline.model.training.alerts import parse_alert
from forgeline.model.training.metrics import MetricsLogger
from tests.conftest import REPO_ROOT, debug_config
from tests.integration.helpers import run_ranks

# prefect_test_harness is the API here, as for a machine with no server of its own.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("temporary_prefect_api")]


@pytest.fixture(autouse=True)
def fault_callbacks_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # rank processes import tests.faults


def faults(root: Path) -> str:
    entries = [{"path": "tests.faults:ScaleWeightsBefore",
                "args": {"step": 12, "factor": float("nan"), "once": str(root / "nan.fired")}},
               {"path": "tests.faults:HangBefore",
                "args": {"step": 17, "rank": 1, "once": str(root / "hang.fired")}}]
    return "train.callbacks=" + yaml.safe_dump(entries, default_flow_style=True, width=10**6).strip()


@pytest.mark.slow
def test_alerts_post_to_the_block_naming_rank_and_host_once_per_kind_per_interval(
        data_root: Path, tmp_path: Path, webhook: tuple[str, list[dict]]) -> None:
    # Here, not above: the module is also the straggler test's rank program, which needs neither.
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.testing.utilities import prefect_test_harness

    from forgeline.tasks.train.job import train_model

    url, received = webhook
    cfg = debug_config(tmp_path, f"data.out_dir={data_root / 'data'}", "train.steps=20",
                       "checkpoint.every_steps=10", "train.peak_tflops=1", "parallel.dp_shard=2",
                       "train.hang_timeout_s=5", "ops.notify_block=custom-webhook/alerts",
                       "ops.alert_interval_s=3600", faults(tmp_path))
    with prefect_test_harness(server_startup_timeout=180):  # 30 s by default: too short on 2 busy cores
        block = CustomWebhookNotificationBlock(name="forgeline", url=url, allow_private_urls=True,
                                               json_data={"subject": "{{subject}}", "body": "{{body}}"})
        block.save("alerts")
        result = train_model(cfg)
    assert result.step == 20 and result.failures  # rolled back, restarted after the hang, finished

    host = socket.gethostname()
    posts = {post["subject"]: post["body"] for post in received}
    assert len(posts) == len(received)
    # Non-finite steps 12, 13 and 14: one post, the other two held back (and counted at the end).
    first = f"forgeline alert: nonfinite on rank 0 ({host}) at step 12"
    assert [s for s in posts if " nonfinite " in s] == [first]
    assert "non-finite loss or gradient: update skipped (1 in a row)" in posts[first]
    assert f"rank 0 on host {host} at step 12" in posts[first]
    assert f"train.out_dir={tmp_path / 'train'}" in posts[first]
    rollback = posts[f"forgeline alert: rollback on rank 0 ({host}) at step 14"]
    assert "rolled back to step 10 after 3 consecutive non-finite steps" in rollback
    # Both ranks' watchdogs fire (the hung rank 1 and rank 0, which waits on it): one post, one held.
    [hang] = [s for s in posts if " hang " in s]
    assert hang in {f"forgeline alert: hang on rank {rank} ({host})" for rank in (0, 1)}
    assert "made no step progress for 5 s (train.hang_timeout_s)" in posts[hang]
    [summary] = [body for s, body in posts.items() if s.endswith("held back until the end of the job")]
    assert f"2 nonfinite, the last: rank 0 on host {host} at step 14" in summary
    assert "1 hang, the last: rank " in summary


def test_a_straggler_is_alerted_with_the_slow_ranks_host(tmp_path: Path) -> None:
    out = tmp_path / "rank0.out"
    run_ranks("tests.integration.test_alerts", 2, ["--out", str(out)], REPO_ROOT)
    [alert] = [a for a in map(parse_alert, out.read_text().splitlines()) if a is not None]
    assert (alert.kind, alert.rank, alert.host, alert.step) == ("straggler", 1, "node-b", 5)
    assert alert.message == "rank 1 on node-b averages 1.000s per step, 82% above the median 0.550s"


def rank_main(argv: list[str] | None = None) -> None:
    """The ranks of the straggler test: rank 1, "on node-b", takes 10x longer per step; rank 0's
    output goes to --out."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    _, rank, _ = init_distributed()
    if rank == 1:
        socket.gethostname = lambda: "node-b"
    try:
        with open(args.out if rank == 0 else "/dev/null", "w") as out, contextlib.redirect_stdout(out):
            metrics = MetricsLogger(None, rank, log_every=5, total_steps=5, flops_per_step=1.0,
                                    peak_flops=1.0, device=torch.device("cpu"))
            for step in range(1, 6):
                metrics.log_step(step, {"loss": 2.0, "step_time_s": 1.0 if rank == 1 else 0.1})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_main()
