"""Rank-side training program, launched by torchrun (see tasks/train.py):

    torchrun --nproc-per-node=N -m forgeline.model.train --config resolved.yaml [--mlflow-run-id ID]

Builds the model on the meta device, splits it into pipeline stages, applies tensor parallel,
activation checkpointing, compile and FSDP2, materializes and initializes it, resumes from the
latest valid checkpoint, and trains. Checkpointing and metrics hang off the loop as callbacks.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh

from forgeline.configs import Config, load_config
from forgeline.configs.schema import resume_fingerprint
from forgeline.model.amp import DynamicLossScaler
from forgeline.model.checkpoint import CheckpointManager, ModelState, OptimizerState
from forgeline.model.data import MANIFEST_NAME, ShardedSampleLoader, read_manifest, split_shards
from forgeline.model.fileio import sha256_file
from forgeline.model.llama import ModelArgs, Transformer
from forgeline.model.metrics import MetricsLogger, measure_peak_flops
from forgeline.model.optim import build_lr_scheduler, build_optimizer
from forgeline.model.parallel import ParallelDims, init_distributed, resolve_precision
from forgeline.model.parallelize import parallelize
from forgeline.model.pipeline import build_schedule, pipeline_split
from forgeline.model.step import TrainStep, scaled_loss

log = logging.getLogger("forgeline.model.train")


class TrainerState(Stateful):
    """Everything besides model and optimizer that a resume must restore."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LRScheduler],
                 loader: ShardedSampleLoader, scaler: DynamicLossScaler | None):
        self.step = 0
        self.tokens_seen = 0
        self.schedulers = schedulers
        self.loader = loader
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "tokens_seen": self.tokens_seen,
                 "scheduler": self.schedulers[0].state_dict(), "loader": self.loader.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


def model_args(cfg: Config, vocab_size: int) -> ModelArgs:
    return ModelArgs(vocab_size=vocab_size, **cfg.model.model_dump())


def build_model_parts(cfg: Config, args: ModelArgs, dims: ParallelDims, mesh: DeviceMesh,
                      device: torch.device, param_dtype: torch.dtype) -> list[tuple[int, nn.Module]]:
    """This rank's (stage index, module) pairs -- one (0, whole model) without pipeline
    parallelism -- built in the order: meta -> pipeline split -> TP -> AC -> compile -> FSDP ->
    materialize -> initialize (values depend only on the seed, not on the layout)."""
    with torch.device("meta"):
        model = Transformer(args)
    if dims.pp_enabled:
        parts = pipeline_split(model, mesh["pp"].get_local_rank(), cfg.parallel)
    else:
        parts = [(0, model)]
    for _, part in parts:
        parallelize(part, dims, mesh, cfg.parallel, param_dtype)
        part.to_empty(device=device)
        part.init_weights(cfg.train.seed)
    return parts


class Callback:
    """A side concern of the loop; hooks are no-ops unless overridden."""

    def post_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        pass

    def on_train_end(self, trainer: Trainer) -> None:
        pass


@dataclass
class Trainer:
    """Decides when things happen; TrainStep decides what a step does."""

    total_steps: int
    state: TrainerState
    loader: ShardedSampleLoader
    train_step: TrainStep
    device: torch.device
    tokens_per_step: int
    callbacks: list[Callback] = field(default_factory=list)

    def fit(self) -> None:
        while self.state.step < self.total_steps:
            started = time.perf_counter()
            batch = self.loader.next_batch().to(self.device)
            data_wait = time.perf_counter() - started
            lr = self.state.schedulers[0].get_last_lr()[0]
            result = self.train_step(batch)
            step_time = time.perf_counter() - started
            self.state.step += 1
            self.state.tokens_seen += self.tokens_per_step
            metrics = {"loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                       "tokens_per_s": self.tokens_per_step / step_time, "step_time_s": step_time,
                       "data_wait_s": data_wait}
            if self.train_step.scaler is not None:
                metrics |= {"loss_scale": self.train_step.scaler.scale, "skipped": float(result.skipped)}
            for callback in self.callbacks:
                callback.post_step(self, metrics)
        for callback in self.callbacks:
            callback.on_train_end(self)


@dataclass
class MetricsCallback(Callback):
    logger: MetricsLogger

    def post_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.logger.log_step(trainer.state.step, metrics)

    def on_train_end(self, trainer: Trainer) -> None:
        self.logger.close()


