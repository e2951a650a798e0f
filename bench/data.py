"""bench/data: the data stage's tokenization and the training loader, against their baselines.

    .venv/bin/python bench/data.py [--config tiny-single.yaml] [--rounds 3] [--steps 40]

(a) Tokenization: the stage's parallel tokenize-and-pack path (`tokenize_documents`: worker
processes, EOS between documents, lengths for the boundaries) with 1 and with 2 workers, vs raw
`tokenizers` `encode_batch` on the same documents and tokenizer, on one thread (the stage's
workers tokenize on one thread each; parallelism comes from the processes); also vs raw
`encode_batch_fast`, the call the stage makes. Targets: 1 worker
>= 0.9x raw; 2 workers >= 1.7x 1 worker. Rounds alternate; the best round of each is kept, as
the least disturbed by other load on the machine.
(b) Loader: samples/s of a cold `ShardedSampleLoader` (sha256 check on first open, decode,
shuffle, background prefetch) vs samples/s the trainer consumes, and the trainer's data-wait
share of the step (sum of data_wait_s / sum of step_time_s after warm-up; target <= 1 %), from a
real training run's per-step MLflow metrics. Writes bench/results/data.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

from forgeline.configs.environment import apply_environment_defaults

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the raw baseline on one thread, like each worker
apply_environment_defaults()  # before torch, MLflow and datasets are imported

from mlflow import MlflowClient  # noqa: E402
from results_file import write_results  # noqa: E402  (bench/, the script's own directory)

from forgeline.configs import Config, load_config  # noqa: E402
from forgeline.model.training.loader import ShardedSampleLoader  # noqa: E402
from forgeline.model.training.shards import read_manifest, split_shards  # noqa: E402
from forgeline.tasks.data.build import (  # noqa: E402
    build_dataset,
    build_tokenizer,
    clean_corpus,
    mix,
    source_entry,
    split_documents,
    tokenize_documents,
    tokenizer_source,
)
from forgeline.tasks.data.sources import read_source  # noqa: E402
from forgeline.tasks.tracking import experiment_id, resolve_tracking_uri  # noqa: E402
from forgeline.tasks.train.job import train_model  # noqa: E402

WARMUP_STEPS = 5


def training_documents(cfg: Config) -> list:
    """The cleaned, mixed training documents the stage would tokenize."""
    dcfg = cfg.data
    raw = [doc for source in dcfg.sources for doc in read_source(source, dcfg.cleaning.max_chars)]
    stats = {source.label: source_entry(source) for source in dcfg.sources}
    documents = clean_corpus(raw, dcfg.cleaning, stats, os.cpu_count())
    train, _val = split_documents(documents, dcfg.val_fraction)
    return mix(train, {source.label: source.weight for source in dcfg.sources})


def tokenization(cfg: Config, rounds: int) -> dict:
    docs = training_documents(cfg)
    tokenizer, eos_id = build_tokenizer(cfg.data, docs, tokenizer_source(cfg))
    texts = [d.text for d in docs]
    chars = sum(map(len, texts))
    best = {"raw": float("inf"), "raw_fast": float("inf"), "stage_1": float("inf"), "stage_2": float("inf")}
    cpu = {}
    for _ in range(rounds):
        for name, encode in (("raw", tokenizer.encode_batch), ("raw_fast", tokenizer.encode_batch_fast)):
            started, cpu_started = time.perf_counter(), cpu_seconds()
            encode(texts, add_special_tokens=False)
            best[name] = min(best[name], time.perf_counter() - started)
            cpu[name] = min(cpu.get(name, float("inf")), cpu_seconds() - cpu_started)
        for workers in (1, 2):
            name = f"stage_{workers}"
            started, cpu_started = time.perf_counter(), cpu_seconds()
            tokenize_documents(tokenizer, texts, eos_id, workers)
            best[name] = min(best[name], time.perf_counter() - started)
            cpu[name] = min(cpu.get(name, float("inf")), cpu_seconds() - cpu_started)
    mb = chars / 1e6
    return {
        "documents": len(texts), "chars": chars,
        # CPU seconds (this process and its finished workers): what each path costs whatever
        # else runs on the machine; wall-clock ratios below are what the targets are about.
        "cpu_s": {name: round(value, 2) for name, value in cpu.items()},
        "raw_encode_batch_mchars_per_s": round(mb / best["raw"], 3),
        "stage_1_worker_mchars_per_s": round(mb / best["stage_1"], 3),
        "stage_2_workers_mchars_per_s": round(mb / best["stage_2"], 3),
        "stage_1_worker_over_raw": round(best["raw"] / best["stage_1"], 3),
        # The stage calls encode_batch_fast (no offsets): the same call, raw, for comparison.
        "raw_encode_batch_fast_mchars_per_s": round(mb / best["raw_fast"], 3),
        "stage_1_worker_over_raw_fast": round(best["raw_fast"] / best["stage_1"], 3),
        "stage_2_workers_over_1": round(best["stage_1"] / best["stage_2"], 3),
    }


def cpu_seconds() -> float:
    """User + system CPU time of this process and of its children that have exited."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def loader_samples_per_s(cfg: Config, batches: int) -> float:
    data_dir = Path(cfg.data.out_dir)
    manifest = read_manifest(data_dir)
    loader = ShardedSampleLoader(split_shards(data_dir, manifest, "train"), cfg.train.global_batch_size,
                                 0, 1, cfg.train.seed)
    started = time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
    return batches * cfg.train.global_batch_size / (time.perf_counter() - started)


