"""The rank program: what every torchrun worker of the train stage runs (tasks/train/job.py
launches it):

    torchrun --nproc-per-node=N -m forgeline.model.training.worker --config resolved.yaml [--mlflow-run-id ID]

Builds the model on the meta device, splits it into pipeline stages, applies tensor parallel,
activation checkpointing, compile and FSDP2, materializes and initializes it, resumes from the
latest valid checkpoint, and hands a Trainer (loop.py) its step and callbacks (callbacks.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from forgeline.configs import Config, load_config
from forgeline.configs.environment import apply_environment_defaults
from forgeline.configs.schema import ModelConfig, resume_fingerprint
from forgeline.model.checkpoint.manager import MANIFEST_NAME as CHECKPOINT_MANIFEST
from forgeline.model.checkpoint.manager import (
    CheckpointManager,
    ModelState,
    OptimizerState,
    RNGState,
    read_checkpoint_manifest,
)
from forgeline.model.fileio import sha256_file
from forgeline.model.hf import load_hf_weights
from forgeline.model.lifetime import die_with_parent
from forgeline.model.lora import apply_lora, has_adapters, init_lora, is_adapter
from forgeline.model.parallel.mesh import build_meshes, init_distributed, resolve_precision
from forgeline.model.parallel.parallelize import parallelize
from forgeline.model.parallel.pipelining import build_schedule, pipeline_split
from forgeline.model.parallel.tied import TiedEmbeddingCopies
from forgeline.model.training.amp import DynamicLossScaler
from forgeline.model.training.callbacks import (
    STACKS_DIR_ENV,
    CheckpointCallback,
    InTrainingEvalCallback,
    MetricsCallback,
    StabilityCallback,
    TrainingUnstable,
    ValidationCallback,
    WatchdogCallback,
    load_callback,
    unstable_report,
)
from forgeline.model.training.loader import ShardedSampleLoader
from forgeline.model.training.loop import Trainer, TrainerState
from forgeline.model.training.metrics import MetricsLogger, measure_peak_flops
from forgeline.model.training.optim import build_lr_scheduler, build_optimizer
from forgeline.model.training.outputs import TrainOutputs
from forgeline.model.training.preemption import PREEMPTED_EXIT_CODE, PreemptionCallback, PreemptionNotice
from forgeline.model.training.preference import (
    PreferenceObjective,
    load_reference,
    reference_dir,
    reference_log_probs,
    reference_written,
)
from forgeline.model.training.shards import MANIFEST_NAME, read_manifest, split_shards
from forgeline.model.training.step import TrainStep, scaled_loss
from forgeline.model.transformer import Transformer

log = logging.getLogger("forgeline.model.training.worker")


class BaseWeights(ModelState):
    """The weights of model parts with adapters, less the adapters: what a base checkpoint
    holds (the adapters keep their initialization)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in super().state_dict().items() if not is_adapter(k)}

def build_model_parts(cfg: Config, shape: ModelConfig, mesh: DeviceMesh, device: torch.device,
                      param_dtype: torch.dtype) -> list[tuple[int, nn.Module]]:
    """This rank's (stage index, module) pairs -- one (0, whole model) without pipeline
    parallelism -- built in the order: meta -> pipeline split -> TP -> AC -> compile -> FSDP ->
    materialize -> initialize (values depend only on the seed, not on the layout). A run from a
    base leaves the weights to the load that follows (a checkpoint, or the base). With
    sft.lora, adapters join on meta and are initialized here; the base's load leaves them."""
    lora = cfg.fine_tuning.lora if cfg.fine_tuning else None
    with torch.device("meta"):
        model = Transformer(shape)
    if lora:
        apply_lora(model, lora)
    if cfg.parallel.pp > 1:
        parts = pipeline_split(model, mesh["pp"].get_local_rank(), cfg.parallel)
    else:
        parts = [(0, model)]
    for _, part in parts:
        parallelize(part, cfg.parallel, mesh, param_dtype)
        part.to_empty(device=device)
        if cfg.model.init_from:
            part.init_buffers()
        else:
            part.init_weights(cfg.train.seed)
        if lora:
            init_lora(part, cfg.train.seed)
    return parts


