"""bench/precision: training in bf16 against fp32 on this machine, in one run.

    .venv/bin/python bench/precision.py [--config tiny-single.yaml] [--layouts single dp2]
                                        [--steps 30] [--rounds 2] [--dim 512 --n-layers 8 --ffn-dim 1376]

The subject is `train.precision=bf16`, the baseline the same run in fp32: same model, init,
data, batches and hyperparameters, forgeline's trainer as in production (the train stage's
torchrun launch, its loader, metrics to MLflow, validation and a checkpoint at the end). Two
layouts, the two ways bf16 is applied (docs/parallelism.md):

    single  one process: fp32 parameters, bf16 compute through torch.autocast
    dp2     dp_shard=2 (2 ranks): FSDP2's MixedPrecisionPolicy gathers the parameters in bf16,
            reduces gradients in fp32, keeps the fp32 shards for the optimizer

The model is the config's data with a small-but-not-tiny model (default 27 M parameters: dim
512, 8 layers; the 5 M-parameter tiny model is too small for bf16 matmuls to pay). Rounds
alternate fp32 and bf16 (bf16 first in odd rounds) to spread machine noise. Reported per
layout: steady-state tokens/s of each (median step time after warm-up, median over rounds) and
their ratio bf16 ÷ fp32; the loss gap -- the largest relative gap of the per-step training
losses, the gap at the last step, and the gap of the validation loss at the end (both runs see
the same batches, so the gap is rounding, not sampling). For context, bf16 ÷ fp32 GFLOP/s of
a plain 2048³ matmul. Refused on a CPU without native bf16 (resolve_precision). Writes
bench/results/precision.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from forgeline.configs.environment import apply_environment_defaults

apply_environment_defaults()  # before torch and MLflow are imported

import torch  # noqa: E402
from mlflow import MlflowClient  # noqa: E402
from results_file import write_results  # noqa: E402  (bench/, the script's own directory)

from forgeline.configs import Config, load_config  # noqa: E402
from forgeline.model.parallel.mesh import local_device_type, resolve_precision  # noqa: E402
from forgeline.model.training.shards import read_manifest  # noqa: E402
from forgeline.tasks.data.build import build_dataset  # noqa: E402
from forgeline.tasks.tracking import experiment_id, resolve_tracking_uri  # noqa: E402
from forgeline.tasks.train.job import train_model  # noqa: E402

WARMUP_STEPS = 5
LAYOUTS = {"single": [], "dp2": ["parallel.dp_shard=2"]}
PRECISIONS = ("fp32", "bf16")


def bench_config(args: argparse.Namespace, workdir: Path, *extra: str) -> Config:
    """The config's data, the benchmark's model and steps, everything written under `workdir`."""
    return load_config(args.config, [
        f"data.out_dir={workdir / 'data'}", f"data.raw_dir={workdir / 'raw'}",
        f"model.dim={args.dim}", f"model.n_layers={args.n_layers}", f"model.ffn_dim={args.ffn_dim}",
        "model.n_heads=8", "model.n_kv_heads=4",
        f"train.steps={args.steps}", "train.warmup_steps=5", f"train.log_every={args.steps}",
        f"checkpoint.every_steps={args.steps}", "checkpoint.keep_last=1",
        "parallel.pp=1", "parallel.dp_shard=1", "parallel.dp_replicate=1", "parallel.tp=1",
        f"registry.tracking_uri=sqlite:///{workdir / 'mlflow.db'}",
        f"registry.artifact_location={workdir / 'mlartifacts'}", "train.peak_tflops=1", *extra,
    ])


def train_run(cfg: Config) -> dict:
    """One train stage; its per-step losses and step times (from MLflow) and final validation loss."""
    client = MlflowClient(resolve_tracking_uri(cfg))
    run = client.create_run(experiment_id(client, cfg), run_name="bench-precision")
    result = train_model(cfg, mlflow_run_id=run.info.run_id)

    def history(key: str) -> list[float]:
        metrics = client.get_metric_history(run.info.run_id, key)
        return [m.value for m in sorted(metrics, key=lambda m: m.step)]

    return {"loss": history("loss"), "step_time_s": history("step_time_s"),
            "val_loss": result.val_last["loss"]}


def matmul_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - started) / 1e9


def relative_gap(value: float, baseline: float) -> float:
    return abs(value - baseline) / abs(baseline)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny-single.yaml")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--ffn-dim", type=int, default=1376)
    args = parser.parse_args()
    resolve_precision("bf16", local_device_type())  # refuses a CPU without native bf16, saying so

    runs: dict[tuple[str, str], list[dict]] = {(layout, p): [] for layout in args.layouts for p in PRECISIONS}
    with tempfile.TemporaryDirectory(prefix="bench-precision-") as scratch:
        workdir = Path(scratch)
        cfg = bench_config(args, workdir)
        build_dataset(cfg)
        for round_index in range(args.rounds):
            order = PRECISIONS if round_index % 2 == 0 else PRECISIONS[::-1]
            for layout in args.layouts:
                for precision in order:
                    name = f"{layout}-{precision}-{round_index}"
                    runs[layout, precision].append(train_run(bench_config(
                        args, workdir, f"train.out_dir={workdir / name}", f"train.precision={precision}",
                        *LAYOUTS[layout])))
        manifest = read_manifest(workdir / "data")

    tokens_per_step = cfg.train.global_batch_size * manifest["seq_len"]
    results: dict = {
        "config": args.config, "steps": args.steps, "rounds": args.rounds,
        "params": cfg.model.for_vocabulary(manifest["vocab_size"]).num_params(),
        "tokens_per_step": tokens_per_step,
        "matmul_bf16_over_fp32": round(matmul_gflops(torch.bfloat16) / matmul_gflops(torch.float32), 2),
        "cpu_native_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    }
    for layout in args.layouts:
        tokens_per_s = {
            precision: tokens_per_step / statistics.median(
                statistics.median(run["step_time_s"][WARMUP_STEPS:]) for run in runs[layout, precision])
            for precision in PRECISIONS
        }
        # Every round of a precision trains on the same batches from the same init: its first
        # round stands for all (same figures up to thread scheduling).
        fp32, bf16 = runs[layout, "fp32"][0], runs[layout, "bf16"][0]
        results[layout] = {
            "fp32_tokens_per_s": round(tokens_per_s["fp32"]),
            "bf16_tokens_per_s": round(tokens_per_s["bf16"]),
            "bf16_over_fp32": round(tokens_per_s["bf16"] / tokens_per_s["fp32"], 3),
            "loss_max_rel_gap": max(map(relative_gap, bf16["loss"], fp32["loss"])),
            "loss_last_rel_gap": relative_gap(bf16["loss"][-1], fp32["loss"][-1]),
            "loss_first_last_fp32": [fp32["loss"][0], fp32["loss"][-1]],
            "val_loss_fp32": fp32["val_loss"], "val_loss_bf16": bf16["val_loss"],
            "val_loss_rel_gap": relative_gap(bf16["val_loss"], fp32["val_loss"]),
        }
    write_results("precision", results)


if __name__ == "__main__":
    main()
