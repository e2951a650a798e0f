"""Train stage: launch `torchrun` on the rank program (model/training/worker.py) and report the
checkpoint it committed.

Output (`train.out_dir`, laid out by model/training/outputs.py): `checkpoints/step-NNNNNNNN/`
(sharded DCP checkpoints), `config.yaml` (the config the ranks ran with), `train.json`
(summary, with the last and the best validation) and the loss curve (`loss.csv`, `loss.png`).
`run.json` names the run whose checkpoints these are (run.name and its run fingerprint).
A rerun with the same model, training recipe and data resumes from the latest valid
checkpoint (a finished run resumes at its last step and returns at once). Nothing here deletes
committed checkpoints: a directory that holds another configuration's is refused before any
work starts (`check_run_directory`), and those of this configuration that were trained on other
data or another base's weights are set aside, intact, into `superseded-<time>/`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from forgeline.configs import Config, ConfigError
from forgeline.configs.schema import resume_fingerprint, run_fingerprint
from forgeline.eval.dimensions import dimension_of
from forgeline.model.checkpoint.manager import committed_checkpoints, latest_valid_checkpoint
from forgeline.model.fileio import sha256_file
from forgeline.model.parallel.mesh import local_device_type, resolve_precision
from forgeline.model.spool import FLUSH_ENV, SPOOL_ENV
from forgeline.model.training.callbacks import STACKS_DIR_ENV, TrainingUnstable, unstable_report
from forgeline.model.training.loader import num_validation_batches
from forgeline.model.training.outputs import TrainOutputs
from forgeline.model.training.preemption import PREEMPTED_EXIT_CODE
from forgeline.model.training.shards import MANIFEST_NAME, read_manifest
from forgeline.tasks.atomic import write_text_atomic
from forgeline.tasks.pretrained import Base, check_data_tokenizer, resolve_base, with_base
from forgeline.tasks.tracking import DATASET_NAME, RunTracker, dvc_hash, git_info, resolve_tracking_uri
from forgeline.tasks.train.alerts import AlertForwarder
from forgeline.tasks.train.curves import write_loss_curve
from forgeline.tasks.train.launch import LaunchError, LaunchTimeout, run_streaming
from forgeline.tasks.train.slurm import run_slurm_job

log = logging.getLogger(__name__)


# What the launcher adds to the ranks' grace period before it kills what is left of the job.
LAUNCHER_GRACE_MARGIN_S = 15

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
    # Validations ({"step", "loss", "bpb"}; train.val_every): the last, and the lowest loss.
    val_last: dict | None = None
    val_best: dict | None = None
    base: dict | None = None  # the pretrained base it started from (tasks/pretrained.py Base.lineage)


class TrainPreempted(LaunchError):
    """The ranks were preempted and saved their last step: a retry resumes from it. `record`: what
    the preempted ranks recorded (model/training/preemption.py)."""

    def __init__(self, message: str, record: dict | None = None):
        super().__init__(message)
        self.record = record


def take_preemption_record(outputs: TrainOutputs) -> dict | None:
    """What a preempted attempt recorded (model/training/preemption.py), removed so that the next
    attempt starts without it; None when the last attempt was not preempted."""
    try:
        record = json.loads(outputs.preemption_record.read_text())
    except FileNotFoundError:
        return None
    outputs.preemption_record.unlink()
    return record


def describe_failure(line: str) -> str | None:
    """'local rank 1 (pid 42) was killed by SIGKILL' from a torchrun failure line."""
    match = WORKER_FAILURE.search(line)
    if match is None:
        return None
    code, local_rank, pid = (int(g) for g in match.groups())
    if code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    elif code == PREEMPTED_EXIT_CODE:
        how = "was preempted and exited once its step was saved"
    else:
        how = f"exited with code {code}"
    return f"local rank {local_rank} (pid {pid}) {how}"


def preflight_precision(cfg: Config) -> None:
    """The training precision suits this machine (bf16 only where it is native), and so does the
    in-training evaluation's, which scores on the CPU (eval/periodic.py)."""
    resolve_precision(cfg.train.precision, local_device_type())
    if cfg.eval.during_training.every_steps:
        resolve_precision(cfg.eval.precision, "cpu", "eval.precision")


RUN_RECORD = "run.json"  # in train.out_dir: the run whose checkpoints are there
SUPERSEDED_PREFIX = "superseded-"  # under checkpoints/: this run's, trained on other data or another base


class RunDirectoryTaken(ValueError):
    """train.out_dir holds the checkpoints of another configuration; nothing in it was touched."""


