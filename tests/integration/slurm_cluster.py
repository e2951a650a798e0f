"""A real one-node Slurm cluster on this machine for the tests: Debian's slurmctld and slurmd
(`make slurm` installs them and starts munged), configured in a temporary directory, on free
ports of 127.0.0.1. Users of the cluster set SLURM_CONF to its config."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.integration.helpers import free_port

MISSING = "Debian's Slurm and munge are missing or munged is not running: run `make slurm` (root, apt)"


def slurm_config(root: Path, kill_wait_s: int) -> str:
    host = socket.gethostname()
    return "\n".join([
        "ClusterName=forgeline-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        # Also how long a requeued job waits before it may start again (default 120 s).
        "AuthInfo=cred_expire=10",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",
        "MpiDefault=none",
        "ReturnToService=2",
        "JobRequeue=1",
        # Seconds from a job's SIGTERM (cancel, requeue, time limit) to its SIGKILL: the ranks'
        # grace period to save their step.
        f"KillWait={kill_wait_s}",
        "InactiveLimit=0",
        "MinJobAge=600",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        "",
    ])


@contextmanager
def slurm_cluster(root: Path, kill_wait_s: int = 60) -> Iterator[dict[str, str]]:
    """slurmctld and slurmd running on `root`'s config until exit; the environment to use them."""
    if not (shutil.which("slurmctld") and shutil.which("slurmd")) or not _munge_works():
        raise RuntimeError(MISSING)
    for directory in ("state", "spool"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(slurm_config(root, kill_wait_s))
    env = dict(os.environ, SLURM_CONF=str(conf))
    daemons = [subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=(root / f"{daemon}.err").open("w"))
               for daemon in ("slurmctld", "slurmd")]
    try:
        _wait_for_idle_node(env, root)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, check=False, capture_output=True)
        for daemon in daemons:
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()


def _munge_works() -> bool:
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, check=True, timeout=10).stdout
        return subprocess.run(["unmunge"], input=cred, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _wait_for_idle_node(env: dict[str, str], root: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = subprocess.run(["sinfo", "--noheader", "--format=%t"], env=env, capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip() == "idle":
            return
        time.sleep(0.5)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(root.glob("*.log")))
    raise RuntimeError(f"the test's Slurm node did not become idle in {timeout_s:.0f} s\n{logs}")
