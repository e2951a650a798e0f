import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from forgeline.configs import ConfigError, load_config
from forgeline.flows.cli import main
from forgeline.tasks.stage import STAGE_NAMES

FORGELINE = str(Path(sys.executable).parent / "forgeline")


@pytest.mark.parametrize("verb", [[], ["run"], ["stage"], ["status"], ["stages"], ["config"],
                                  ["config", "show"], ["plan"]],
                         ids=lambda v: " ".join(v) or "forgeline")
def test_every_verb_has_help(verb: list[str]) -> None:
    done = subprocess.run([FORGELINE, *verb, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: forgeline" in done.stdout


def test_stage_help_lists_the_four_stages() -> None:
    done = subprocess.run([FORGELINE, "stage", "--help"], capture_output=True, text=True, timeout=60)
    assert all(name in done.stdout for name in STAGE_NAMES)


def test_bad_config_fails_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--set", "parallel.tp=3"]) == 2
    assert "parallel.tp=3 must divide model.n_heads=8" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no artifacts, no MLflow store, nothing


def test_stage_with_unknown_key_fails_with_exit_code_2(capsys: pytest.CaptureFixture) -> None:
    assert main(["stage", "eval", "--set", "eval.limt=3"]) == 2
    assert "eval.limt: unknown key" in capsys.readouterr().err


def test_config_show_prints_the_resolved_config(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "show", "--config", "debug.yaml", "--set", "train.steps=7"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["train"]["steps"] == 7 and shown["model"]["dim"] == 64


def test_config_docs_cover_every_section(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "show", "--docs"]) == 0
    out = capsys.readouterr().out
    for section in ("data", "model", "parallel", "train", "checkpoint", "eval", "registry"):
        assert f"\n{section}:" in f"\n{out}"


def test_stage_without_its_upstream_output_fails_before_any_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["stage", "eval", "--config", "debug.yaml"]) == 2
    err = capsys.readouterr().err
    assert "stage 'eval' reads the output of data, train, which is missing" in err
    assert "run `forgeline stage data` first" in err
    assert list(tmp_path.iterdir()) == []


def test_plan_writes_a_config_the_launch_takes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "planned.yaml"
    assert main(["plan", "--config", "tiny.yaml", "--nodes", "1", "--accelerators-per-node", "8",
                 "--memory-gib", "80", "--write-config", str(out)]) == 0
    report = capsys.readouterr().out
    assert "layout                  TP=1 PP=1 DP=8" in report and "Young" in report
    planned = load_config(out)
    assert (planned.parallel.tp, planned.parallel.pp, planned.parallel.dp_shard) == (1, 1, 8)
    assert planned.model == load_config("tiny.yaml").model


def test_plan_across_nodes_leaves_the_rendezvous_to_the_user_and_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "p.yaml"
    assert main(["plan", "--nodes", "4", "--accelerators-per-node", "8", "--memory-gib", "80",
                 "--global-batch", "64", "--write-config", str(out)]) == 0
    said = "the layout spans 4 nodes: set parallel.rdzv_endpoint to the HOST:PORT of a rendezvous"
    assert said in capsys.readouterr().out and out.read_text().startswith(f"# {said}")
    with pytest.raises(ConfigError, match="parallel: nnodes=4 needs rdzv_endpoint"):
        load_config(out)
    layout = load_config(out, ["parallel.rdzv_endpoint=node0:29400"]).parallel
    assert (layout.nnodes, layout.world_size) == (4, 32)


def closed_port_url() -> str:
    """The URL of a Prefect API that nothing answers: a port just bound and released."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/api"


def pending_record(api_url: str, state: str = "COMPLETED"):
    from forgeline.flows.orchestrator import PendingStates

    return PendingStates(api_url=api_url, flow_run_id=str(uuid.uuid4()), flow_name="forgeline-train",
                         state=state, message="", finished_at="2026-01-01T00:00:00+00:00", pid=os.getpid(),
                         task_runs=[{"id": str(uuid.uuid4()), "name": "train", "state": state}])


def test_sync_with_nothing_pending_says_so_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["sync"]) == 0
    assert "flow states: none pending in .forgeline/pending" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_a_pending_flow_state_round_trips_and_waits_while_its_api_is_unreachable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from forgeline.flows.orchestrator import PendingStates, forget, pending_records, unreported_record

    monkeypatch.chdir(tmp_path)
    started = time.time()
    record = pending_record(closed_port_url())
    path = record.write()
    assert path == Path(".forgeline", "pending", f"{record.flow_run_id}.json")
    assert PendingStates.read(path) == record and pending_records() == [record]
    assert unreported_record(started) == record  # written by this process since the flow started

    assert main(["sync"]) == 1  # the API does not answer: the record stays for the next sync
    out = capsys.readouterr().out
    assert f"flow run {record.flow_run_id} (forgeline-train) still pending: the Prefect API at" in out
    assert "did not take it (ConnectError" in out
    assert pending_records() == [record]

    forget(record.flow_run_id)
    assert list(tmp_path.iterdir()) == []  # no empty .forgeline/ left in a checkout


def test_the_message_lists_the_stages_a_rerun_skips(tmp_path: Path) -> None:
    import httpx

    from forgeline.flows.cli import unreported_message
    from forgeline.tasks.stage import pipeline_stages
    from tests.conftest import debug_config

    record = pending_record("http://127.0.0.1:1/api", state="FAILED")
    cfg = debug_config(tmp_path)
    message = unreported_message(record, httpx.ConnectError("refused"), pipeline_stages(cfg), cfg)
    assert ("finished: none, not finished: data, train, eval, register (a rerun skips the finished ones"
            in message)
    assert f"flow run {record.flow_run_id} (forgeline-train) stays Running" in message
    assert "reports it Failed once the API is back" in message


def test_api_errors_log_one_line() -> None:
    import httpx

    from forgeline.flows.orchestrator import QuietApiErrors

    try:
        raise httpx.ConnectError("refused")
    except httpx.ConnectError:
        failed = logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "Encountered %r", ("x",),
                                   sys.exc_info())
    service = logging.LogRecord("prefect._internal.concurrency", logging.ERROR, __file__, 1,
                                "Service %r failed to process item %r",
                                ("EventsWorker", SimpleNamespace(event="prefect.task-run.Completed")), None)
    assert QuietApiErrors().filter(failed) and QuietApiErrors().filter(service)
    assert failed.exc_info is None
    assert service.getMessage() == ("Service 'EventsWorker' failed to process item "
                                    "'prefect.task-run.Completed'")