def run_record(cfg: Config) -> dict[str, str]:
    """What `run.json` records: the run's name and the fingerprint of what its checkpoints are
    computed from (configs/schema.py run_fingerprint), of the config as loaded."""
    return {"run": cfg.run.name, "fingerprint": run_fingerprint(cfg.model_dump(mode="json"))}


def check_run_directory(cfg: Config) -> None:
    """Fail, touching nothing, if train.out_dir holds committed checkpoints of another
    configuration: another run fingerprint in its `run.json`, or none recorded (an earlier
    forgeline's run, or a copy)."""
    outputs = TrainOutputs(Path(cfg.train.out_dir))
    if not committed_checkpoints(outputs.checkpoints):
        return
    ours = run_record(cfg)
    try:
        theirs = json.loads((outputs.root / RUN_RECORD).read_text())
    except (OSError, ValueError):
        theirs = None
    if isinstance(theirs, dict) and theirs.get("fingerprint") == ours["fingerprint"]:
        return
    owner = (f"run {theirs.get('run')!r}, fingerprint {str(theirs.get('fingerprint'))[:8]}"
             if isinstance(theirs, dict) else f"a run that recorded no {RUN_RECORD}")
    raise RunDirectoryTaken(
        f"{outputs.root} holds the checkpoints of another configuration ({owner}; this one is run "
        f"{ours['run']!r}, fingerprint {ours['fingerprint'][:8]}); nothing in it was touched. Train "
        f"into a directory of its own -- another run.name (`--set run.name=NEW`, with train.out_dir "
        f"unset) or another train.out_dir -- or, if those checkpoints can go, `forgeline clean "
        f"{outputs.root}` and run again")


def preflight_train(cfg: Config) -> None:
    """Before any stage runs: train.out_dir holds no other configuration's checkpoints, the
    precision suits this machine, LoRA has a base, and the base (`model.init_from`) is readable, of an
    architecture forgeline represents, its shape agreeing with the config and fitting the layout."""
    check_run_directory(cfg)
    preflight_precision(cfg)
    if cfg.fine_tuning is not None and cfg.fine_tuning.lora is not None and not cfg.model.init_from:
        raise ConfigError(f"{cfg.objective}.lora trains adapters on a base's frozen weights, but "
                          "model.init_from is unset: the weights would stay random. Set model.init_from, "
                          f"or unset {cfg.objective}.lora to fine-tune every weight")
    if cfg.model.init_from:
        with_base(cfg, resolve_base(cfg))


def train_stage(cfg: Config, run: RunTracker, parent: RunTracker | None) -> TrainResult:
    """The train stage's function (tasks/stage.py): the torchrun job, its step metrics in `run`,
    then the loss curve."""
    trained = train_model(cfg, mlflow_run_id=run.run_id)
    outputs = TrainOutputs(Path(trained.out_dir))
    write_loss_curve(Path(cfg.ops.tracking_spool), run.run_id, outputs, run.client)
    for job_output in sorted(outputs.slurm_jobs.glob("slurm-*.out")):  # parallel.launcher=slurm
        run.log_artifact(job_output, "slurm")
    return trained


def record_training(cfg: Config, run: RunTracker, parent: RunTracker | None, result: TrainResult) -> None:
    """The data it trained on, the summary metrics, where the checkpoint is, each worker failure,
    the resolved config and the loss curve; the same, and the train run, on the parent."""
    outputs = TrainOutputs(Path(result.out_dir))
    run.log_dataset(DATASET_NAME, cfg.data.out_dir, dvc_hash(cfg.data.out_dir), "training")
    # One name per score, the parent's and the run's alike (`train/...`): a column of the runs
    # table is filled for both rows.
    summary = {"train/final_loss": result.loss, "train/tokens_seen": result.tokens_seen,
               "train/worker_failures": len(result.failures)}
    if result.val_best:
        summary["train/best_val_loss"] = result.val_best["loss"]
        if math.isfinite(result.val_best["bpb"]):  # none for a preference loss
            summary["train/best_val_bpb"] = result.val_best["bpb"]
    run.log_metrics(summary, step=result.step)
    checkpoint = {"forgeline.checkpoint": str(Path(result.checkpoint).resolve()),
                  "forgeline.checkpoint_uri": checkpoint_uri(cfg, result.checkpoint)}
    failures = {f"forgeline.worker_failure.{i + 1}": why for i, why in enumerate(result.failures)}
    run.set_tags(checkpoint | failures | base_tags(result.base))
    if result.base:
        # MLflow keeps digests of at most 36 characters; the whole sha256 is the tag's.
        run.log_dataset(BASE_INPUT_NAME, result.base["path"], result.base["weights_sha256"][:32],
                        "base-model")
    run.log_artifact(outputs.config)
    run.log_artifact(outputs.loss_plot, "train")
    if parent:
        parent.log_artifact(outputs.loss_plot, "train")
        parent.log_metrics(summary, step=result.step)
        parent.set_tags({**checkpoint, **base_tags(result.base), "forgeline.train_run_id": run.run_id})


