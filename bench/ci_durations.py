"""Where CI's test time goes, from the log of `.ci/run` run with PYTEST_ADDOPTS=--durations=0:
each session's wall time, a table per test file (setup + call + teardown of its tests, summed) and
the slowest tests. Given two logs (before, after), the tables put them side by side.

    .venv/bin/python bench/ci_durations.py LOG [AFTER_LOG] [--top 20]

A file's sum is the time its tests held one pytest-xdist worker, not wall time: two workers run
at once, so a session's wall time is about half the sum of its files."""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# "12.34s call     tests/unit/test_x.py::test_y[a-b]", as pytest's --durations prints it.
DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S.*)$")
# "1052 passed, 12 skipped in 1027.12s (0:17:07)", each session's last line (-q).
SESSION_END = re.compile(r"(\d+) passed.* in (\d+(?:\.\d+)?)s")
MAKE_TARGET = re.compile(r"pytest -q -m \"?([^\"-]+?)\"? -n")
CI_TOTAL = re.compile(r"^ci: passed in (\d+)s")


@dataclass
class Session:
    """One pytest run in the log: its marker selection, wall time and per-test durations."""

    selection: str
    wall_s: float = 0.0
    passed: int = 0
    tests: dict[str, float] = field(default_factory=lambda: defaultdict(float))


@dataclass
class CiLog:
    sessions: list[Session]
    total_s: int | None


def read_log(path: Path) -> CiLog:
    sessions: list[Session] = []
    total = None
    for line in path.read_text(errors="replace").splitlines():
        if match := MAKE_TARGET.search(line):
            sessions.append(Session(match.group(1).strip()))
        elif (match := DURATION.match(line)) and sessions:
            sessions[-1].tests[match.group(3)] += float(match.group(1))
        elif (match := SESSION_END.search(line)) and sessions:
            sessions[-1].passed, sessions[-1].wall_s = int(match.group(1)), float(match.group(2))
        elif match := CI_TOTAL.match(line):
            total = int(match.group(1))
    return CiLog(sessions, total)


def per_file(log: CiLog) -> dict[str, tuple[str, float, int]]:
    """Each test file's session (selection), summed seconds and number of tests timed."""
    files: dict[str, tuple[str, float, int]] = {}
    for session in log.sessions:
        for nodeid, seconds in session.tests.items():
            name = nodeid.split("::")[0]
            _, total, count = files.get(name, (session.selection, 0.0, 0))
            files[name] = (session.selection, total + seconds, count + 1)
    return files


def all_tests(log: CiLog) -> dict[str, float]:
    return {nodeid: seconds for session in log.sessions for nodeid, seconds in session.tests.items()}


def minutes(seconds: float | None) -> str:
    return "--" if seconds is None else f"{seconds / 60:.1f} min"


def print_totals(logs: list[CiLog]) -> None:
    """Each log's pytest sessions (the make targets' marker selections) and .ci/run's total."""
    print("| log | what | tests passed | wall |\n|---|---|---|---|")
    for label, log in zip(("before", "after"), logs, strict=False):
        for session in log.sessions:
            what = f'pytest -m "{session.selection}"'
            print(f"| {label} | {what} | {session.passed} | {minutes(session.wall_s)} |")
        print(f"| {label} | .ci/run | | {minutes(log.total_s)} |")
    print()


def print_files(logs: list[CiLog]) -> None:
    tables = [per_file(log) for log in logs]
    names = sorted(set().union(*tables), key=lambda name: -max(t.get(name, ("", 0, 0))[1] for t in tables))
    print("| file | session | " + " | ".join(("before s", "after s")[:len(logs)]) + " |")
    print("|---|---|" + "---|" * len(logs))
    for name in names:
        selection = next(t[name][0] for t in tables if name in t)
        cells = [f"{t[name][1]:.0f} ({t[name][2]})" if name in t else "--" for t in tables]
        print(f"| {name} | {selection} | " + " | ".join(cells) + " |")
    sums = [sum(seconds for _, seconds, _ in t.values()) for t in tables]
    print("| all files, summed | | " + " | ".join(f"{s:.0f}" for s in sums) + " |\n")


def print_slowest(logs: list[CiLog], top: int) -> None:
    for label, log in zip(("before", "after"), logs, strict=False):
        print(f"Slowest {top} tests, {label} (setup + call + teardown):\n\n| s | test |\n|---|---|")
        for nodeid, seconds in sorted(all_tests(log).items(), key=lambda item: -item[1])[:top]:
            print(f"| {seconds:.0f} | {nodeid} |")
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path, help="a .ci/run log, and optionally a later one")
    parser.add_argument("--top", type=int, default=20, help="how many of the slowest tests to list")
    args = parser.parse_args()
    logs = [read_log(path) for path in args.logs[:2]]
    print_totals(logs)
    print_files(logs)
    print_slowest(logs, args.top)


if __name__ == "__main__":
    main()