def trainer_metrics(cfg: Config) -> tuple[list[float], list[float]]:
    """Per-step step_time_s and data_wait_s of a real train stage run, from MLflow."""
    client = MlflowClient(resolve_tracking_uri(cfg))
    run = client.create_run(experiment_id(client, cfg), run_name="bench-data")
    train_model(cfg, mlflow_run_id=run.info.run_id)

    def history(key: str) -> list[float]:
        metrics = client.get_metric_history(run.info.run_id, key)
        return [m.value for m in sorted(metrics, key=lambda m: m.step)]

    return history("step_time_s")[WARMUP_STEPS:], history("data_wait_s")[WARMUP_STEPS:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny-single.yaml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-data-") as scratch:
        workdir = Path(scratch)
        cfg = load_config(args.config, [
            f"data.out_dir={workdir / 'data'}", f"data.raw_dir={workdir / 'raw'}",
            f"train.out_dir={workdir / 'train'}", f"train.steps={args.steps}", "train.warmup_steps=2",
            f"checkpoint.every_steps={args.steps}", f"train.log_every={args.steps}", "train.peak_tflops=1",
            f"registry.tracking_uri=sqlite:///{workdir / 'mlflow.db'}",
            f"registry.artifact_location={workdir / 'mlartifacts'}"])
        results = {"config": args.config, "rounds": args.rounds, "cpus": os.cpu_count(),
                   "tokenization": tokenization(cfg, args.rounds)}
        started = time.perf_counter()
        build_dataset(cfg)
        stage_s = time.perf_counter() - started
        step_times, waits = trainer_metrics(cfg)
        loader = loader_samples_per_s(cfg, batches=len(step_times) * 4)
    consumed = cfg.train.global_batch_size * len(step_times) / sum(step_times)
    results |= {
        "data_stage_s": round(stage_s, 1),
        "loader": {
            "loader_samples_per_s": round(loader),
            "trainer_samples_per_s": round(consumed, 1),
            "loader_over_trainer": round(loader / consumed, 1),
            "data_wait_share_of_step": round(sum(waits) / sum(step_times), 5),
            "steps_measured": len(step_times),
        },
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    write_results("data", results)


if __name__ == "__main__":
    main()