BASE_INPUT_NAME = "base-model"  # the base's entry among the train run's MLflow inputs


def base_tags(base: dict | None) -> dict[str, str]:
    """The base a run started from, as MLflow tags: its URI, its weights' sha256 and, when it came
    from the registry, the parent model version."""
    if not base:
        return {}
    tags = {"forgeline.base": base["uri"], "forgeline.base_sha256": base["weights_sha256"]}
    if "model_version" in base:
        tags["forgeline.parent_model_version"] = base["model_version"]
    return tags


def checkpoint_uri(cfg: Config, checkpoint: str) -> str:
    """Where the checkpoint lives for good: its upload under checkpoint.persistent_url, else the
    local directory."""
    if cfg.checkpoint.persistent_url:
        return f"{cfg.checkpoint.persistent_url.rstrip('/')}/{Path(checkpoint).name}"
    return Path(checkpoint).resolve().as_uri()


def train_model(cfg: Config, mlflow_run_id: str | None = None) -> TrainResult:
    """Run the train stage; step metrics go to `mlflow_run_id` when given."""
    check_run_directory(cfg)  # the stage alone, too (its preflight runs before the pipeline)
    record = run_record(cfg)  # of the config as loaded, before a base fills in its shape
    data_dir = Path(cfg.data.out_dir)
    manifest = read_manifest(data_dir)  # fail before launching anything if the data stage has not run
    base = None
    if cfg.model.init_from:  # and if the base is unreadable, does not fit, or has another tokenizer
        base = resolve_base(cfg)
        cfg = with_base(cfg, base)
        check_data_tokenizer(base, manifest, data_dir)
    cfg.model.for_vocabulary(manifest["vocab_size"])  # and if the model's vocabulary is not the data's
    preflight_precision(cfg)
    if cfg.train.val_every:  # and if the data cannot fill one validation batch
        num_validation_batches(manifest, cfg.train.global_batch_size, cfg.train.val_batches)
    outputs = TrainOutputs(Path(cfg.train.out_dir))
    fingerprint = resume_fingerprint(cfg, sha256_file(data_dir / MANIFEST_NAME), base and base.sha256)
    set_aside_superseded(outputs.checkpoints, fingerprint)

    outputs.root.mkdir(parents=True, exist_ok=True)
    write_text_atomic(outputs.root / RUN_RECORD, json.dumps(record, indent=2) + "\n")
    write_text_atomic(outputs.config, rank_config_yaml(cfg))
    failures: list[str] = []
    rank_exceptions: list[str] = []

    # Where every node's ranks can write: a Slurm job's other nodes share only the working directory.
    stacks = Path(tempfile.mkdtemp(prefix=".stacks-", dir=outputs.root) if cfg.parallel.launcher == "slurm"
                  else tempfile.mkdtemp(prefix="forgeline-stacks-"))
    alerts = AlertForwarder.from_config(cfg, mlflow_run_id)

    def note_line(line: str) -> None:
        alerts.on_line(line)
        if (failure := describe_failure(line)) is not None:
            failures.append(failure)
            log.warning("worker failure %d: %s", len(failures), failure)
            log_hang_stacks(stacks, cfg.train.hang_timeout_s, alerts)
        elif RANK_EXCEPTION.match(line):
            rank_exceptions.append(line)

    take_preemption_record(outputs)
    env = launch_env(cfg) | {STACKS_DIR_ENV: str(stacks)}
    try:
        # Stopped from here (a timeout, Ctrl-C, a cancelled or evicted flow run), the ranks get
        # SIGTERM and the grace period to save their step, as when a scheduler preempts them.
        if cfg.parallel.launcher == "slurm":  # the batch script sizes OMP_NUM_THREADS on its nodes
            run_slurm_job(cfg, agent_args(cfg, outputs.config, mlflow_run_id, base), env, outputs.slurm_jobs,
                          outputs.preemption_record, log, on_line=note_line)
        else:
            run_streaming(torchrun_command(cfg, outputs.config, mlflow_run_id, base),
                          {"OMP_NUM_THREADS": local_threads(cfg)} | env, cfg.train.timeout_s, log,
                          grace_s=cfg.train.preemption_grace_s + LAUNCHER_GRACE_MARGIN_S, on_line=note_line)
    except LaunchError as err:
        report = unstable_report(outputs.unstable_report, fingerprint)
        if report:
            raise TrainingUnstable(report) from None
        if (preempted := take_preemption_record(outputs)) is not None:
            if isinstance(err, LaunchTimeout):  # the ranks saved on the way out; the limit stopped them
                raise LaunchTimeout(f"{err}\n{describe_preemption(preempted)}") from None
            raise TrainPreempted(describe_preemption(preempted), preempted) from None
        if rank_exceptions:  # lead with what went wrong, not with torchrun's summary
            raise LaunchError(f"training failed: {rank_exceptions[-1]}\n{err}") from None
        raise
    finally:
        log_hang_stacks(stacks, cfg.train.hang_timeout_s, alerts)
        shutil.rmtree(stacks, ignore_errors=True)
        alerts.close()

    if (preempted := take_preemption_record(outputs)) is not None:
        # Only the ranks were signalled (not torchrun, which restarts them in the job) and the
        # restart finished the run -- or torchrun exited 0 all the same.
        log.info("%s; the job went on from there", describe_preemption(preempted))
    final = latest_valid_checkpoint(outputs.checkpoints)
    if final is None or final.step != cfg.train.steps:
        found = "none" if final is None else f"step {final.step}"
        raise LaunchError(f"torchrun exited cleanly but the latest valid checkpoint in "
                          f"{outputs.checkpoints} is {found}, expected step {cfg.train.steps}")
    result = TrainResult(
        out_dir=str(outputs.root),
        checkpoint=str(final.path),
        step=final.step,
        loss=final.manifest["loss"],
        tokens_seen=final.manifest["tokens_seen"],
        layout=final.manifest["layout"],
        failures=failures,
        val_last=final.manifest.get("val_last"),
        val_best=final.manifest.get("val_best"),
        base=final.manifest.get("base"),
    )
    write_text_atomic(outputs.summary, json.dumps(asdict(result), indent=2) + "\n")
    return result


