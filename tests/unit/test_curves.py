"""The loss curve of a train stage that resumed keeps the steps before its resume point: a rerun
that resumes at the last step (the stage cache missed on a code change) logs no step, and must not
leave an empty curve behind. The curve is read from the run's tracking spool, where the ranks'
losses are whether or not the tracking store has them yet."""

from __future__ import annotations

from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric

from forgeline.model.spool import TrackingSpool
from forgeline.model.training.outputs import TrainOutputs
from forgeline.tasks.train.curves import earlier_curve, write_loss_curve


def run_with_losses(client: MlflowClient, spool_root: Path, losses: dict[int, float]) -> str:
    """A run whose logging rank spooled `losses` (one step a batch, as at log_every=1)."""
    run_id = client.create_run(client.create_experiment(f"e{len(client.search_experiments())}")).info.run_id
    spool = TrackingSpool(spool_root, run_id, client.tracking_uri, "rank0")
    for step, loss in losses.items():
        spool.log_batch([("loss", loss, 1000 + step, step)])
    spool.close(30)
    return run_id


def test_a_resumed_run_keeps_the_curve_before_its_resume_point(tmp_path: Path) -> None:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    spool = tmp_path / "spool"
    outputs = TrainOutputs(tmp_path / "train")
    outputs.root.mkdir()
    first = {step: 10.0 - step / 7 for step in range(1, 21)}
    write_loss_curve(spool, run_with_losses(client, spool, first), outputs)
    assert earlier_curve(outputs) == {step: float(f"{loss:.6g}") for step, loss in first.items()}
    picture = outputs.loss_plot.read_bytes()

    write_loss_curve(spool, run_with_losses(client, spool, {}), outputs)  # resumed at the last step
    assert earlier_curve(outputs) == {step: float(f"{loss:.6g}") for step, loss in first.items()}
    assert outputs.loss_plot.read_bytes() == picture  # the output of the stage is as it was

    rolled_back = {step: 1.0 for step in range(11, 21)}  # resumed at step 10, steps 11-20 again
    write_loss_curve(spool, run_with_losses(client, spool, rolled_back), outputs)
    kept = {step: float(f"{first[step]:.6g}") for step in range(1, 11)}
    assert earlier_curve(outputs) == kept | rolled_back

    retrained = {step: 2.0 for step in range(1, 6)}  # another configuration: from step 1
    write_loss_curve(spool, run_with_losses(client, spool, retrained), outputs)
    assert earlier_curve(outputs) == retrained


def test_a_continued_run_whose_earlier_steps_left_the_spool_draws_them_from_the_store(tmp_path: Path) -> None:
    """A training stopped and continued in the same run (tasks/tracking.py tracked_run) after
    `forgeline sync` removed the stopped attempt's spool: steps 1-10 are in the store only."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    spool = tmp_path / "spool"
    outputs = TrainOutputs(tmp_path / "train")
    outputs.root.mkdir()
    resumed = {step: 5.0 for step in range(11, 21)}
    run_id = run_with_losses(client, spool, resumed)
    client.log_batch(run_id, [Metric("loss", 10.0 - step / 7, 1000 + step, step) for step in range(1, 11)])
    write_loss_curve(spool, run_id, outputs)  # without the store: the spool's steps alone
    assert earlier_curve(outputs) == resumed
    outputs.loss_csv.unlink()
    write_loss_curve(spool, run_id, outputs, client)
    assert sorted(earlier_curve(outputs)) == list(range(1, 21))
