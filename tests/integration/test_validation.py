"""Validation during training (train.val_every) with real torchrun ranks on the debug model: every
layout computes the single process's validation loss on the same weights, and training is
bit-identical with validation on or off.

Run as a module under torchrun, this file is also the rank program of the layout checks: it
builds the model in a layout as the train stage's ranks do, loads a checkpoint's weights and
writes the validation figures of its ValidationCallback."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mlflow import MlflowClient

from forgeline.configs import Config, load_config
from forgeline.model.checkpoint.manager import ModelState
from forgeline.model.parallel.mesh import build_meshes, init_distributed
from forgeline.model.training.callbacks import ValidationCallback
from forgeline.model.training.loader import ShardedSampleLoader
from forgeline.model.training.metrics import bits_per_byte
from forgeline.model.training.shards import read_manifest, split_shards
from forgeline.model.training.worker import build_model_parts, build_train_step
from forgeline.tasks.runner import run_stage
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import resolve_tracking_uri
from forgeline.tasks.train.job import TrainResult, rank_config_yaml, train_model
from tests.conftest import REPO_ROOT, debug_config
from tests.integration.helpers import run_ranks

pytestmark = pytest.mark.integration

STEPS = 6
# 4 layers so that a V schedule can place 2 stages on each of 2 pipeline ranks.
BASE = ["model.n_layers=4", f"train.steps={STEPS}", "checkpoint.every_steps=100", "train.peak_tflops=1",
        "train.val_every=100", "train.val_batches=4"]
LAYOUTS = {
    "dp2": ["parallel.dp_shard=2"],
    "tp2": ["parallel.tp=2"],
    "pp2-1F1B": ["parallel.pp=2"],
    "pp2-ZBVZeroBubble": ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble",
                          "parallel.pp_stages_per_rank=2"],
}
SLOW_LAYOUTS = {
    "pp2xdp2-accum2": ["parallel.pp=2", "parallel.dp_shard=2", "train.grad_accum_steps=2"],
    "pp2xdp2xtp2": ["parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2"],
}


@pytest.fixture(scope="module")
def reference(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainResult]:
    """One process trains STEPS steps and validates at the last: the weights, and the loss the
    layouts must reproduce on them."""
    root = tmp_path_factory.mktemp("validation")
    result = train_model(debug_config(root, f"data.out_dir={data_root / 'data'}", *BASE))
    assert result.val_last["step"] == STEPS and result.val_best == result.val_last
    return root, result


def validate_in_layout(data_root: Path, root: Path, checkpoint: str, name: str, overrides: list[str]) -> dict:
    cfg = debug_config(root, f"data.out_dir={data_root / 'data'}", *BASE, *overrides)
    config_path, out = root / f"{name}.yaml", root / f"{name}.json"
    config_path.write_text(rank_config_yaml(cfg))
    run_ranks("tests.integration.test_validation", cfg.parallel.world_size,
              ["--config", str(config_path), "--checkpoint", checkpoint, "--out", str(out)], REPO_ROOT)
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", [*LAYOUTS, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW_LAYOUTS)])
def test_layout_gives_the_single_process_validation_loss(name: str, data_root: Path,
                                                         reference: tuple[Path, TrainResult]) -> None:
    root, result = reference
    figures = validate_in_layout(data_root, root, result.checkpoint, name, (LAYOUTS | SLOW_LAYOUTS)[name])
    assert figures["loss"] == pytest.approx(result.val_last["loss"], rel=1e-5)
    assert figures["bpb"] == pytest.approx(result.val_last["bpb"], rel=1e-5)
    assert figures["text_bytes"] > figures["tokens"]  # a 512-token vocabulary: some tokens are several bytes


def metric_history(cfg: Config, checkpoint: str, key: str) -> list[tuple[int, float]]:
    client = MlflowClient(resolve_tracking_uri(cfg))
    [run] = client.search_runs([client.get_experiment_by_name("forgeline-debug").experiment_id],
                               filter_string=f"tags.`forgeline.checkpoint` = '{Path(checkpoint).resolve()}'")
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


@pytest.mark.parametrize("layout", [
    pytest.param(["parallel.pp=2"], id="pp2-1F1B"),  # validation switches the schedule to eval and back
    # FSDP units left gathered by a forward without backward are sharded again; stage after stage.
    pytest.param(["model.n_layers=4", "parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble",
                  "parallel.pp_stages_per_rank=2", "parallel.dp_shard=2"],
                 id="pp2xdp2-ZBV", marks=pytest.mark.slow),
])
def test_training_is_bit_identical_with_validation_on_or_off(layout: list[str], data_root: Path,
                                                              tmp_path: Path) -> None:
    common = [f"data.out_dir={data_root / 'data'}", "train.steps=8", "checkpoint.every_steps=4",
              "train.deterministic=true", "train.peak_tflops=1", *layout]
    runs = {}
    for val_every in (0, 3):
        cfg = debug_config(tmp_path, *common, f"train.out_dir={tmp_path / f'val{val_every}'}",
                           f"train.val_every={val_every}")
        runs[val_every] = (cfg, run_stage(stage_named("train"), cfg))
    (off_cfg, off), (on_cfg, on) = runs[0], runs[3]
    for key in ("loss", "grad_norm"):
        assert metric_history(on_cfg, on.checkpoint, key) == metric_history(off_cfg, off.checkpoint, key)
    assert off.val_last is None and off.val_best is None
    val_losses = metric_history(on_cfg, on.checkpoint, "val/loss")
    assert [step for step, _ in val_losses] == [3, 6, 8]  # every 3 steps and at the last
    assert [step for step, _ in metric_history(on_cfg, on.checkpoint, "val/bpb")] == [3, 6, 8]
    best_step, best_loss = min(val_losses, key=lambda s: s[1])
    assert on.val_last["step"] == 8 and on.val_last["loss"] == pytest.approx(val_losses[-1][1])
    assert on.val_best["step"] == best_step and on.val_best["loss"] == pytest.approx(best_loss)
    summary = json.loads((tmp_path / "val3" / "train.json").read_text())
    assert summary["val_best"] == on.val_best


def rank_main(argv: list[str] | None = None) -> None:
    """The rank program of validate_in_layout."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    device, rank, world_size = init_distributed()
    try:
        mesh, dp_mesh = build_meshes(cfg.parallel, world_size, device.type)
        data_dir = Path(cfg.data.out_dir)
        manifest = read_manifest(data_dir)
        parts = build_model_parts(cfg, cfg.model.for_vocabulary(manifest["vocab_size"]), mesh, device,
                                  torch.float32)
        train_step = build_train_step(cfg, mesh, dp_mesh, parts, device, torch.float32)
        dcp.load({"model": ModelState(train_step.parts)}, checkpoint_id=args.checkpoint)
        loader = ShardedSampleLoader(split_shards(data_dir, manifest, "train"),
                                     cfg.train.global_batch_size // cfg.parallel.dp, dp_mesh.get_local_rank(),
                                     cfg.parallel.dp, cfg.train.seed)
        validation = ValidationCallback.from_data(cfg.train, data_dir, manifest, loader, train_step.dp_group,
                                                  device)
        loss = train_step.validation_loss(validation.batches)
        if rank == 0:
            Path(args.out).write_text(json.dumps({
                "loss": loss, "bpb": bits_per_byte(loss, validation.tokens, validation.text_bytes),
                "tokens": validation.tokens, "text_bytes": validation.text_bytes}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_main()