def describe_preemption(record: dict) -> str:
    return (f"preempted by {record['signal']} on {record['host']}: step {record['step']} was committed "
            f"{record['seconds_to_commit']:.1f} s after the signal (train.preemption_grace_s="
            f"{record['grace_s']:.0f}), and a retry resumes from it")


def log_hang_stacks(stacks: Path, timeout_s: int, alerts: AlertForwarder) -> None:
    """The stacks the ranks' hang watchdogs dumped (each to its own file: dumps on one stream
    would interleave), one warning per rank, and an alert naming the ranks; the files go, so each
    dump is logged once."""
    hung = []
    for path in sorted(stacks.glob("rank*.txt")):
        dump = path.read_text(errors="replace").strip()
        path.unlink()
        if dump:
            rank, restart = path.stem.removeprefix("rank").split("-restart")
            log.warning("rank %s (start %d of the group) made no step progress for %d s "
                        "(train.hang_timeout_s); its threads:\n%s", rank, int(restart) + 1, timeout_s, dump)
            hung.append(int(rank))
    alerts.report_hang(hung, timeout_s)


def rank_config_yaml(cfg: Config) -> str:
    """The config the ranks run with: the sections they read, whole, and of the eval section what
    concerns training -- not the rest, which is no input of the stage (the parent run keeps the
    whole config), so that a rerun of a stage after this one does not change this stage's output.
    Python mode, not JSON: YAML keeps what JSON cannot (a NaN in a callback argument, say)."""
    # A pretraining run's config stays as it was. A `kind: pairs` source is valid with the `pairs`
    # section that places its file (the ranks read the shards, not the pairs).
    objective = {cfg.objective} if cfg.fine_tuning is not None else set()
    pairs = {"pairs"} if cfg.pairs is not None else set()
    read = cfg.model_dump(include={"run", "data", "model", "parallel", "train", "checkpoint", *objective,
                                   *pairs})
    read["eval"] = cfg.eval.model_dump(include={"during_training", "batch_size"})
    if asked := in_training_settings(cfg):
        read["eval"]["dimensions"] = asked
    if cfg.eval.during_training.every_steps:  # it scores in the eval stage's precision
        read["eval"]["precision"] = cfg.eval.precision
    return yaml.safe_dump(read, sort_keys=False)


def in_training_settings(cfg: Config) -> dict[str, dict[str, int | bool]]:
    """How the in-training evaluation asks its tasks: their dimensions' few-shot counts and chat
    settings in the eval stage (eval.dimensions), where they set them."""
    if not cfg.eval.during_training.every_steps:
        return {}
    asked = {dimension_of(task) for task in cfg.eval.during_training.tasks}
    settings = {name: {**({"num_fewshot": dimension.num_fewshot} if dimension.num_fewshot else {}),
                       **({"chat": dimension.chat} if dimension.chat is not None else {})}
                for name, dimension in cfg.eval.dimensions.items() if name in asked}
    return {name: values for name, values in settings.items() if values}


