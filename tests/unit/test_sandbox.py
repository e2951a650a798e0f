"""The sandbox for generated code: limits that hold on any machine, and the namespace and uid
isolation where this machine allows it (root here, so all of it; skipped with a reason where not)."""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from forgeline.eval import sandbox
from forgeline.eval.sandbox import Isolation, Limits, isolation, run_python

# Runs that must finish get a timeout a loaded machine keeps; the timeout's kill is tested on its own.
FAST = Limits(timeout_s=30.0, cpu_s=4)
# The kill and the reaping after a timeout take milliseconds; a loaded 2-core machine may delay them
# by seconds, never by this much.
KILL_MARGIN_S = 20.0
FULL = isolation()
needs_namespaces = pytest.mark.skipif(not FULL.namespaces, reason="unshare of net/pid/mount not allowed here")
needs_uid = pytest.mark.skipif(FULL.uid is None, reason="not root: the code runs as the caller's uid")


@pytest.fixture(params=["full", "baseline"])
def level(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Isolation:
    """`full`: what this machine allows; `baseline`: no namespaces, the caller's uid -- the
    guarantees every machine gets."""
    if request.param == "baseline":
        monkeypatch.setattr(sandbox, "isolation", lambda: Isolation(
            namespaces=False, user_namespace=False, uid=None, python=sys.executable, unshare=None))
    return sandbox.isolation()


def test_the_probe_skips_a_level_that_cannot_run_code(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = replace(FULL, python="/nonexistent/python3")
    missing = replace(FULL, namespaces=False, python="/nonexistent/python3")  # Popen itself fails
    monkeypatch.setattr(sandbox, "_candidates", lambda: [broken, missing, FULL])
    assert sandbox.isolation.__wrapped__() == FULL
    monkeypatch.setattr(sandbox, "_candidates", lambda: [broken, missing])
    with pytest.raises(sandbox.SandboxError, match="no sandbox level can run"):
        sandbox.isolation.__wrapped__()


def processes_with(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def test_passing_code_passes_and_output_comes_back(level: Isolation) -> None:
    result = run_python("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\nprint('ok')\n", FAST)
    assert result.passed and result.stdout == "ok\n" and not result.timed_out


def test_a_failing_assert_fails(level: Isolation) -> None:
    result = run_python("assert 1 + 1 == 3, 'arithmetic'\n", FAST)
    assert not result.passed and result.returncode == 1 and "AssertionError: arithmetic" in result.stderr


def test_a_syntax_error_fails(level: Isolation) -> None:
    assert not run_python("def f(:\n", FAST).passed


def test_an_infinite_loop_is_killed_at_the_timeout(level: Isolation) -> None:
    limits = Limits(timeout_s=1.5, cpu_s=60)
    result = run_python("while True:\n    pass\n", limits)
    assert result.timed_out and not result.passed
    assert limits.timeout_s <= result.seconds < limits.timeout_s + KILL_MARGIN_S


def test_cpu_time_is_limited(level: Isolation) -> None:
    result = run_python("while True:\n    pass\n", Limits(timeout_s=60.0, cpu_s=1))
    assert not result.timed_out and not result.passed  # SIGXCPU, long before the wall clock


def test_a_memory_bomb_is_stopped(level: Isolation) -> None:
    result = run_python("x = bytearray(8 << 30)\n", replace(FAST, memory_mb=256))
    assert not result.passed and "MemoryError" in result.stderr
    grow = "xs = []\nwhile True:\n    xs.append(' ' * (1 << 20))\n"
    result = run_python(grow, replace(FAST, memory_mb=256))
    assert not result.passed and not result.timed_out and "MemoryError" in result.stderr


def test_file_size_and_output_flood_are_limited(level: Isolation) -> None:
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
                        replace(FAST, file_size_mb=1))
    assert not result.passed and not result.timed_out and len(result.stdout) <= 20_000


def test_children_die_with_the_run(level: Isolation) -> None:
    marker = f"forgeline-sandbox-child-{uuid.uuid4().hex}"
    code = ("import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
            "print('started')\n")
    result = run_python(code, FAST)
    assert result.passed and result.stdout == "started\n"
    time.sleep(0.2)
    assert processes_with(marker) == []


def test_a_timed_out_run_takes_its_children_along(level: Isolation) -> None:
    marker = f"forgeline-sandbox-child-{uuid.uuid4().hex}"
    code = ("import subprocess, sys, time\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
            "time.sleep(60)\n")
    result = run_python(code, replace(FAST, timeout_s=1.0))
    assert result.timed_out
    time.sleep(0.2)
    assert processes_with(marker) == []


@needs_namespaces
def test_a_child_that_leaves_the_process_group_dies_too() -> None:
    marker = f"forgeline-sandbox-child-{uuid.uuid4().hex}"
    code = ("import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}],\n"
            "                 start_new_session=True)\n")
    assert run_python(code, FAST).passed
    time.sleep(0.2)
    assert processes_with(marker) == []


@pytest.mark.skipif(not FULL.limits_processes, reason="RLIMIT_NPROC needs a uid or user namespace of its own")
def test_a_fork_bomb_is_capped_and_killed() -> None:
    marker = f"forgeline-sandbox-bomb-{uuid.uuid4().hex}"
    code = (f"# {marker}\nimport os, time\ncount = 0\nfor _ in range(10_000):\n"
            "    try:\n        if os.fork() == 0:\n            time.sleep(60)\n"
            "            os._exit(0)\n        count += 1\n"
            "    except OSError:\n        break\nprint(count)\n")
    result = run_python(code, replace(FAST, max_processes=8))
    assert result.passed and int(result.stdout) < 8
    forever = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    limits = Limits(timeout_s=1.5, cpu_s=10, max_processes=8)
    result = run_python(forever, limits)
    assert result.timed_out and result.seconds < limits.timeout_s + KILL_MARGIN_S


def test_sockets_are_unimportable(level: Isolation) -> None:
    result = run_python("import socket\n", FAST)
    assert not result.passed and "import of socket halted" in result.stderr
    result = run_python("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:1')\n", FAST)
    assert not result.passed


@needs_namespaces
def test_there_is_no_network_even_when_the_block_is_bypassed() -> None:
    with socket.socket() as server:  # a port that accepts connections outside the sandbox
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = ("import sys\nfor name in ('socket', '_socket'):\n    del sys.modules[name]\n"
                f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n")
        result = run_python(code, FAST)
    assert not result.passed and "Network is unreachable" in result.stderr


def test_the_environment_is_minimal(level: Isolation, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("FORGELINE_SECRET", "hunter2")
    code = "import os, sys\nprint(sorted(os.environ))\nprint(sys.flags.isolated, sys.flags.no_site)\n"
    result = run_python(code, FAST)
    assert result.passed
    assert result.stdout.splitlines() == ["['HOME', 'LANG', 'PATH']", "1 1"]


def test_it_runs_in_a_fresh_directory_that_is_removed(level: Isolation, tmp_path: Path) -> None:
    root = tmp_path / "sandboxes"
    root.mkdir(mode=0o755)
    tmp_path.chmod(0o755)  # traversable by the sandbox uid
    result = run_python("import os\nprint(os.listdir('.'))\nopen('scratch.txt', 'w').write('x')\n",
                        FAST, tmp_root=root)
    assert result.passed and result.stdout == "['program.py']\n"
    assert list(root.iterdir()) == []


@needs_uid
def test_files_outside_the_sandbox_cannot_be_written() -> None:
    # A root-owned directory the sandbox sees (not the checkout: a clone under /tmp is hidden by
    # the sandbox's private /tmp, and the write would fail for that reason instead).
    target = Path("/usr/local") / f"sandbox-escape-{uuid.uuid4().hex}.txt"
    try:
        result = run_python(f"open({str(target)!r}, 'w').write('x')\n", FAST)
        assert not result.passed and "PermissionError" in result.stderr and not target.exists()
    finally:
        target.unlink(missing_ok=True)
    result = run_python("import os\nprint(os.getuid(), os.getgid(), os.getgroups())\n", FAST)
    assert result.stdout == f"{FULL.uid} {FULL.uid} []\n"


@needs_namespaces
def test_tmp_is_private_and_discarded() -> None:
    name = f"/tmp/forgeline-sandbox-escape-{uuid.uuid4().hex}"
    result = run_python(f"open({name!r}, 'w').write('x')\nprint(open({name!r}).read())\n", FAST)
    assert result.passed and result.stdout == "x\n"
    assert not os.path.exists(name)
