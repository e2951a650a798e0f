"""Run untrusted Python (model-generated code and its tests) in a sandboxed subprocess.

    result = run_python("def f():\\n    return 1\\nassert f() == 1\\n")
    result.passed  # exit status 0 within the limits

What every run gets, on any Linux machine:
  - a fresh private temporary directory (mode 0700) as the working directory, removed afterwards;
  - `python -I -S`: no PYTHON* variables, no user or site packages (the standard library only),
    neither the working directory nor the script's directory on sys.path;
  - an environment of only PATH, HOME (the temporary directory) and LANG: no proxy variables, no
    credentials;
  - hard resource limits, set in the child before the untrusted code runs: CPU seconds, address
    space (memory), size of any file written (stdout and stderr included), open files, no core
    dumps;
  - `socket`, `_socket`, `ssl` and `_ssl` made unimportable (the Python-level network block);
  - a wall-clock timeout after which the whole process group is killed with SIGKILL;
  - stdout and stderr go to files, never pipes, so a child that floods them or leaves an
    inheriting grandchild behind cannot block or exhaust the caller.

What it adds where the machine allows -- `isolation()` runs a probe program under each level,
strongest first, and keeps the first that works, with a warning when that is not the strongest
(all of it on this project's machines, where the pipeline runs as root):
  - new network, PID and mount namespaces (`unshare --net --pid --mount --fork --kill-child`):
    no network interface but a loopback that is down, so even code that re-imports `_socket`
    cannot reach anything, 127.0.0.1 included; every process the code starts dies with it,
    including ones that left the process group with setsid(); fresh tmpfs mounts over /tmp,
    /var/tmp and /dev/shm, so what it writes there disappears with the namespace;
  - running as root: the code runs as `nobody` (uid/gid 65534, no supplementary groups, no new
    privileges), so it cannot write anywhere root owns (the repository, artifacts, /root) and
    RLIMIT_NPROC caps its processes (fork bombs). `nobody` cannot read /root, so the interpreter
    is the first of sys.executable, /usr/bin/python3 that `nobody` can run;
  - not root but user namespaces allowed: the same namespaces inside a user namespace, and
    RLIMIT_NPROC counted in it; files the invoking user may write stay writable.

Known gaps: no seccomp filter (every system call is allowed); the code can read every
world-readable file (the repository's source included) and, as `nobody`, write the few
world-writable places outside /tmp, /var/tmp and /dev/shm; third-party packages are not
importable (-S); CPU and memory limits are per process (a process tree is bounded only by
max_processes x memory_mb), there is no cgroup; without namespaces, a process that leaves the
group with setsid() survives the timeout and the network is blocked only at the Python level,
which ctypes can bypass.

Limits are set in the child's own prelude (`python -c`) rather than in a `preexec_fn`: the
caller is a multi-threaded torch process, where `preexec_fn` is unsafe; the prelude runs before
any untrusted code, and once root is dropped the hard limits cannot be raised again.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

NOBODY = 65534
_NAMESPACES = ("--net", "--pid", "--mount", "--fork", "--kill-child")
_OUTPUT_CHARS = 20_000  # of stdout/stderr kept in the result

# Runs in the child before the program. argv[1] is the JSON of _Plan; the working directory is
# the sandbox directory, which holds program.py.
_PRELUDE = r"""
import ctypes, json, os, resource, sys
plan = json.loads(sys.argv[1])
with open("program.py") as f:
    source = f.read()
libc = ctypes.CDLL(None, use_errno=True)
if plan["private_tmp"]:
    # The working directory stays reachable as "." after /tmp is covered.
    for target in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(target) and libc.mount(b"tmpfs", target.encode(), b"tmpfs", 2 | 4,
                                                b"size=64m,mode=1777") != 0:
            raise OSError(ctypes.get_errno(), "mounting a private tmpfs on " + target)
limits = {"RLIMIT_CPU": plan["cpu_s"], "RLIMIT_AS": plan["memory_bytes"],
          "RLIMIT_FSIZE": plan["file_size_bytes"], "RLIMIT_NOFILE": plan["open_files"],
          "RLIMIT_CORE": 0}
if plan["max_processes"] is not None:
    limits["RLIMIT_NPROC"] = plan["max_processes"]
for name, value in limits.items():
    soft = value
    hard = value + 1 if name == "RLIMIT_CPU" else value  # SIGXCPU first, SIGKILL a second later
    resource.setrlimit(getattr(resource, name), (soft, hard))
if plan["uid"] is not None:
    os.setgroups([])
    os.setgid(plan["uid"])
    os.setuid(plan["uid"])
if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: no setuid binary regains root
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
for name in ("socket", "_socket", "ssl", "_ssl"):
    sys.modules[name] = None
del ctypes, json, os, resource, libc, limits, f, name, soft, hard, plan
sys.argv = ["program.py"]
exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass(frozen=True)
class Limits:
    """Per-run limits. CPU, memory and file size are per process."""

    timeout_s: float = 10.0
    """Wall clock, interpreter start-up included; then every process of the run is killed."""
    cpu_s: int = 10
    """CPU seconds (RLIMIT_CPU): SIGXCPU, then SIGKILL one second later."""
    memory_mb: int = 1024
    """Address space (RLIMIT_AS): allocations beyond it raise MemoryError."""
    file_size_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE), its stdout and stderr included."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    max_processes: int = 16
    """Processes and threads (RLIMIT_NPROC); applied only where the run has a uid or user
    namespace of its own (see `Isolation.limits_processes`)."""