def read_train_summary(cfg: Config) -> TrainResult:
    """The summary in `train.out_dir`, its paths under that directory: the summary holds them as
    the train stage was given them, relative to where it ran, perhaps not where this reads them
    (`--upstream-run` from another directory, a deployment's workdir)."""
    outputs = TrainOutputs(Path(cfg.train.out_dir))
    if not outputs.summary.is_file():
        raise FileNotFoundError(f"{outputs.summary} not found: run the train stage first "
                                "(`forgeline stage train`)")
    summary = TrainResult(**json.loads(outputs.summary.read_text()))
    return replace(summary, out_dir=str(outputs.root),
                   checkpoint=str(outputs.checkpoints / Path(summary.checkpoint).name))


def set_aside_superseded(root: Path, fingerprint: str) -> Path | None:
    """Move the committed checkpoints that cannot be resumed into this run -- this configuration's
    (check_run_directory), trained on data or base weights that have changed since -- intact into
    `superseded-<time>/` (returned; None if there were none), and remove partial saves a crash left
    behind. Rolled-back ones stay where they are."""
    stale = [info.path for info in committed_checkpoints(root) if info.manifest["fingerprint"] != fingerprint]
    archive = root / f"{SUPERSEDED_PREFIX}{time.strftime('%Y%m%dT%H%M%S')}" if stale else None
    for path in stale:
        archive.mkdir(exist_ok=True)
        log.warning("setting %s aside into %s: trained on other data or another base's weights than "
                    "this run's, it cannot be resumed; `forgeline clean %s` removes them",
                    path, archive, archive)
        path.rename(archive / path.name)
    for partial in root.glob(".step-*.partial") if root.is_dir() else ():
        shutil.rmtree(partial)
    return archive


def torchrun_command(cfg: Config, config_path: Path, mlflow_run_id: str | None,
                     base: Base | None = None) -> list[str]:
    """One node's launcher: standalone on one node, else a c10d rendezvous that every node's
    launcher joins (node ranks are assigned by the rendezvous)."""
    par = cfg.parallel
    if par.nnodes == 1:
        rendezvous = ["--standalone"]
    else:
        rendezvous = [f"--nnodes={par.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={par.rdzv_endpoint}",
                      f"--rdzv-id=forgeline-{cfg.content_hash()[:12]}"]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous,
            *agent_args(cfg, config_path, mlflow_run_id, base)]


def agent_args(cfg: Config, config_path: Path, mlflow_run_id: str | None, base: Base | None) -> list[str]:
    """torchrun's options after the rendezvous, and the rank program with its arguments. The
    ranks read a base's weights from where it was resolved on this node."""
    cmd = [
        f"--nproc-per-node={cfg.parallel.nproc_per_node}",
        f"--max-restarts={cfg.train.max_restarts}",
        # torchrun passes these signals on to the ranks and gives them the grace period to save
        # their step; SIGUSR1, Slurm's usual `--signal`, would otherwise kill it, the ranks with it.
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        f"--shutdown-timeout={cfg.train.preemption_grace_s}",
        "-m", "forgeline.model.training.worker",
        "--config", str(config_path.resolve()),
    ]
    if mlflow_run_id:
        cmd += ["--mlflow-run-id", mlflow_run_id]
    if base is not None:
        cmd += ["--base", json.dumps(base.lineage())]
    return cmd


def local_threads(cfg: Config) -> str:
    """OMP_NUM_THREADS for the ranks on this machine, unless set: ranks x threads <= cores, as
    oversubscribed CPU ranks slow every collective down."""
    return str(max(1, (os.cpu_count() or 1) // cfg.parallel.nproc_per_node))


def launch_env(cfg: Config) -> dict[str, str]:
    env = dict(os.environ)
    # torch 2.13's torchrun reuses the rendezvous TCP store across restarts, and restarted
    # gloo ranks then fail to connect; a fresh store per restart fixes it.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["MLFLOW_TRACKING_URI"] = resolve_tracking_uri(cfg)
    env[SPOOL_ENV] = str(Path(cfg.ops.tracking_spool).resolve())
    env[FLUSH_ENV] = str(cfg.ops.tracking_flush_s)
    env["FORGELINE_GIT_COMMIT"] = git_info()["git.commit"]
    env["PYTHONUNBUFFERED"] = "1"
    return env