def load_base(parts: list[nn.Module], base: dict, shape: ModelConfig) -> None:
    """Collective: the base's weights into the (sharded) parts, each rank reading its slices --
    from a Hugging Face directory's safetensors, or a forgeline checkpoint's weights only."""
    started = time.perf_counter()
    path = Path(base["path"])
    if (path / CHECKPOINT_MANIFEST).is_file():
        if read_checkpoint_manifest(path).get("lora"):
            raise ValueError(f"the base {base['uri']} holds LoRA adapters beside frozen weights: start "
                             "from its merged export (`forgeline checkpoints export --format hf`)")
        state = BaseWeights(parts) if any(has_adapters(part) for part in parts) else ModelState(parts)
        dcp.load({"model": state}, checkpoint_id=path)
    else:
        load_hf_weights(parts, path, shape)
    log.info("started from the base %s (%s) in %.1f s", base["uri"], path, time.perf_counter() - started)


def build_train_step(cfg: Config, mesh: DeviceMesh, dp_mesh: DeviceMesh, parts: list[tuple[int, nn.Module]],
                     device: torch.device, param_dtype: torch.dtype) -> TrainStep:
    """Optimizers and LR schedules per model part, the fp16 loss scaler, and the pipeline
    schedule when there is one."""
    modules = [module for _, module in parts]
    optimizers = [build_optimizer(module, cfg.train) for module in modules]
    scaler = DynamicLossScaler() if param_dtype == torch.float16 else None
    stage_ids = [stage_id for stage_id, _ in parts]
    layout = cfg.parallel
    train_step = TrainStep(
        parts=modules, optimizers=optimizers,
        objective=PreferenceObjective(cfg.preference) if cfg.preference else None,
        schedulers=[build_lr_scheduler(optimizer, cfg.train) for optimizer in optimizers],
        grad_accum_steps=cfg.train.grad_accum_steps, grad_clip=cfg.train.grad_clip, device=device,
        dp_group=dp_mesh.get_group(),
        pp_group=mesh["pp"].get_group() if layout.pp > 1 else None,
        is_first_stage=0 in stage_ids, is_last_stage=layout.num_stages - 1 in stage_ids,
        loss_parallel=layout.tp > 1 and layout.loss_parallel,
        # Without FSDP there is no MixedPrecisionPolicy to cast parameters: autocast instead.
        autocast_dtype=param_dtype if param_dtype != torch.float32 and layout.dp == 1 else None,
        scaler=scaler,
        tied=TiedEmbeddingCopies(parts, layout, mesh) if cfg.model.tie_embeddings and layout.pp > 1 else None,
    )
    if layout.pp > 1:
        train_step.schedule = build_schedule(
            parts, layout, mesh["pp"], device,
            loss_fn=lambda logits, targets: scaled_loss(logits, targets, cfg.train.grad_accum_steps
                                                        * layout.pp_microbatches, scaler, train_step.weight,
                                                        train_step.objective),
        )
    return train_step