@dataclass(frozen=True)
class Isolation:
    """What this machine lets the sandbox add to the baseline (see the module docstring)."""

    namespaces: bool
    """New network, PID and mount namespaces (kill-on-exit, private /tmp, no network)."""
    user_namespace: bool
    """The namespaces live in a user namespace (not root)."""
    uid: int | None
    """The unprivileged uid the code runs as (root only), else None: the caller's uid."""
    python: str
    """The interpreter (one the sandbox uid can run)."""
    unshare: str | None

    @property
    def limits_processes(self) -> bool:
        return self.uid is not None or self.user_namespace


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None
    """Exit status; negative for a signal; None when the timeout killed it."""
    timed_out: bool
    stdout: str
    stderr: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@dataclass(frozen=True)
class _Plan:
    cpu_s: int
    memory_bytes: int
    file_size_bytes: int
    open_files: int
    max_processes: int | None
    uid: int | None
    private_tmp: bool


# Run as the sandbox uid: the standard library the generated code typically imports must load.
_PROBE = ("import collections, functools, heapq, itertools, json, math, random, re, string\n"
          "assert math.gcd(4, 6) == 2\n")


class SandboxError(RuntimeError):
    """The sandbox cannot run even a trivial program on this machine."""


def _candidates() -> list[Isolation]:
    """Isolation levels, strongest first."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0:
        user_ns = [True] if unshare else []
        return [Isolation(ns, ns, None, sys.executable, unshare=unshare) for ns in user_ns + [False]]
    pythons = list(dict.fromkeys(p for p in (sys.executable, "/usr/bin/python3") if Path(p).is_file()))
    levels = [(ns, False, uid, python) for ns in ((True, False) if unshare else (False,))
              for uid in (NOBODY, None) for python in (pythons if uid is not None else [sys.executable])]
    return [Isolation(*level, unshare=unshare) for level in levels]


@functools.cache
def isolation() -> Isolation:
    """The strongest isolation under which a trivial program runs here (probed once per process
    by running it, so a level that half-works is never chosen)."""
    failures = []
    for candidate in _candidates():
        try:
            result = _run(candidate, _PROBE, Limits(timeout_s=30.0), None)
        except OSError as e:  # e.g. the interpreter is missing
            failures.append((candidate, str(e)))
            continue
        if result.passed:
            weak = not candidate.namespaces or (os.geteuid() == 0 and candidate.uid is None)
            tried = "; ".join(f"{level}: {why.splitlines()[-1]}" for level, why in failures)
            (log.warning if weak else log.info)("sandbox isolation: %s (stronger levels failed: %s)",
                                                candidate, tried or "none")
            return candidate
        failures.append((candidate, result.stderr.strip()[-300:] or str(result.returncode)))
    raise SandboxError("no sandbox level can run a trivial Python program:\n"
                       + "\n".join(f"{level}: {why}" for level, why in failures))


def _env(home: Path) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}


def _read(file) -> str:
    file.seek(0)
    return file.read(_OUTPUT_CHARS * 4).decode("utf-8", errors="replace")[:_OUTPUT_CHARS]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(code: str, limits: Limits = Limits(), tmp_root: Path | None = None) -> SandboxResult:
    """Run `code` as a script in the sandbox; `tmp_root` is where its temporary directory is
    made (the system default if None; it must be traversable by the sandbox uid)."""
    return _run(isolation(), code, limits, tmp_root)


def _run(iso: Isolation, code: str, limits: Limits, tmp_root: Path | None) -> SandboxResult:
    plan = _Plan(cpu_s=limits.cpu_s, memory_bytes=limits.memory_mb << 20,
                 file_size_bytes=limits.file_size_mb << 20, open_files=limits.open_files,
                 max_processes=limits.max_processes if iso.limits_processes else None,
                 uid=iso.uid, private_tmp=iso.namespaces)
    argv = [iso.python, "-I", "-S", "-c", _PRELUDE, json.dumps(asdict(plan))]
    if iso.namespaces:
        argv = [iso.unshare, *(["--user", "--map-root-user"] if iso.user_namespace else []),
                *_NAMESPACES, "--", *argv]
    workdir = Path(tempfile.mkdtemp(prefix="forgeline-sandbox-", dir=tmp_root))
    try:
        (workdir / "program.py").write_text(code)
        if iso.uid is not None:
            os.chown(workdir, iso.uid, iso.uid)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            start = time.monotonic()
            proc = subprocess.Popen(argv, cwd=workdir, env=_env(workdir), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc.pid)  # stragglers of a finished run too
            proc.wait()
            seconds = time.monotonic() - start
            return SandboxResult(returncode=None if timed_out else proc.returncode, timed_out=timed_out,
                                 stdout=_read(out), stderr=_read(err), seconds=seconds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
