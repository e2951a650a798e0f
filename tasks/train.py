"""Train stage: launch `torchrun` on the rank-side program (model/train.py) and report the
checkpoint it committed.

Output (`train.out_dir`): `checkpoints/step-NNNNNNNN/` (sharded DCP checkpoints),
`config.yaml` (the resolved config the ranks ran with) and `train.json` (summary).
A rerun with the same model, training recipe and data resumes from the latest valid
checkpoint (a finished run resumes at its last step and returns at once); checkpoints of any
other configuration are discarded first, as `dvc repro` would.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml

from forgeline.configs import Config
from forgeline.configs.schema import resume_fingerprint
from forgeline.model.callbacks import TrainingUnstable, unstable_report
from forgeline.model.checkpoint import committed_checkpoints, latest_valid_checkpoint
from forgeline.model.data import MANIFEST_NAME, read_manifest
from forgeline.model.fileio import sha256_file
from forgeline.model.parallel import resolve_precision
from forgeline.tasks.atomic import write_text_atomic
from forgeline.tasks.launch import LaunchError, run_streaming
from forgeline.tasks.tracking import git_info, resolve_tracking_uri

log = logging.getLogger(__name__)

SUMMARY_NAME = "train.json"


# torchrun's line for a worker that died, e.g. "failed (exitcode: -9) local_rank: 1 (pid: 42)".
WORKER_FAILURE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
# The last line of a rank's traceback, e.g. "[rank0]: CheckpointError: saving ... failed".
RANK_EXCEPTION = re.compile(r"^\[rank\d+\]: [\w.]*(?:Error|Exception|Unstable)\b.*$")


@dataclass(frozen=True)
class TrainResult:
    out_dir: str
    checkpoint: str
    step: int
    loss: float
    tokens_seen: int
    layout: dict
    failures: list[str] = field(default_factory=list)  # each triggered an in-job restart


def describe_failure(line: str) -> str | None:
    """'local rank 1 (pid 42) was killed by SIGKILL' from a torchrun failure line."""
    match = WORKER_FAILURE.search(line)
    if match is None:
        return None
    code, local_rank, pid = (int(g) for g in match.groups())
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"local rank {local_rank} (pid {pid}) {how}"


def train_model(cfg: Config, mlflow_run_id: str | None = None) -> TrainResult:
    """Run the train stage; step metrics go to `mlflow_run_id` when given."""
    data_dir = Path(cfg.data.out_dir)
    read_manifest(data_dir)  # fail before launching anything if the data stage has not run
    resolve_precision(cfg.train.precision, "cuda" if torch.cuda.is_available() else "cpu")
    out_dir = Path(cfg.train.out_dir)
    checkpoint_root = out_dir / "checkpoints"
    fingerprint = resume_fingerprint(cfg, sha256_file(data_dir / MANIFEST_NAME))
    discard_foreign_checkpoints(checkpoint_root, fingerprint)

    config_path = out_dir / "config.yaml"
    # Python mode, not JSON: YAML keeps what JSON cannot (a NaN in a callback argument, say).
    write_text_atomic(config_path, yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    cmd = torchrun_command(cfg, config_path, mlflow_run_id)
    failures: list[str] = []
    rank_exceptions: list[str] = []

    def note_failure(line: str) -> None:
        if (failure := describe_failure(line)) is not None:
            failures.append(failure)
            log.warning("worker failure %d: %s", len(failures), failure)
        elif RANK_EXCEPTION.match(line):
            rank_exceptions.append(line)

    try:
        run_streaming(cmd, launch_env(cfg), cfg.train.timeout_s, log, on_line=note_failure)
    except LaunchError as err:
        report = unstable_report(out_dir, fingerprint)
        if report:
            raise TrainingUnstable(report) from None
        if rank_exceptions:  # lead with what went wrong, not with torchrun's summary
            raise LaunchError(f"training failed: {rank_exceptions[-1]}\n{err}") from None
        raise

    final = latest_valid_checkpoint(checkpoint_root)
    if final is None or final.step != cfg.train.steps:
        found = "none" if final is None else f"step {final.step}"
        raise LaunchError(f"torchrun exited cleanly but the latest valid checkpoint in "
                          f"{checkpoint_root} is {found}, expected step {cfg.train.steps}")
    result = TrainResult(
        out_dir=str(out_dir),
        checkpoint=str(final.path),
        step=final.step,
        loss=final.manifest["loss"],
        tokens_seen=final.manifest["tokens_seen"],
        layout=final.manifest["layout"],
        failures=failures,
    )
    write_text_atomic(out_dir / SUMMARY_NAME, json.dumps(asdict(result), indent=2) + "\n")
    return result


def read_train_summary(cfg: Config) -> TrainResult:
    path = Path(cfg.train.out_dir) / SUMMARY_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the train stage first (`forgeline stage train`)")
    return TrainResult(**json.loads(path.read_text()))


def discard_foreign_checkpoints(root: Path, fingerprint: str) -> None:
    """Remove committed checkpoints written for another configuration (they cannot be
    resumed into this one) and partial saves a crash left behind. Rolled-back ones stay."""
    for info in committed_checkpoints(root):
        if info.manifest["fingerprint"] != fingerprint:
            log.warning("removing %s: written for another model/training/data configuration",
                        info.path)
            shutil.rmtree(info.path)
    for partial in root.glob(".step-*.partial") if root.is_dir() else ():
        shutil.rmtree(partial)


def torchrun_command(cfg: Config, config_path: Path, mlflow_run_id: str | None) -> list[str]:
    """One node's launcher: standalone on one node, else a c10d rendezvous that every node's
    launcher joins (node ranks are assigned by the rendezvous)."""
    par = cfg.parallel
    if par.nnodes == 1:
        rendezvous = ["--standalone"]
    else:
        rendezvous = [f"--nnodes={par.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={par.rdzv_endpoint}",
                      f"--rdzv-id=forgeline-{cfg.section_hash()[:12]}"]
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        *rendezvous,
        f"--nproc-per-node={par.nproc_per_node}",
        f"--max-restarts={cfg.train.max_restarts}",
        "-m", "forgeline.model.train",
        "--config", str(config_path),
    ]
    if mlflow_run_id:
        cmd += ["--mlflow-run-id", mlflow_run_id]
    return cmd


def launch_env(cfg: Config) -> dict[str, str]:
    env = dict(os.environ)
    # ranks x threads <= cores: oversubscribed CPU ranks slow every collective down.
    threads = max(1, (os.cpu_count() or 1) // cfg.parallel.nproc_per_node)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    # torch 2.13's torchrun reuses the rendezvous TCP store across restarts, and restarted
    # gloo ranks then fail to connect; a fresh store per restart fixes it.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["MLFLOW_TRACKING_URI"] = resolve_tracking_uri(cfg)
    env["FORGELINE_GIT_COMMIT"] = git_info()["git.commit"]
    env["PYTHONUNBUFFERED"] = "1"
    return env
