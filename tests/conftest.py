"""Shared fixtures: every test runs on the debug config (configs/debug.yaml) with all outputs
redirected into a temporary directory, against a real local MLflow store."""

from __future__ import annotations

from pathlib import Path

import pytest

from forgeline.configs.environment import apply_environment_defaults

apply_environment_defaults()  # forgeline's offline and telemetry defaults, before any test imports

from forgeline.configs import Config, load_config  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def output_overrides(root: Path) -> list[str]:
    return [
        f"data.out_dir={root / 'data'}",
        f"data.raw_dir={root / 'raw'}",
        f"train.out_dir={root / 'train'}",
        f"eval.out_dir={root / 'eval'}",
        f"registry.out_dir={root / 'register'}",
        f"registry.tracking_uri=sqlite:///{root / 'mlflow.db'}",
        f"registry.artifact_location={root / 'mlartifacts'}",
        f"ops.tracking_spool={root / 'tracking-spool'}",
    ]


def debug_config(root: Path, *overrides: str) -> Config:
    return load_config("debug.yaml", output_overrides(root) + list(overrides))


@pytest.fixture(scope="session")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The debug data stage, built once per session (read-only for tests)."""
    from forgeline.tasks.data.build import build_dataset

    root = tmp_path_factory.mktemp("shared")
    build_dataset(debug_config(root))
    return root


def random_lm(tokenizer: Path, bundle_dir: Path, max_seq_len: int, batch_size: int):
    """A `forgeline` lm-eval model over a tiny randomly initialized model (fixed seed), loaded
    from an inference bundle the way a user's would be."""
    from forgeline.configs.schema import ModelConfig
    from forgeline.eval.lm import ForgelineLM  # lm-eval: imported by the tests that need it only
    from forgeline.model.inference import save_bundle
    from forgeline.model.llama import Transformer

    model = Transformer(ModelConfig(vocab_size=512, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    ffn_dim=64, max_seq_len=max_seq_len))
    model.init_weights(0)
    save_bundle(model, bundle_dir)
    return ForgelineLM(bundle=str(bundle_dir), tokenizer=str(tokenizer), batch_size=batch_size)
