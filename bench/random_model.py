"""A config's model with random weights on the eval stage's suite, for the eval benchmarks:
the data stage's output, the model exported to Hugging Face format, the rendered suite."""

from __future__ import annotations

from pathlib import Path

from lm_eval.tasks import TaskManager

from forgeline.configs import Config, load_config
from forgeline.eval.suite import render_suite, suite_task_manager
from forgeline.model.hf import export_hf
from forgeline.model.training.shards import read_manifest
from forgeline.model.transformer import Transformer
from forgeline.tasks.data.build import build_dataset


def random_model_on_suite(config: str, workdir: Path) -> tuple[Config, Transformer, Path, TaskManager]:
    """(the config, its model with seed-0 random weights, that model's Hugging Face export,
    a TaskManager over the suite rendered for its data), everything under `workdir`."""
    cfg = load_config(config, [f"data.out_dir={workdir / 'data'}", f"data.raw_dir={workdir / 'raw'}"])
    build_dataset(cfg)
    model = Transformer(cfg.model.for_vocabulary(read_manifest(workdir / "data")["vocab_size"]))
    model.init_weights(0)
    hf_dir = export_hf(model, workdir / "data" / "tokenizer", workdir / "hf")
    task_manager = suite_task_manager(render_suite(workdir / "tasks", workdir / "data"))
    return cfg, model, hf_dir, task_manager
