"""The training loss curve as files beside the checkpoints: `loss.csv` for `dvc plots` and
`loss.png` for MLflow, both built from the per-step `loss` the ranks logged to the train run."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from mlflow import MlflowClient

from forgeline.tasks.atomic import write_text_atomic

LOSS_CSV = "loss.csv"
LOSS_PLOT = "loss.png"


def write_loss_curve(client: MlflowClient, run_id: str, out_dir: Path) -> None:
    # A resumed run logs the steps after its checkpoint again: the latest value of a step wins.
    history = sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.timestamp)
    curve = sorted({m.step: m.value for m in history}.items())
    write_text_atomic(out_dir / LOSS_CSV, "step,loss\n" + "".join(f"{s},{v:.6g}\n" for s, v in curve))
    figure = Figure(figsize=(7, 4))  # no pyplot: no display, no global state
    axes = figure.subplots()
    axes.plot([s for s, _ in curve], [v for _, v in curve], color="#4C72B0")
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.set_title("training loss")
    figure.tight_layout()
    figure.savefig(out_dir / LOSS_PLOT, dpi=100)
