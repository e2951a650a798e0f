"""Rank-side training program, launched by torchrun (see tasks/train.py):

    torchrun --nproc-per-node=N -m forgeline.model.train --config resolved.yaml [--mlflow-run-id ID]

Builds the model on the meta device, applies the parallel layout, materializes and initializes
it, resumes from the latest valid checkpoint, trains, and checkpoints every N steps and at the
end. Global rank 0 logs metrics.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful

from forgeline.configs import Config, load_config
from forgeline.configs.schema import resume_fingerprint
from forgeline.model.checkpoint import CheckpointManager, ModelState, OptimizerState
from forgeline.model.data import MANIFEST_NAME, ShardedSampleLoader, read_manifest, split_shards
from forgeline.model.fileio import sha256_file
from forgeline.model.llama import ModelArgs, Transformer
from forgeline.model.metrics import MetricsLogger
from forgeline.model.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from forgeline.model.parallel import ParallelDims, init_distributed
from forgeline.model.parallelize import parallelize

log = logging.getLogger("forgeline.model.train")


class TrainerState(Stateful):
    """Everything besides model and optimizer that a resume must restore."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, loader: ShardedSampleLoader):
        self.step = 0
        self.tokens_seen = 0
        self.scheduler = scheduler
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen,
                "scheduler": self.scheduler.state_dict(), "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])


def model_args(cfg: Config, vocab_size: int) -> ModelArgs:
    return ModelArgs(vocab_size=vocab_size, **cfg.model.model_dump())


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
               grad_clip: float) -> tuple[torch.Tensor, float]:
    """One optimizer step on a (B, T + 1) batch; returns (local loss, global grad norm)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    grad_norm = clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm.item()


def train(cfg: Config, device: torch.device, rank: int, world_size: int, run_id: str | None) -> None:
    dims = ParallelDims(dp=cfg.parallel.dp, tp=cfg.parallel.tp, world_size=world_size)
    mesh = dims.build_mesh(device.type)
    data_dir = Path(cfg.data.out_dir)
    manifest = read_manifest(data_dir)
    args = model_args(cfg, manifest["vocab_size"])

    with torch.device("meta"):
        model = Transformer(args)
    parallelize(model, dims, mesh)
    model.to_empty(device=device)
    torch.manual_seed(cfg.train.seed)
    model.init_weights()

    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_lr_scheduler(optimizer, cfg.train)
    loader = ShardedSampleLoader(
        split_shards(data_dir, manifest, "train"),
        local_batch_size=cfg.train.global_batch_size // dims.dp,
        dp_rank=mesh["dp"].get_local_rank(),
        dp_size=dims.dp,
        seed=cfg.train.seed,
    )
    trainer = TrainerState(scheduler, loader)
    state = {"model": ModelState(model), "optim": OptimizerState(model, optimizer), "train": trainer}
    data_manifest = {"path": str(data_dir / MANIFEST_NAME),
                     "sha256": sha256_file(data_dir / MANIFEST_NAME)}
    fingerprint = resume_fingerprint(cfg, data_manifest["sha256"])
    checkpoints = CheckpointManager(Path(cfg.train.out_dir) / "checkpoints",
                                    cfg.checkpoint.keep_last, rank, fingerprint)
    checkpoints.load_latest(state)

    metrics = MetricsLogger(run_id if rank == 0 else None, cfg.train.log_every, cfg.train.steps)
    tokens_per_step = cfg.train.global_batch_size * manifest["seq_len"]
    if rank == 0:
        log.info("model: %.2fM parameters, layout dp=%d tp=%d on %s; starting at step %d/%d",
                 args.num_params() / 1e6, dims.dp, dims.tp, device, trainer.step, cfg.train.steps)
    dp_group = mesh["dp"].get_group()
    while trainer.step < cfg.train.steps:
        step = trainer.step + 1
        started = time.perf_counter()
        batch = loader.next_batch().to(device)
        data_wait = time.perf_counter() - started
        lr = scheduler.get_last_lr()[0]
        loss, grad_norm = train_step(model, optimizer, batch, cfg.train.grad_clip)
        scheduler.step()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dp_group)
        loss_value = loss.item()
        step_time = time.perf_counter() - started
        trainer.step, trainer.tokens_seen = step, trainer.tokens_seen + tokens_per_step
        metrics.log_step(step, {
            "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
            "data_wait_s": data_wait,
        })
        if step % cfg.checkpoint.every_steps == 0 or step == cfg.train.steps:
            meta = {"loss": loss_value, "tokens_seen": trainer.tokens_seen,
                    "layout": {"dp": dims.dp, "tp": dims.tp, "world_size": world_size},
                    "model_args": args.to_dict(), "data_manifest": data_manifest}
            checkpoints.save(step, state, meta)
    metrics.close()


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
