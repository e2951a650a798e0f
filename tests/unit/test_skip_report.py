"""The end of a test run lists what it skipped, by reason (tests/conftest.py,
pytest_terminal_summary): a green run does not hide the paths this machine could not test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

SKIPPING_TESTS = '''
import pytest

needs_root = pytest.mark.skipif(True, reason="not root: the code runs as the caller's uid")


def test_runs():
    pass


@needs_root
def test_sandbox_uid():
    pass


@needs_root
@pytest.mark.parametrize("level", ["full", "baseline"])
def test_sandbox_processes(level):
    pass


def test_bf16():
    pytest.skip("train.precision=bf16 is refused on a CPU without native bf16")
'''


def test_a_run_ends_with_its_skipped_tests_grouped_by_reason(tmp_path: Path) -> None:
    hook = "from tests.conftest import pytest_terminal_summary  # noqa: F401\n"
    (tmp_path / "conftest.py").write_text(hook)
    (tmp_path / "test_skipping.py").write_text(SKIPPING_TESTS)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                          str(tmp_path), str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    heading = "4 skipped: not tested on this machine"
    assert heading in run.stdout, run.stdout
    summary = run.stdout[run.stdout.index(heading):]
    assert summary.splitlines()[1:7] == [
        "not root: the code runs as the caller's uid (3):",
        "    test_skipping.py::test_sandbox_uid",
        "    test_skipping.py::test_sandbox_processes[full]",
        "    test_skipping.py::test_sandbox_processes[baseline]",
        "train.precision=bf16 is refused on a CPU without native bf16 (1):",
        "    test_skipping.py::test_bf16",
    ]
