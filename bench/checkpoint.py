"""bench/checkpoint: what checkpoints cost, as ratios measured in one run.

    .venv/bin/python bench/checkpoint.py [--dim 768 --layers 8 --vocab 16000] [--dir /path/on/disk]

(a) how long the training loop is blocked by an asynchronous save, against a synchronous save
    of the same state, both in steady state (the median of saves after the first; target <= 10 %);
(b) save bandwidth (DCP write, sha256 manifest, fsync, rename) and load bandwidth (sha256 verify
    + DCP read) against the disk's sequential write (with fsync) and read speed for a file of the
    same size, measured in the same run (target >= 50 %); reads of both start cold (page cache
    dropped for those files with posix_fadvise);
(c) the time from a rank's death (SIGKILL, 2 ranks, torchrun restarting the group) to the next
    completed training step.
Writes bench/results/checkpoint.json.
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
import torch.distributed as dist  # noqa: E402
from mlflow import MlflowClient  # noqa: E402
from results_file import write_results  # noqa: E402  (bench/, the script's own directory)

from forgeline.configs.schema import CheckpointConfig, ModelConfig  # noqa: E402
from forgeline.model.checkpoint.manager import CheckpointManager, ModelState, OptimizerState  # noqa: E402
from forgeline.model.transformer import Transformer  # noqa: E402
from forgeline.tasks.data.build import build_dataset  # noqa: E402
from forgeline.tasks.tracking import experiment_id, resolve_tracking_uri  # noqa: E402
from forgeline.tasks.train.job import train_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def training_state(shape: ModelConfig) -> dict:
    """A model with AdamW state, as after a few steps: weights plus two moments (12 B/param)."""
    model = Transformer(shape)
    model.init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    return {"model": ModelState([model]), "optim": OptimizerState([model], [optimizer])}


def state_bytes(state: dict) -> int:
    model_part = state["model"].state_dict()
    optim_part = state["optim"].state_dict()
    return sum(v.numel() * v.element_size() for part in (model_part, optim_part)
               for v in part.values() if isinstance(v, torch.Tensor))


def disk_speed(directory: Path, size: int) -> tuple[float, float]:
    """Sequential write (fsynced) and read bytes/s of one file of `size` bytes."""
    path = directory / "sequential.bin"
    block = os.urandom(1 << 24)
    started = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size // len(block) + 1):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = path.stat().st_size / (time.perf_counter() - started)
    drop_from_page_cache(directory)
    started = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    read = path.stat().st_size / (time.perf_counter() - started)
    path.unlink()
    return write, read


def drop_from_page_cache(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def save_and_load(directory: Path, state: dict, async_save: bool, saves: int = 3) -> dict[str, float]:
    """Median loop-blocking and total time of `saves` saves after a first one, and one cold load."""
    root = directory / ("async" if async_save else "sync")
    manager = CheckpointManager(root, CheckpointConfig(async_save=async_save, keep_last=1), rank=0,
                                world_size=1, fingerprint="bench")
    blocked, total = [], []
    for step in range(saves + 1):
        started = time.perf_counter()
        manager.save(step, state, {"layout": {"world_size": 1}})
        blocked.append(time.perf_counter() - started)
        manager.wait()
        total.append(time.perf_counter() - started)
    manager.close()
    drop_from_page_cache(root)
    started = time.perf_counter()
    manager.load_latest(state)
    return {"blocked_s": statistics.median(blocked[1:]), "save_s": statistics.median(total[1:]),
            "load_s": time.perf_counter() - started}


def recovery_time(directory: Path) -> float:
    """Seconds from SIGKILL of one of 2 ranks to the first step completed after torchrun
    restarted them (both stamps from the same clock: the fault's marker file and the step
    metric's timestamp)."""
    os.environ["PYTHONPATH"] = str(REPO)  # the ranks import tests.faults
    from forgeline.configs import load_config

    marker = directory / "kill.fired"
    cfg = load_config("debug.yaml", [
        f"data.out_dir={directory / 'data'}", f"data.raw_dir={directory / 'raw'}",
        f"train.out_dir={directory / 'train'}",
        f"registry.tracking_uri=sqlite:///{directory / 'mlflow.db'}", "parallel.dp_shard=2",
        "train.steps=40", "checkpoint.every_steps=10", "train.peak_tflops=1",
        "train.callbacks=[{path: 'tests.faults:KillBefore', "
        f"args: {{step: 25, rank: 1, once: '{marker}'}}}}]",
    ])
    build_dataset(cfg)
    client = MlflowClient(resolve_tracking_uri(cfg))
    run = client.create_run(experiment_id(client, cfg))
    train_model(cfg, mlflow_run_id=run.info.run_id)
    killed_ms = marker.stat().st_mtime * 1000
    history = client.get_metric_history(run.info.run_id, "loss")
    after = [m.timestamp for m in history if m.timestamp > killed_ms]
    return (min(after) - killed_ms) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--dir", help="where to write (default: a temporary directory under /tmp)")
    args = parser.parse_args()
    shape = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=12,
                        n_kv_heads=4, ffn_dim=4 * args.dim * 2 // 3 // 64 * 64)

    with tempfile.TemporaryDirectory(prefix="bench-ckpt-", dir=args.dir) as scratch:
        directory = Path(scratch)
        dist.init_process_group("gloo", init_method=f"file://{directory / 'pg'}", rank=0, world_size=1)
        state = training_state(shape)
        size = state_bytes(state)
        disk_write, disk_read = disk_speed(directory, size)
        sync = save_and_load(directory, state, async_save=False)
        asynchronous = save_and_load(directory, state, async_save=True)
        dist.destroy_process_group()
        recovery = recovery_time(directory / "recovery")

    results = {
        "params": shape.num_params(), "state_gb": round(size / 1e9, 3),
        "sync_save_s": round(sync["save_s"], 3), "async_blocked_s": round(asynchronous["blocked_s"], 3),
        "async_blocked_over_sync": round(asynchronous["blocked_s"] / sync["save_s"], 4),
        "disk_write_gb_s": round(disk_write / 1e9, 3), "disk_read_gb_s": round(disk_read / 1e9, 3),
        "save_gb_s": round(size / sync["save_s"] / 1e9, 3),
        "load_gb_s": round(size / sync["load_s"] / 1e9, 3),
        "save_over_disk_write": round(size / sync["save_s"] / disk_write, 3),
        "load_over_disk_read": round(size / sync["load_s"] / disk_read, 3),
        "rank_death_to_next_step_s": round(recovery, 1),
    }
    write_results("checkpoint", results)


if __name__ == "__main__":
    main()
