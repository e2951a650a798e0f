"""Rank-side training program, launched by torchrun (see tasks/train.py):

    torchrun --nproc-per-node=N -m forgeline.model.train --config resolved.yaml [--mlflow-run-id ID]

Builds the model on the meta device, splits it into pipeline stages, applies tensor parallel,
activation checkpointing, compile and FSDP2, materializes and initializes it, resumes from the
latest valid checkpoint, and hands a Trainer (model/trainer.py) its step and callbacks
(model/callbacks.py).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from forgeline.configs import Config, load_config
from forgeline.configs.schema import resume_fingerprint
from forgeline.model.amp import DynamicLossScaler
from forgeline.model.callbacks import (
    UNSTABLE_REPORT,
    CheckpointCallback,
    InTrainingEvalCallback,
    MetricsCallback,
    StabilityCallback,
    TrainingUnstable,
    WatchdogCallback,
    load_callback,
    unstable_report,
)
from forgeline.model.checkpoint import CheckpointManager, ModelState, OptimizerState, RNGState
from forgeline.model.data import MANIFEST_NAME, ShardedSampleLoader, read_manifest, split_shards
from forgeline.model.fileio import sha256_file
from forgeline.model.llama import ModelArgs, Transformer
from forgeline.model.metrics import MetricsLogger, measure_peak_flops
from forgeline.model.optim import build_lr_scheduler, build_optimizer
from forgeline.model.parallel import ParallelDims, init_distributed, resolve_precision
from forgeline.model.parallelize import parallelize
from forgeline.model.pipeline import build_schedule, pipeline_split
from forgeline.model.step import TrainStep, scaled_loss
from forgeline.model.trainer import Trainer, TrainerState

log = logging.getLogger("forgeline.model.train")


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


def build_train_step(cfg: Config, dims: ParallelDims, mesh: DeviceMesh, dp_mesh: DeviceMesh,
                     parts: list[tuple[int, nn.Module]], device: torch.device,
                     param_dtype: torch.dtype) -> TrainStep:
    """Optimizers and LR schedules per model part, the fp16 loss scaler, and the pipeline
    schedule when there is one."""
    modules = [module for _, module in parts]
    optimizers = [build_optimizer(module, cfg.train) for module in modules]
    scaler = DynamicLossScaler() if param_dtype == torch.float16 else None
    stage_ids = [stage_id for stage_id, _ in parts]
    train_step = TrainStep(
        parts=modules, optimizers=optimizers,
        schedulers=[build_lr_scheduler(optimizer, cfg.train) for optimizer in optimizers],
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
    return train_step


def train(cfg: Config, device: torch.device, rank: int, world_size: int, run_id: str | None) -> None:
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    mesh, dp_mesh = dims.build_mesh(device.type)
    param_dtype = resolve_precision(cfg.train.precision, device.type)
    data_dir = Path(cfg.data.out_dir)
    manifest = read_manifest(data_dir)
    args = model_args(cfg, manifest["vocab_size"])
    parts = build_model_parts(cfg, args, dims, mesh, device, param_dtype)
    train_step = build_train_step(cfg, dims, mesh, dp_mesh, parts, device, param_dtype)
    loader = ShardedSampleLoader(
        split_shards(data_dir, manifest, "train"),
        local_batch_size=cfg.train.global_batch_size // dims.dp,
        dp_rank=dp_mesh.get_local_rank(),
        dp_size=dims.dp,
        seed=cfg.train.seed,
    )
    trainer_state = TrainerState(train_step.schedulers, loader, train_step.scaler)
    state = {"model": ModelState(train_step.parts),
             "optim": OptimizerState(train_step.parts, train_step.optimizers),
             "train": trainer_state, "rng": RNGState(rank)}
    data_manifest = {"path": str(data_dir / MANIFEST_NAME),
                     "sha256": sha256_file(data_dir / MANIFEST_NAME)}
    fingerprint = resume_fingerprint(cfg, data_manifest["sha256"])
    out_dir = Path(cfg.train.out_dir)
    report = unstable_report(out_dir, fingerprint)
    if report:  # an automatic restart of a run that already gave up: fail fast, same report
        raise TrainingUnstable(report)
    checkpoints = CheckpointManager(out_dir / "checkpoints", cfg.checkpoint, rank, world_size, fingerprint)
    checkpoints.load_latest(state)

    tokens_per_step = cfg.train.global_batch_size * manifest["seq_len"]
    metrics = MetricsLogger(run_id, rank, cfg.train.log_every, cfg.train.steps,
                            flops_per_step=args.flops_per_token(manifest["seq_len"]) * tokens_per_step,
                            peak_flops=total_peak_flops(cfg, device), device=device)
    layout = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp,
              "world_size": world_size, "pp_schedule": cfg.parallel.pp_schedule if dims.pp_enabled else None}
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        log.info("model: %.2fM parameters; layout %s on %s, %s; starting at step %d/%d%s",
                 args.num_params() / 1e6, layout, device, param_dtype, trainer_state.step, cfg.train.steps,
                 f" (in-job restart {restart})" if restart else "")
    meta = {"layout": layout, "model_args": args.to_dict(), "data_manifest": data_manifest,
            "config_sha256": cfg.section_hash(),
            "git_commit": os.environ.get("FORGELINE_GIT_COMMIT", "unknown")}
    callbacks = [
        MetricsCallback(metrics),
        StabilityCallback(cfg.train, checkpoints, state, metrics, out_dir / UNSTABLE_REPORT, fingerprint,
                          rank),
        CheckpointCallback(checkpoints, state, cfg.checkpoint.every_steps, meta),
        *(load_callback(spec) for spec in cfg.train.callbacks),
    ]
    if cfg.train.hang_timeout_s:
        callbacks.insert(0, WatchdogCallback(cfg.train.hang_timeout_s))
    if cfg.eval.during_training.every_steps and rank == 0 and run_id:
        callbacks.append(InTrainingEvalCallback(cfg.eval.during_training, out_dir / "checkpoints", data_dir,
                                                run_id, cfg.eval.batch_size))
    Trainer(total_steps=cfg.train.steps, state=trainer_state, train_step=train_step, device=device,
            tokens_per_step=tokens_per_step, callbacks=callbacks).fit()


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
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # required by cuBLAS
        torch.use_deterministic_algorithms(True)
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
