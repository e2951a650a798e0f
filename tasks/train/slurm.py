"""The train stage on Slurm (parallel.launcher=slurm): one sbatch job of parallel.nnodes nodes, a
torchrun agent on each (srun, one task per node), their c10d rendezvous on the job's first node.
The stage submits it, follows it -- its state, and its output file line by line into the stage's
log (and so Prefect's) -- and reports how it ended. However the stage stops before the job has
ended (Ctrl-C, a cancelled flow run, a SIGTERM, train.timeout_s, a controller that stays silent
past slurm.controller_timeout_s, any error), it cancels the job first: a retry must never run
beside it. A preempted job (Slurm's `--signal`, a time limit, `scontrol requeue`, preemption by
another job) saves its step (model/training/preemption.py) and requeues itself under the same job
id, which the stage goes on following; the next run of the batch script resumes from it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from forgeline.configs import Config
from forgeline.model.parallel.mesh import local_device_type
from forgeline.tasks.train.launch import LaunchError, LaunchTimeout, relay_line

# Job states after which the job runs no more (squeue's and scontrol's names) -- but for PREEMPTED
# with --requeue, which Slurm shows until the job's steps are gone and it is requeued.
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"}
# A requeueable job that stays PREEMPTED longer than train.preemption_grace_s (its steps' time to
# save; KillWait should match it) plus this margin was not requeued: that is its end.
REQUEUE_MARGIN_S = 60.0
# In the job directory while a submitted job's end has not been seen: the next attempt ends it first.
JOB_RECORD = "submitted-job"
# Bound on one scontrol or scancel call (they retry a silent controller themselves).
COMMAND_TIMEOUT_S = 60.0
# Rendezvous host and port, from the environment of the batch script.
RDZV = "--rdzv-endpoint=$FORGELINE_RDZV_HOST:$FORGELINE_RDZV_PORT"


class ControllerSilent(RuntimeError):
    """scontrol got no answer about the job from the Slurm controller."""


@dataclass(frozen=True)
class JobState:
    state: str
    exit_code: str  # "code:signal"
    restarts: int
    reason: str


def batch_script(cfg: Config, agent_args: Sequence[str], output: Path, preemption_record: Path) -> str:
    """The sbatch script; `agent_args`: torchrun's options after the rendezvous, and the program."""
    slurm, par = cfg.slurm, cfg.parallel
    task = task_resources(cfg)
    directives = [f"--job-name=forgeline-train-{cfg.content_hash()[:8]}", f"--nodes={par.nnodes}",
                  *task, f"--output={output}", "--open-mode=append",
                  # Slurm's warning before the time limit: the ranks save their step within it.
                  f"--signal=USR1@{cfg.train.preemption_grace_s}",
                  "--requeue" if slurm.requeue else "--no-requeue"]
    directives += [f"--{key}={value}" for key, value in
                   (("partition", slurm.partition), ("account", slurm.account), ("time", slurm.time_limit),
                    ("gpus-per-node", gpus_per_node(cfg)), ("mem-per-cpu", slurm.mem_per_cpu))
                   if value]
    directives += slurm.sbatch_args
    torchrun = " ".join([*map(shlex.quote, [sys.executable, "-m", "torch.distributed.run"]),
                         "--nnodes=$SLURM_JOB_NUM_NODES", "--rdzv-backend=c10d", RDZV,
                         "--rdzv-id=forgeline-$SLURM_JOB_ID", *map(shlex.quote, agent_args)])
    requeue = (f'if [ "$status" -ne 0 ] && [ -f {shlex.quote(str(preemption_record))} ]; then\n'
               '    echo "forgeline: preempted; requeueing job $SLURM_JOB_ID"\n'
               '    scontrol requeue "$SLURM_JOB_ID"\n'
               'fi\n') if slurm.requeue else ""
    return (
        "#!/bin/bash\n"
        + "".join(f"#SBATCH {shlex.quote(d)}\n" for d in directives)
        + "# Written by forgeline's train stage (tasks/train/slurm.py).\n"
        # The batch shell outlives a SIGTERM to the job (a requeue, a cancellation): if it ended
        # first, Slurm would kill the job's steps before the ranks have saved.
        "trap '' TERM\n"
        f"cd {shlex.quote(str(Path.cwd()))}\n"
        'export FORGELINE_RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        f"export FORGELINE_RDZV_PORT={slurm.rdzv_port}\n"
        f': "${{OMP_NUM_THREADS:=$(( ${{SLURM_CPUS_ON_NODE:-$(nproc)}} / {par.nproc_per_node} ))}}"\n'
        "export OMP_NUM_THREADS=$(( OMP_NUM_THREADS > 0 ? OMP_NUM_THREADS : 1 ))\n"
        f"rm -f {shlex.quote(str(preemption_record))}\n"
        'echo "forgeline: job $SLURM_JOB_ID (run ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST,'
        ' rendezvous at $FORGELINE_RDZV_HOST:$FORGELINE_RDZV_PORT"\n'
        # srun (Slurm >= 22.05) takes no --cpus-per-task from the job: it is passed again.
        f"srun --kill-on-bad-exit=1 {' '.join(task)} bash -c {shlex.quote(torchrun)}\n"
        "status=$?\n"
        + requeue
        + "exit $status\n"
    )


