"""Shared fixtures: every test runs on the debug config (configs/debug.yaml) with all outputs
redirected into a temporary directory, against a real local MLflow store. A session that leaves
a process behind fails, naming it (`no_process_left_behind`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from forgeline.configs.environment import apply_environment_defaults
from tests.processes import SESSION_ENV, describe, started_by_this_process, still_there, stop

apply_environment_defaults()  # forgeline's offline and telemetry defaults, before any test imports

from forgeline.configs import Config, load_config  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def mark_session() -> str:
    """Give this session's processes a mark of their own: SESSION_ENV, inherited by everything
    started from here on. A pytest-xdist worker's is its controller's with its id appended
    ("RUN/gw0"; the controller sets its own before starting the workers), so that each checks
    its own processes and the controller all of them."""
    inherited = os.environ.get(SESSION_ENV)
    own = os.environ.get("PYTEST_XDIST_WORKER") or uuid.uuid4().hex[:12]
    os.environ[SESSION_ENV] = f"{inherited}/{own}" if inherited else own
    return os.environ[SESSION_ENV]


SESSION = mark_session()
# Time for a process on its way out (a server answering SIGTERM) to go before it counts as left.
LEFTOVER_GRACE_S = 15


def leftovers() -> list[psutil.Process]:
    """What this session started that is still running."""
    return still_there(lambda: started_by_this_process(SESSION_ENV, SESSION), LEFTOVER_GRACE_S)


def leftover_report(processes: list[psutil.Process]) -> str:
    lines = "\n".join(f"  {describe(process)}" for process in processes)
    return (f"{len(processes)} process(es) this test session started are still running ({SESSION_ENV}="
            f"{SESSION}); stopped now. A test or fixture that starts a process must stop it:\n{lines}")


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """After the session's last test and every other fixture: no process it started is left, an
    error of the last test's teardown otherwise (under pytest-xdist, per worker)."""
    yield
    if found := leftovers():
        report = leftover_report(found)
        stop(found)
        pytest.fail(report, pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def local_dask_clusters_closed(no_process_left_behind: None) -> Iterator[None]:
    """A data build run in the test process keeps its local Dask cluster for the life of the
    process (tasks/data/executor.py), so that the next one need not start workers again: for the
    test file, then, closed at its end (before `no_process_left_behind` looks). Idle, its workers
    and scheduler took ~6 % of a core for the rest of the session, more than starting them again
    in the next file that builds."""
    yield
    from forgeline.tasks.data.executor import close_local_clusters

    close_local_clusters()


@pytest.fixture(autouse=True)
def environment_restored() -> Iterator[None]:
    """Each test leaves the process environment as it found it: what forgeline's code sets for its
    process (the console's quiet Prefect handler, a stage's variables), run here in-process, would
    otherwise reach every process a later test of this worker starts (its Dask workers' Prefect
    lines went missing in CI that way)."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """The controller of pytest-xdist workers checks once they are gone (xdist stops them in its
    own pytest_sessionfinish): what a worker left behind when it exited, the fixture of a worker
    that crashed; without xdist, anything started after the last fixture's teardown."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not (found := leftovers()):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    reporter.ensure_newline()
    reporter.write_sep("=", "processes left behind", red=True)
    reporter.write_line(leftover_report(found))
    stop(found)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The test files that hold a pytest-xdist worker longest, longest first: in `make test-slow` on
# the 2-core machine (bench/ci_durations.py of its log, 2026-12-07) test_dvc.py held one for 26
# min, test_families_layouts.py 9, and the next ones 3.5 to 6; in `make test`, test_pipeline_e2e,
# test_recovery, test_train and their like.
LONGEST_FIRST = ("integration/test_dvc.py", "integration/test_families_layouts.py",
                 "integration/test_dvc_inputs.py", "integration/test_promotion.py",
                 "integration/test_mlflow_ui.py", "integration/test_termination.py",
                 "integration/test_preemption.py", "integration/test_data_dask.py",
                 "integration/test_eval_identical_weights.py", "integration/test_tracking_outage.py",
                 "integration/test_init_from_smollm2.py", "integration/test_deployments.py",
                 "integration/test_init_from.py", "integration/test_preference.py",
                 "integration/test_reproduce.py", "integration/test_document_masking.py",
                 "integration/test_pipeline_e2e.py", "integration/test_parity.py",
                 "integration/test_recovery.py", "integration/test_eval_parity.py",
                 "integration/test_secrets_prefect.py", "integration/test_train.py",
                 "integration/test_job_retry.py")


def file_rank(item: pytest.Item) -> int:
    """Where a test's file runs: the longest files first, then the other integration files, then
    the unit files, whose seconds each fill in the end."""
    path = item.path.relative_to(REPO_ROOT / "tests").as_posix()
    if path in LONGEST_FIRST:
        return LONGEST_FIRST.index(path)
    return len(LONGEST_FIRST) + (0 if path.startswith("integration/") else 1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first. Under `--dist loadfile` a file runs whole on one worker, handed out in
    this order (the Makefile's --no-loadscope-reorder keeps xdist from ordering by number of
    tests, which put the one-test files that take minutes last): a long file started last kept the
    other worker idle for minutes (test_pipeline_e2e's 8 min at the end of a CI run), where the
    unit files' short tests now end the run on both workers. Within a file, the order is kept."""
    items.sort(key=file_rank)


def skip_reason(report: pytest.TestReport) -> str:
    """The reason a skipped test gave (pytest keeps it as (path, line, "Skipped: reason"))."""
    if isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")
    return str(report.longrepr)


def skipped_by_reason(reports: list[pytest.TestReport]) -> dict[str, list[str]]:
    """The skipped tests' ids grouped by their reason, the largest group first."""
    groups: dict[str, list[str]] = {}
    for report in reports:
        groups.setdefault(skip_reason(report), []).append(report.nodeid)
    return dict(sorted(groups.items(), key=lambda group: -len(group[1])))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """List every skipped test by reason at the end of the run: a test that needs root, network
    namespaces, a tmpfs mount, native bf16 or a package this machine lacks skips, and a green run
    must not hide the paths it did not test."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.write_sep("=", f"{len(skipped)} skipped: not tested on this machine", yellow=True)
    for reason, nodeids in skipped_by_reason(skipped).items():
        terminalreporter.write_line(f"{reason} ({len(nodeids)}):")
        for nodeid in nodeids:
            terminalreporter.write_line(f"    {nodeid}")


def output_overrides(root: Path) -> list[str]:
    return [
        f"data.out_dir={root / 'data'}",
        f"data.raw_dir={root / 'raw'}",
        f"train.out_dir={root / 'train'}",
        f"eval.out_dir={root / 'eval'}",
        f"registry.out_dir={root / 'register'}",
        f"registry.tracking_uri=sqlite:///{root / 'mlflow.db'}",
        f"registry.artifact_location={root / 'mlartifacts'}",
        f"ops.tracking_spool={root / 'tracking-spool'}",
        f"ops.log_dir={root / 'logs'}",
    ]


def debug_config(root: Path, *overrides: str) -> Config:
    return load_config("debug.yaml", output_overrides(root) + list(overrides))


@pytest.fixture(scope="session")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The debug data stage, built once per session (read-only for tests)."""
    from forgeline.tasks.data.build import build_dataset

    root = tmp_path_factory.mktemp("shared")
    build_dataset(debug_config(root))
    return root


def random_lm(tokenizer: Path, bundle_dir: Path, max_seq_len: int, batch_size: int):
    """A `forgeline` lm-eval model over a tiny randomly initialized model (fixed seed), loaded
    from an inference bundle the way a user's would be."""
    from forgeline.configs.schema import ModelConfig
    from forgeline.eval.lm import ForgelineLM  # lm-eval: imported by the tests that need it only
    from forgeline.model.inference import save_bundle
    from forgeline.model.transformer import Transformer

    model = Transformer(ModelConfig(vocab_size=512, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    ffn_dim=64, max_seq_len=max_seq_len))
    model.init_weights(0)
    save_bundle(model, bundle_dir)
    return ForgelineLM(bundle=str(bundle_dir), tokenizer=str(tokenizer), batch_size=batch_size)
