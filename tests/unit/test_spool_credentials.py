"""The tracking spool keeps no credential of the store's URI on disk: its files name the store
masked, and replay finds the store through this process's URI when the masked forms agree."""

from __future__ import annotations

from pathlib import Path

from mlflow import MlflowClient

from forgeline.model.spool import TrackingSpool, replay, spool_files

SECRET = "hunter2-spool"


def test_a_store_uri_with_a_credential_is_written_masked_and_replayed_through_the_live_uri(
        tmp_path: Path) -> None:
    # A store whose URI carries a token (sqlite ignores it, as a database URI's password would be
    # used), down while the run writes: its directory is away.
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}?token={SECRET}"
    (tmp_path / "store").mkdir()
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("spool")).info.run_id
    (tmp_path / "store").rename(tmp_path / "away")
    spool = TrackingSpool(tmp_path / "spool", run_id, uri, "rank0")
    spool.log_batch([("loss", 1.5, 1000, 1)], params={"lr": "0.1"}, wait=True)
    assert spool.close(0.5) == 2

    on_disk = "".join(path.read_text() for path in (tmp_path / "spool").rglob("*") if path.is_file())
    assert SECRET not in on_disk
    [path] = spool_files(tmp_path / "spool")
    assert f'"tracking_uri": "sqlite:///{tmp_path / "store" / "mlflow.db"}?token=***"' in path.read_text()

    (tmp_path / "away").rename(tmp_path / "store")
    # Another store is no way to this one: the writes wait.
    assert replay(tmp_path / "spool", tracking_uri=f"sqlite:///{tmp_path / 'other.db'}") == (0, 2)
    # The same store, its token changed since: they go.
    assert replay(tmp_path / "spool", tracking_uri=uri.replace(SECRET, "rotated")) == (2, 0)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 1.5)]
    assert client.get_run(run_id).data.params == {"lr": "0.1"}
