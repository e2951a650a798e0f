"""bench/preemption: how much of the grace period a preemption uses, for the 75 M-parameter state
of bench/checkpoint.py (dim 768, 8 layers, vocabulary 16000: weights and AdamW moments, 0.9 GB).

    .venv/bin/python bench/preemption.py [--ranks 2 --grace 120 --dir /path/on/disk]

The real train stage on `--ranks` torchrun ranks (FSDP: each saves its shard) is signalled the
way Slurm's `--signal` does it -- SIGUSR1 to torchrun, which passes it on to the ranks -- as step
4 begins; the ranks finish that step, save it and wait for the commit. The figure is the time from
the signal to the committed checkpoint (the ranks' own clock, in the preemption record), against
`train.preemption_grace_s`, with a training step and a plain save of the same state measured in
the same run for scale. Writes bench/results/preemption.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from forgeline.configs.environment import apply_environment_defaults

apply_environment_defaults()  # before torch and MLflow are imported

from mlflow import MlflowClient  # noqa: E402
from results_file import write_results  # noqa: E402  (bench/, the script's own directory)

from forgeline.configs import load_config  # noqa: E402
from forgeline.tasks.data.build import build_dataset  # noqa: E402
from forgeline.tasks.tracking import experiment_id, resolve_tracking_uri  # noqa: E402
from forgeline.tasks.train.job import TrainPreempted, train_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIGNAL_AT_STEP = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--grace", type=int, default=120, help="train.preemption_grace_s")
    parser.add_argument("--dir", help="where to write (default: a temporary directory under /tmp)")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = str(REPO)  # the ranks import tests.faults

    with tempfile.TemporaryDirectory(prefix="bench-preempt-", dir=args.dir) as scratch:
        root = Path(scratch)
        cfg = load_config("debug.yaml", [
            f"data.out_dir={root / 'data'}", f"data.raw_dir={root / 'raw'}", "data.vocab_size=16000",
            f"train.out_dir={root / 'train'}", f"registry.tracking_uri=sqlite:///{root / 'mlflow.db'}",
            "model.dim=768", "model.n_layers=8", "model.n_heads=12", "model.n_kv_heads=4",
            "model.ffn_dim=2048",
            f"parallel.dp_shard={args.ranks}", "train.steps=1000", "train.warmup_steps=10",
            "checkpoint.every_steps=1000", "train.val_every=0", "train.log_every=1", "train.peak_tflops=1",
            f"train.preemption_grace_s={args.grace}",
            "train.callbacks=[{path: 'tests.faults:SignalLauncherBefore', "
            f"args: {{step: {SIGNAL_AT_STEP}, signal: SIGUSR1, once: '{root / 'signal.fired'}'}}}}]",
        ])
        build_dataset(cfg)
        client = MlflowClient(resolve_tracking_uri(cfg))
        run = client.create_run(experiment_id(client, cfg))
        try:
            train_model(cfg, mlflow_run_id=run.info.run_id)
            raise SystemExit("the run was not preempted")
        except TrainPreempted as preempted:
            print(preempted)
            record = preempted.record
        step_times = [m.value for m in client.get_metric_history(run.info.run_id, "step_time_s")]
        [checkpoint] = (Path(cfg.train.out_dir) / "checkpoints").glob("step-*")
        state_bytes = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())

    step_s = statistics.median(step_times[1:]) if len(step_times) > 1 else step_times[0]
    results = {
        "ranks": args.ranks, "checkpoint_gb": round(state_bytes / 1e9, 3), "signal_at_step": SIGNAL_AT_STEP,
        "saved_step": record["step"], "signal_to_commit_s": record["seconds_to_commit"],
        "grace_s": args.grace, "used_of_grace": round(record["seconds_to_commit"] / args.grace, 4),
        "median_step_s": round(step_s, 3),
    }
    write_results("preemption", results)


if __name__ == "__main__":
    main()
