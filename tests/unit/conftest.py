"""Fixtures of the unit tests: a one-process gloo group, and a real MLflow registry to read and
write."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from mlflow import MlflowClient

from forgeline.configs import Config


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    """torch.distributed in this process alone (world size 1), for the code that asks it."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sqlite store with MLflow's schema, created once (its migrations take seconds)."""
    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def sqlite_registry(tmp_path: Path, empty_store: Path,
                    version_tags: dict[str, str] | None = None) -> tuple[Config, MlflowClient]:
    """A copy of `empty_store` in `tmp_path` holding model `m` with versions 1 and 2 (tagged
    `version_tags`), and a config that registers there."""
    shutil.copy(empty_store, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri, uri)
    client.create_registered_model("m")
    for _ in range(2):
        client.create_model_version("m", str(tmp_path), tags=version_tags)
    return Config().with_values({"registry.tracking_uri": uri, "registry.model_name": "m"}), client