@dataclass
class CheckpointCallback(Callback):
    manager: CheckpointManager
    state: dict[str, Stateful]
    every_steps: int
    meta: dict[str, Any]

    def post_step(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        step = trainer.state.step
        if step % self.every_steps == 0 or step == trainer.total_steps:
            self.manager.save(step, self.state, self.meta | {"loss": metrics["loss"],
                                                             "tokens_seen": trainer.state.tokens_seen})


def train(cfg: Config, device: torch.device, rank: int, world_size: int, run_id: str | None) -> None:
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    mesh, dp_mesh = dims.build_mesh(device.type)
    param_dtype = resolve_precision(cfg.train.precision, device.type)
    data_dir = Path(cfg.data.out_dir)
    manifest = read_manifest(data_dir)
    args = model_args(cfg, manifest["vocab_size"])
    parts = build_model_parts(cfg, args, dims, mesh, device, param_dtype)
    modules = [module for _, module in parts]
    optimizers = [build_optimizer(module, cfg.train) for module in modules]
    schedulers = [build_lr_scheduler(optimizer, cfg.train) for optimizer in optimizers]
    scaler = DynamicLossScaler() if param_dtype == torch.float16 else None
    loader = ShardedSampleLoader(
        split_shards(data_dir, manifest, "train"),
        local_batch_size=cfg.train.global_batch_size // dims.dp,
        dp_rank=dp_mesh.get_local_rank(),
        dp_size=dims.dp,
        seed=cfg.train.seed,
    )
    stage_ids = [stage_id for stage_id, _ in parts]
    train_step = TrainStep(
        parts=modules, optimizers=optimizers, schedulers=schedulers,
        grad_accum_steps=cfg.train.grad_accum_steps, grad_clip=cfg.train.grad_clip, device=device,
        dp_group=dp_mesh.get_group(),
        pp_group=mesh["pp"].get_group() if dims.pp_enabled else None,
        is_first_stage=0 in stage_ids, is_last_stage=cfg.parallel.num_stages - 1 in stage_ids,
        loss_parallel=dims.tp_enabled and cfg.parallel.loss_parallel,
        # Without FSDP there is no MixedPrecisionPolicy to cast parameters: autocast instead.
        autocast_dtype=param_dtype if param_dtype != torch.float32 and not dims.dp_enabled else None,
        scaler=scaler,
    )
    if dims.pp_enabled:
        train_step.schedule = build_schedule(
            parts, cfg.parallel, mesh["pp"], device,
            loss_fn=lambda logits, targets: scaled_loss(
                logits, targets, cfg.train.grad_accum_steps * cfg.parallel.pp_microbatches, scaler),
        )

    trainer_state = TrainerState(schedulers, loader, scaler)
    state = {"model": ModelState(modules), "optim": OptimizerState(modules, optimizers),
             "train": trainer_state}
    data_manifest = {"path": str(data_dir / MANIFEST_NAME),
                     "sha256": sha256_file(data_dir / MANIFEST_NAME)}
    checkpoints = CheckpointManager(Path(cfg.train.out_dir) / "checkpoints", cfg.checkpoint.keep_last, rank,
                                    resume_fingerprint(cfg, data_manifest["sha256"]))
    checkpoints.load_latest(state)

    tokens_per_step = cfg.train.global_batch_size * manifest["seq_len"]
    metrics = MetricsLogger(run_id, rank, cfg.train.log_every, cfg.train.steps,
                            flops_per_step=args.flops_per_token(manifest["seq_len"]) * tokens_per_step,
                            peak_flops=total_peak_flops(cfg, device), device=device)
    layout = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp,
              "world_size": world_size, "pp_schedule": cfg.parallel.pp_schedule if dims.pp_enabled else None}
    if rank == 0:
        log.info("model: %.2fM parameters; layout %s on %s, %s; starting at step %d/%d",
                 args.num_params() / 1e6, layout, device, param_dtype, trainer_state.step, cfg.train.steps)
    trainer = Trainer(
        total_steps=cfg.train.steps, state=trainer_state, loader=loader, train_step=train_step,
        device=device, tokens_per_step=tokens_per_step,
        callbacks=[
            MetricsCallback(metrics),
            CheckpointCallback(checkpoints, state, cfg.checkpoint.every_steps,
                               {"layout": layout, "model_args": args.to_dict(),
                                "data_manifest": data_manifest}),
        ],
    )
    trainer.fit()


def total_peak_flops(cfg: Config, device: torch.device) -> float:
    """The peak MFU is measured against, summed over all ranks: configured per device, or an
    fp32 matmul measured on every rank at once."""
    if cfg.train.peak_tflops is not None:
        return cfg.train.peak_tflops * 1e12 * dist.get_world_size()
    peak = torch.tensor([measure_peak_flops(device)], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.SUM)
    return peak.item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m forgeline.model.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="resolved run config (YAML)")
    parser.add_argument("--mlflow-run-id", help="MLflow run that receives the step metrics")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    device, rank, world_size = init_distributed()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        train(cfg, device, rank, world_size, args.mlflow_run_id)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
