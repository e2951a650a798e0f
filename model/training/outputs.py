"""What a training run keeps in its output directory (`train.out_dir`): the one place that
names these files, for the ranks that write them, the train stage, the operations on checkpoint
versions and the stages downstream that read them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrainOutputs:
    root: Path

    @property
    def checkpoints(self) -> Path:
        """Committed checkpoints, `step-NNNNNNNN/` each (model/checkpoint/manager.py)."""
        return self.root / "checkpoints"

    @property
    def config(self) -> Path:
        """The resolved config the ranks ran with."""
        return self.root / "config.yaml"

    @property
    def summary(self) -> Path:
        """The train stage's result, written once the last step's checkpoint is committed."""
        return self.root / "train.json"

    @property
    def unstable_report(self) -> Path:
        """Written when a configuration gave up on instability, so a restart fails fast."""
        return self.root / "unstable.json"

    @property
    def preemption_record(self) -> Path:
        """Written by a preempted attempt once its last step is committed (training/preemption.py);
        the launcher reads it and removes it."""
        return self.root / "preempted.json"

    @property
    def slurm_jobs(self) -> Path:
        """With parallel.launcher=slurm: the batch script and each job's output file."""
        return self.root / "slurm"

    @property
    def loss_csv(self) -> Path:
        """The training loss per step, for `dvc plots`."""
        return self.root / "loss.csv"

    @property
    def loss_plot(self) -> Path:
        """The same curve as a picture, for MLflow."""
        return self.root / "loss.png"
