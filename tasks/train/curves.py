"""The training loss curve as files beside the checkpoints: `loss.csv` for `dvc plots` and
`loss.png` for MLflow, both built from the per-step `loss` the ranks logged to the train run --
read from the run's tracking spool, which holds it whether or not the store has it yet."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

from matplotlib.figure import Figure
from mlflow import MlflowClient

from forgeline.configs import Config
from forgeline.configs.schema import resume_fingerprint
from forgeline.model.checkpoint.manager import committed_checkpoints
from forgeline.model.fileio import sha256_file
from forgeline.model.spool import spooled_metric
from forgeline.model.training.outputs import TrainOutputs
from forgeline.model.training.shards import MANIFEST_NAME
from forgeline.tasks.atomic import write_text_atomic
from forgeline.tasks.tracking import LOSS_CURVE_METRIC

log = logging.getLogger(__name__)


def write_loss_curve(spool: Path, run_id: str, outputs: TrainOutputs,
                     client: MlflowClient | None = None) -> None:
    """The curve of the steps this run logged, after the steps of the curve already there that
    came before them: a run that resumed from a checkpoint logs only the steps after it (none
    when it resumed at the last step), and keeps the curve of the run that trained up to it.
    A run that continues a stopped one (tasks/tracking.py tracked_run) has its earlier steps in
    the spool, or once `forgeline sync` removed that, in the store (`client`'s), read then only."""
    # A restarted run logs the steps after its checkpoint again: the latest value of a step wins.
    # Values as the csv keeps them (6 digits), in the plot too: a curve drawn again from the csv
    # is the same picture, to the byte.
    spooled = spooled_metric(spool, run_id, LOSS_CURVE_METRIC)
    earlier = earlier_curve(outputs)
    if client is not None and min((step for _, _, step in spooled), default=1) > 1 and not earlier:
        spooled += stored_losses(client, run_id)
    logged = {step: float(f"{value:.6g}") for _, value, step in sorted(spooled)}  # by time: the latest wins
    resumed_at = min(logged, default=float("inf"))
    curve = {step: loss for step, loss in earlier.items() if step < resumed_at} | logged
    rows = sorted(curve.items())
    write_text_atomic(outputs.loss_csv, "step,loss\n" + "".join(f"{s},{v:.6g}\n" for s, v in rows))
    figure = Figure(figsize=(7, 4))  # no pyplot: no display, no global state
    axes = figure.subplots()
    axes.plot([s for s, _ in rows], [v for _, v in rows], color="#4C72B0")
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.set_title("training loss")
    figure.tight_layout()
    figure.savefig(outputs.loss_plot, dpi=100)


def stored_losses(client: MlflowClient, run_id: str) -> list[tuple[int, float, int]]:
    """(timestamp, value, step) of the run's loss in the store; none when it does not answer."""
    try:
        return [(m.timestamp, m.value, m.step) for m in client.get_metric_history(run_id, LOSS_CURVE_METRIC)]
    except Exception as err:  # noqa: BLE001 -- a store that fails leaves the spool's curve
        log.warning("the loss curve has only the steps in the tracking spool: the store did not answer (%s)",
                    str(err).splitlines()[0][:300] if str(err) else type(err).__name__)
        return []


def earlier_curve(outputs: TrainOutputs) -> dict[int, float]:
    if not outputs.loss_csv.is_file():
        return {}
    with outputs.loss_csv.open() as f:
        return {int(row["step"]): float(row["loss"]) for row in csv.DictReader(f)}


def stopped_run(cfg: Config) -> str | None:
    """The MLflow run of training that stopped before its last step (a SIGTERM, a preemption, a
    crash) and that this config resumes: the run its latest checkpoint records, when that
    checkpoint is short of train.steps and resumable here (its fingerprint is this config's and
    data's). The train stage continues that run, so that one run holds the whole loss curve."""
    manifest = Path(cfg.data.out_dir) / MANIFEST_NAME
    latest = next(iter(committed_checkpoints(TrainOutputs(Path(cfg.train.out_dir)).checkpoints)), None)
    if latest is None or latest.step >= cfg.train.steps or not manifest.is_file():
        return None
    base_sha256 = (latest.manifest.get("base") or {}).get("weights_sha256")
    if latest.manifest["fingerprint"] != resume_fingerprint(cfg, sha256_file(manifest), base_sha256):
        return None
    return latest.manifest.get("mlflow_run_id")
