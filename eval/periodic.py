"""Evaluate one committed checkpoint on a few tasks and log the scores into a training run at
that step -- the in-training evaluation, run as its own process by the trainer (rank 0) so the
ranks never wait for it:

    python -m forgeline.eval.periodic --checkpoint DIR --data-dir DIR --tasks T [T ...]
        --limit N --run-id ID --step S
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from forgeline.configs.environment import apply_environment_defaults
from forgeline.model.spool import flush_deadline_s, spool_from_environment

log = logging.getLogger("forgeline.eval.periodic")


def evaluate_checkpoint(checkpoint: Path, data_dir: Path, tasks: list[str], limit: int | None,
                        batch_size: int) -> dict[str, float]:
    """`task/metric` -> value for `tasks` on `checkpoint`, named as the eval stage names them."""
    # Imported here, after main() applied the environment defaults lm-eval and datasets read.
    import lm_eval
    from lm_eval.tasks import TaskManager

    from forgeline.eval.lm import ForgelineLM
    from forgeline.eval.scores import flatten_scores
    from forgeline.eval.suite import render_suite

    with tempfile.TemporaryDirectory(prefix="forgeline-periodic-") as scratch:
        task_manager = TaskManager(include_path=str(render_suite(Path(scratch), data_dir)))
        lm = ForgelineLM(checkpoint=str(checkpoint), tokenizer=str(data_dir / "tokenizer"),
                         batch_size=batch_size)
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=task_manager,
                                          log_samples=False, bootstrap_iters=0)
    return flatten_scores(results["results"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m forgeline.eval.periodic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--tasks", required=True, nargs="+")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--step", required=True, type=int)
    args = parser.parse_args(argv)
    apply_environment_defaults()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    scores = evaluate_checkpoint(args.checkpoint, args.data_dir, args.tasks, args.limit, args.batch_size)
    log_scores(args.run_id, args.step, scores)
    log.info("step %d: %s", args.step, ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))


def log_scores(run_id: str, step: int, scores: dict[str, float]) -> None:
    """`eval/<task>/<metric>` metrics of the training run at `step`, through the tracking spool."""
    now = int(time.time() * 1000)
    spool = spool_from_environment(run_id, f"eval-step{step}")
    spool.log_batch([(f"eval/{k}", v, now, step) for k, v in scores.items()])
    spool.close(flush_deadline_s())


if __name__ == "__main__":
    main()
