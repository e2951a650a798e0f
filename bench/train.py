"""bench/train: forgeline's trainer against a minimal plain PyTorch loop, in one run.

    .venv/bin/python bench/train.py [--config tiny-single.yaml] [--steps 60] [--rounds 2]

Both train the same model (same init, batch size, sequence length, AdamW, LR schedule,
clipping) on the same shards with the same number of threads; the trainer runs as in
production (torchrun, one rank, its loader, metrics to MLflow, checkpoints at the end). Reports
steady-state tokens/s of each (median step after warm-up, rounds alternated to spread machine
noise), their ratio (target >= 0.97), and the MFU of each against the fp32 matmul peak
measured in the same run. Writes bench/results/train.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from forgeline.configs.environment import apply_environment_defaults

apply_environment_defaults()  # before torch and MLflow are imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mlflow import MlflowClient  # noqa: E402
from results_file import write_results  # noqa: E402  (bench/, the script's own directory)

from forgeline.configs import Config, load_config  # noqa: E402
from forgeline.model.training.loader import ShardedSampleLoader  # noqa: E402
from forgeline.model.training.metrics import measure_peak_flops  # noqa: E402
from forgeline.model.training.optim import build_lr_scheduler, build_optimizer  # noqa: E402
from forgeline.model.training.shards import read_manifest, split_shards  # noqa: E402
from forgeline.model.transformer import Transformer  # noqa: E402
from forgeline.tasks.data.build import build_dataset  # noqa: E402
from forgeline.tasks.tracking import experiment_id, resolve_tracking_uri  # noqa: E402
from forgeline.tasks.train.job import train_model  # noqa: E402

WARMUP_STEPS = 5


def plain_loop_step_times(cfg: Config, steps: int) -> list[float]:
    """The baseline: the textbook loop, batches preloaded in memory."""
    data_dir = Path(cfg.data.out_dir)
    manifest = read_manifest(data_dir)
    model = Transformer(cfg.model.for_vocabulary(manifest["vocab_size"]))
    model.init_weights(cfg.train.seed)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_lr_scheduler(optimizer, cfg.train)
    loader = ShardedSampleLoader(split_shards(data_dir, manifest, "train"), cfg.train.global_batch_size,
                                 0, 1, cfg.train.seed)
    batches = [loader.next_batch() for _ in range(steps)]
    times = []
    for batch in batches:
        started = time.perf_counter()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss.item()  # the trainer reads the loss every step too
        times.append(time.perf_counter() - started)
    return times


def trainer_step_times(cfg: Config) -> list[float]:
    """forgeline's trainer, launched by the train stage, step times read back from MLflow."""
    client = MlflowClient(resolve_tracking_uri(cfg))
    run = client.create_run(experiment_id(client, cfg), run_name="bench-train")
    train_model(cfg, mlflow_run_id=run.info.run_id)
    history = sorted(client.get_metric_history(run.info.run_id, "step_time_s"), key=lambda m: m.step)
    return [m.value for m in history]


def bench_config(args: argparse.Namespace, workdir: Path, *extra: str) -> Config:
    """The config in one process, everything written under `workdir`."""
    return load_config(args.config, [
        f"data.out_dir={workdir / 'data'}", f"data.raw_dir={workdir / 'raw'}", f"train.steps={args.steps}",
        "train.warmup_steps=2",
        f"checkpoint.every_steps={args.steps}", "parallel.pp=1", "parallel.dp_shard=1",
        "parallel.dp_replicate=1", "parallel.tp=1", f"train.log_every={args.steps}",
        f"registry.tracking_uri=sqlite:///{workdir / 'mlflow.db'}",
        f"registry.artifact_location={workdir / 'mlartifacts'}", "train.peak_tflops=1", *extra,
    ])


def steady(times: list[float]) -> float:
    return statistics.median(times[WARMUP_STEPS:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny-single.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    with tempfile.TemporaryDirectory(prefix="bench-train-") as scratch:
        workdir = Path(scratch)
        cfg = bench_config(args, workdir)
        build_dataset(cfg)
        plain, trainer = [], []
        for round_index in range(args.rounds):
            plain.append(steady(plain_loop_step_times(cfg, args.steps)))
            trainer.append(steady(trainer_step_times(
                bench_config(args, workdir, f"train.out_dir={workdir / f'train-{round_index}'}"))))
        peak = measure_peak_flops(torch.device("cpu"))
        manifest = read_manifest(workdir / "data")

    tokens_per_step = cfg.train.global_batch_size * manifest["seq_len"]
    flops_per_token = cfg.model.for_vocabulary(manifest["vocab_size"]).flops_per_token(manifest["seq_len"])
    plain_tps = tokens_per_step / statistics.median(plain)
    trainer_tps = tokens_per_step / statistics.median(trainer)
    results = {
        "config": args.config, "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
        "params": cfg.model.for_vocabulary(manifest["vocab_size"]).num_params(),
        "plain_loop_tokens_per_s": round(plain_tps),
        "trainer_tokens_per_s": round(trainer_tps),
        "trainer_over_plain": round(trainer_tps / plain_tps, 4),
        "peak_fp32_matmul_gflops": round(peak / 1e9, 1),
        "plain_loop_mfu": round(flops_per_token * plain_tps / peak, 4),
        "trainer_mfu": round(flops_per_token * trainer_tps / peak, 4),
    }
    write_results("train", results)


if __name__ == "__main__":
    main()