def task_resources(cfg: Config) -> list[str]:
    """The job's one task per node -- the torchrun agent, which starts the node's ranks -- and its
    CPUs: slurm.cpus_per_rank for each of those ranks."""
    per_rank = cfg.slurm.cpus_per_rank
    cpus = [f"--cpus-per-task={per_rank * cfg.parallel.nproc_per_node}"] if per_rank else []
    return ["--ntasks-per-node=1", *cpus]


def gpus_per_node(cfg: Config) -> int:
    """slurm.gpus_per_node, else one GPU per rank when this machine has CUDA (the ranks' device
    type, model/parallel/mesh.py), else none."""
    if cfg.slurm.gpus_per_node is not None:
        return cfg.slurm.gpus_per_node
    return cfg.parallel.nproc_per_node if local_device_type() == "cuda" else 0


def run_slurm_job(cfg: Config, agent_args: Sequence[str], env: Mapping[str, str], job_dir: Path,
                  preemption_record: Path, logger: logging.Logger,
                  on_line: Callable[[str], None] | None = None) -> None:
    """Submit the job, follow it to its end and raise LaunchError unless it completed. A job whose
    end the stage did not see is cancelled before the stage returns or raises."""
    job_dir.mkdir(parents=True, exist_ok=True)
    script = job_dir / "train.sbatch"
    output = job_dir.resolve() / "slurm-%j.out"
    script.write_text(batch_script(cfg, agent_args, output, preemption_record.resolve()))
    cancel_wait_s = cfg.train.preemption_grace_s + 30  # the ranks' grace period to save, and some
    end_earlier_job(job_dir / JOB_RECORD, env, cancel_wait_s, logger)
    deadline = time.monotonic() + cfg.train.timeout_s
    job_id = submit(script, env)
    (job_dir / JOB_RECORD).write_text(job_id + "\n")
    output = job_dir.resolve() / f"slurm-{job_id}.out"
    logger.info("submitted Slurm job %s (%d node(s)); its output: %s", job_id, cfg.parallel.nnodes, output)
    state: JobState | None = None
    try:
        state = follow(job_id, output, cfg, deadline, logger, on_line)
    finally:
        # Stopped from here: the ranks get SIGTERM and their grace period to save. A job whose end
        # was not seen stays recorded for the next attempt to end first.
        if state is not None or cancel(job_id, env, cancel_wait_s, logger):
            (job_dir / JOB_RECORD).unlink()
    if state.state != "COMPLETED":
        reason = f", {state.reason}" if state.reason not in ("", "None") else ""
        raise LaunchError(f"Slurm job {job_id} ended {state.state} (exit code {state.exit_code}{reason}); "
                          f"its output: {output}")