def train(cfg: Config, device: torch.device, rank: int, world_size: int, run_id: str | None,
          base: dict | None = None, preemption: PreemptionNotice | None = None) -> str | None:
    """`base`: the pretrained base's lineage (tasks/pretrained.py Base.lineage) when the run
    starts from one. Returns why training stopped before its last step (a preemption that
    `preemption` noted), or None."""
    layout = cfg.parallel
    mesh, dp_mesh = build_meshes(layout, world_size, device.type)
    param_dtype = resolve_precision(cfg.train.precision, device.type)
    data_dir = Path(cfg.data.out_dir)
    manifest = read_manifest(data_dir)
    shape = cfg.model.for_vocabulary(manifest["vocab_size"])
    parts = build_model_parts(cfg, shape, mesh, device, param_dtype)
    train_step = build_train_step(cfg, mesh, dp_mesh, parts, device, param_dtype)
    loader = ShardedSampleLoader(
        split_shards(data_dir, manifest, "train"),
        local_batch_size=cfg.train.global_batch_size // layout.dp,
        dp_rank=dp_mesh.get_local_rank(),
        dp_size=layout.dp,
        seed=cfg.train.seed,
        document_starts=cfg.masks_documents,
    )
    trainer_state = TrainerState(train_step.schedulers, loader, train_step.scaler)
    state = {"model": ModelState(train_step.parts),
             "optim": OptimizerState(train_step.parts, train_step.optimizers),
             "train": trainer_state, "rng": RNGState(rank)}
    data_manifest = {"path": str(data_dir / MANIFEST_NAME),
                     "sha256": sha256_file(data_dir / MANIFEST_NAME)}
    fingerprint = resume_fingerprint(cfg, data_manifest["sha256"], base and base["weights_sha256"])
    outputs = TrainOutputs(Path(cfg.train.out_dir))
    report = unstable_report(outputs.unstable_report, fingerprint)
    if report:  # an automatic restart of a run that already gave up: fail fast, same report
        raise TrainingUnstable(report)
    checkpoints = CheckpointManager(outputs.checkpoints, cfg.checkpoint, rank, world_size, fingerprint)
    reference, based = None, False
    if cfg.preference and cfg.preference.loss != "simpo":  # SimPO has no reference
        # The model it starts from, before any checkpoint of the run replaces its weights.
        identity = {"data_manifest": data_manifest["sha256"], "base": base["weights_sha256"],
                    "dtype": str(param_dtype), "model": shape.model_dump(mode="json", exclude={"init_from"})}
        reference = reference_dir(data_dir, identity)
        based = ensure_reference(cfg, train_step, mesh, loader, data_dir, manifest, reference, identity, base,
                                 shape)
    if checkpoints.load_latest(state) is None and base and not based:
        load_base(train_step.parts, base, shape)  # a run that dies resumes from its own checkpoints
    if reference:
        loader.reference = load_reference(reference, "train")

    tokens_per_step = cfg.train.global_batch_size * manifest["seq_len"]
    flops_per_token = shape.flops_per_token(manifest["seq_len"],
                                            frozen=bool(cfg.fine_tuning and cfg.fine_tuning.lora))
    metrics = MetricsLogger(run_id, rank, cfg.train.log_every, cfg.train.steps,
                            flops_per_step=flops_per_token * tokens_per_step,
                            peak_flops=total_peak_flops(cfg, device), device=device)
    degrees = {"pp": layout.pp, "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard,
               "tp": layout.tp, "world_size": world_size,
               "pp_schedule": layout.pp_schedule if layout.pp > 1 else None}
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        log.info("model: %.2fM parameters; layout %s on %s, %s; starting at step %d/%d%s",
                 shape.num_params() / 1e6, degrees, device, param_dtype, trainer_state.step, cfg.train.steps,
                 f" (in-job restart {restart})" if restart else "")
    # "model_args": the shape's key since the first checkpoints.
    meta = {"layout": degrees, "model_args": shape.model_dump(mode="json"), "data_manifest": data_manifest,
            "config_sha256": cfg.content_hash(),
            "git_commit": os.environ.get("FORGELINE_GIT_COMMIT", "unknown")}
    if run_id:  # the MLflow run whose curve it continues: a rerun resumed from it logs there too
        meta["mlflow_run_id"] = run_id
    if base:  # where the run's weights came from: the manifest of every checkpoint records it
        meta["base"] = base
    if cfg.fine_tuning and cfg.fine_tuning.lora:  # what readers of the checkpoint merge (model/inference.py)
        meta["lora"] = cfg.fine_tuning.lora.model_dump(mode="json")
    # Before the metrics: the validation figures join the step's metrics.
    validation = [
        ValidationCallback.from_data(cfg.train, data_dir, manifest, loader, train_step.dp_group, device,
                                     load_reference(reference, "val") if reference else None),
    ] if cfg.train.val_every else []
    saves = CheckpointCallback(checkpoints, state, cfg.checkpoint.every_steps, meta)
    callbacks = [
        *validation,
        MetricsCallback(metrics),
        StabilityCallback(cfg.train, checkpoints, state, metrics, outputs.unstable_report, fingerprint, rank),
        saves,
        PreemptionCallback(preemption or PreemptionNotice(), saves, outputs.preemption_record,
                           cfg.train.preemption_grace_s, device, rank),
        *(load_callback(spec) for spec in cfg.train.callbacks),
    ]
    if cfg.train.hang_timeout_s:
        stacks_dir = os.environ.get(STACKS_DIR_ENV)  # set by the train stage's launcher
        stacks_file = Path(stacks_dir) / f"rank{rank}-restart{restart}.txt" if stacks_dir else None
        callbacks.insert(0, WatchdogCallback(cfg.train.hang_timeout_s, stacks_file))
    if cfg.eval.during_training.every_steps and rank == 0 and run_id:
        shots = {name: dimension.num_fewshot for name, dimension in cfg.eval.dimensions.items()
                 if dimension.num_fewshot}
        chat = {name: dimension.chat for name, dimension in cfg.eval.dimensions.items()
                if dimension.chat is not None}
        callbacks.append(InTrainingEvalCallback(cfg.eval.during_training, outputs.checkpoints, data_dir,
                                                run_id, cfg.eval.batch_size, shots, chat, cfg.eval.precision))
    trainer = Trainer(total_steps=cfg.train.steps, state=trainer_state, train_step=train_step, device=device,
                      tokens_per_step=tokens_per_step, callbacks=callbacks)
    trainer.fit()
    return trainer.stopped_early


def ensure_reference(cfg: Config, train_step: TrainStep, mesh: DeviceMesh, loader: ShardedSampleLoader,
                     data_dir: Path, manifest: dict, directory: Path, identity: dict, base: dict,
                     shape: ModelConfig) -> bool:
    """Collective: the reference log-probabilities of the train and validation splits in
    `directory`, computed by the model as it starts -- the base, its adapters (if any) at their
    initialization, which adds nothing -- unless a run computed them before. Returns whether the
    base's weights were loaded for it."""
    if reference_written(directory, train_step.device):
        return False
    load_base(train_step.parts, base, shape)
    loaders = {"train": loader}
    if manifest["splits"].get("val", {}).get("samples"):
        dp_size = loader.global_batch_size // loader.local_batch_size
        loaders["val"] = ShardedSampleLoader(split_shards(data_dir, manifest, "val"), loader.local_batch_size,
                                             loader.dp_rank, dp_size, loader.seed, loader.document_starts)
    tp_rank = mesh["tp"].get_local_rank() if cfg.parallel.tp > 1 else 0
    reference_log_probs(train_step.target_log_probs, loaders, directory, identity,
                        train_step.is_last_stage and tp_rank == 0, train_step.device)
    return True


def total_peak_flops(cfg: Config, device: torch.device) -> float:
    """The peak MFU is measured against, summed over all ranks: configured per device, or an
    fp32 matmul measured on every rank at once."""
    if cfg.train.peak_tflops is not None:
        return cfg.train.peak_tflops * 1e12 * dist.get_world_size()
    peak = torch.tensor([measure_peak_flops(device)], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.SUM)
    return peak.item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m forgeline.model.training.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="resolved run config (YAML)")
    parser.add_argument("--mlflow-run-id", help="MLflow run that receives the step metrics")
    parser.add_argument("--base", type=json.loads,
                        help="the pretrained base, resolved by the launcher: JSON with its uri, local path "
                             "and weights_sha256")
    args = parser.parse_args(argv)
    # A rank that outlived a killed launcher would train on beside the job's retry, into the same
    # checkpoints and (on a GPU) the memory the retry needs; the checkpoint generation
    # (model/checkpoint/manager.py) fences such ranks where the parent-death signal does not exist.
    die_with_parent()
    preemption = PreemptionNotice()
    preemption.install()
    apply_environment_defaults()  # inherited from the launcher already; here for a rank started by hand
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
        stopped_early = train(cfg, device, rank, world_size, args.mlflow_run_id, args.base, preemption)
    finally:
        dist.destroy_process_group()
    if stopped_early:
        sys.exit(PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
    main()