def submit(script: Path, env: Mapping[str, str]) -> str:
    done = subprocess.run(["sbatch", "--parsable", str(script)], env=dict(env), capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise LaunchError(f"sbatch refused {script}: {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]


def end_earlier_job(record: Path, env: Mapping[str, str], wait_s: float, logger: logging.Logger) -> None:
    """Cancel the job an earlier attempt left recorded (its cancel failed, or the stage died) unless it
    has ended; raise LaunchError when that cannot be known or done: never a second job beside it."""
    if not record.exists():
        return
    job_id = record.read_text().strip()
    try:
        state = job_state(job_id)
    except ControllerSilent as err:
        raise LaunchError(f"cannot tell whether Slurm job {job_id}, of an earlier attempt of this stage, "
                          f"has ended ({err}), so no new job is submitted beside it; retry once the "
                          f"controller answers, or cancel it (`scancel {job_id}`) and remove "
                          f"{record}") from err
    if state is not None and state.state not in ENDED and not cancel(job_id, env, wait_s, logger):
        raise LaunchError(f"Slurm job {job_id}, of an earlier attempt of this stage, is still {state.state} "
                          f"and could not be cancelled, so no new job is submitted beside it; cancel it "
                          f"(`scancel {job_id}`) and retry")
    record.unlink()


def cancel(job_id: str, env: Mapping[str, str], wait_s: float, logger: logging.Logger) -> bool:
    """scancel the job and wait (at most `wait_s`) until it has ended; whether it has."""
    logger.warning("cancelling Slurm job %s", job_id)
    try:
        done = subprocess.run(["scancel", job_id], env=dict(env), capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
        if "Invalid job id" in done.stderr:
            return True  # the controller has forgotten it: it ended long ago
        refusal = done.stderr.strip() if done.returncode != 0 else ""
    except subprocess.TimeoutExpired:
        refusal = f"no answer within {COMMAND_TIMEOUT_S:.0f} s"
    if refusal:
        logger.error("scancel %s failed (%s): the job may still be running; the next attempt of the stage "
                     "cancels it before it submits another (or cancel it yourself: `scancel %s`)",
                     job_id, refusal, job_id)
        return False
    return wait_for_end(job_id, wait_s)


def job_state(job_id: str) -> JobState | None:
    """The job as the controller knows it; None once it has forgotten it (MinJobAge). Raises
    ControllerSilent when the controller does not answer (a restart, a failover, an RPC timeout)."""
    try:
        done = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], capture_output=True,
                              text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise ControllerSilent(f"scontrol gave no answer within {COMMAND_TIMEOUT_S:.0f} s") from err
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return None
        raise ControllerSilent(done.stderr.strip() or f"scontrol exited with code {done.returncode}")
    fields = dict(re.findall(r"(\w+)=(\S*)", done.stdout))
    return JobState(fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", "?"),
                    int(fields.get("Restarts", "0")), fields.get("Reason", ""))


def follow(job_id: str, output: Path, cfg: Config, deadline: float, logger: logging.Logger,
           on_line: Callable[[str], None] | None) -> JobState:
    """Stream the output file until the job has ended; its last state. A requeued job (also one
    shown PREEMPTED first) goes back to PENDING and runs again under the same id, appending to the
    same file. Raises LaunchError past `deadline` (train.timeout_s) and when the controller stays
    silent longer than slurm.controller_timeout_s."""
    reader = _LineReader(output)

    def forward_new_lines() -> None:
        for line in reader.new_lines():
            relay_line(logger, line)
            if on_line is not None:
                on_line(line)

    last: JobState | None = None
    silent_since: float | None = None  # when scontrol stopped answering
    preempted_since: float | None = None
    requeue_wait_s = cfg.train.preemption_grace_s + REQUEUE_MARGIN_S
    while True:
        now = time.monotonic()
        if now > deadline:
            raise LaunchTimeout(f"Slurm job {job_id} had not ended after train.timeout_s "
                              f"({cfg.train.timeout_s} s from its submission, queue wait included), so it "
                              f"is cancelled; raise train.timeout_s if it needs longer. Its output: {output}")
        try:
            state = job_state(job_id)
        except ControllerSilent as err:
            silent_since = _note_silence(job_id, err, silent_since, now, cfg.slurm.controller_timeout_s,
                                         logger)
            forward_new_lines()
            time.sleep(cfg.slurm.poll_s)
            continue
        if silent_since is not None:
            logger.info("the Slurm controller answers again after %.0f s", now - silent_since)
            silent_since = None
        forward_new_lines()
        if state is None:
            if last is None:
                raise LaunchError(f"Slurm does not know job {job_id}")
            return last
        if last is None or (state.state, state.restarts) != (last.state, last.restarts):
            logger.info("Slurm job %s: %s%s", job_id, state.state,
                        f" (requeued {state.restarts}x)" if state.restarts else "")
        last = state
        if state.state != "PREEMPTED":
            preempted_since = None
        elif preempted_since is None:
            preempted_since = now
        awaiting_requeue = cfg.slurm.requeue and preempted_since is not None \
            and now - preempted_since < requeue_wait_s
        if state.state in ENDED and not awaiting_requeue:
            time.sleep(cfg.slurm.poll_s)  # the last lines may land after the state changed
            forward_new_lines()
            return state
        time.sleep(cfg.slurm.poll_s)


def _note_silence(job_id: str, err: ControllerSilent, silent_since: float | None, now: float,
                  timeout_s: float, logger: logging.Logger) -> float:
    """When the controller's silence began; LaunchError once it has lasted `timeout_s`."""
    if silent_since is None:
        logger.warning("the Slurm controller does not answer about job %s (%s); asking again for up to "
                       "%.0f s (slurm.controller_timeout_s)", job_id, err, timeout_s)
        return now
    if now - silent_since > timeout_s:
        raise LaunchError(f"the Slurm controller did not answer about job {job_id} for "
                          f"{now - silent_since:.0f} s (slurm.controller_timeout_s = {timeout_s:.0f}): "
                          f"{err}. The job is cancelled; raise slurm.controller_timeout_s if the "
                          "controller takes longer to fail over")
    return silent_since


def wait_for_end(job_id: str, timeout_s: float) -> bool:
    """Whether the job ended within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ControllerSilent):  # not known to have ended: ask again
            state = job_state(job_id)
            if state is None or state.state in ENDED:
                return True
        time.sleep(1)
    return False


class _LineReader:
    """The complete lines appended to a file since the last call."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [line.decode(errors="replace").rstrip() for line in lines if line.strip()]
