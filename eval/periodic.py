"""Evaluate one committed checkpoint on a few tasks and log the scores into a training run at
that step -- the in-training evaluation, run as its own process by the trainer (rank 0) so the
ranks never wait for it:

    python -m forgeline.eval.periodic --checkpoint DIR --data-dir DIR --tasks T [T ...]
        --dimension-shots D=K [D=K ...] --dimension-chat D=true|false [...] --limit N
        --precision auto|fp32|bf16 --run-id ID --step S

Every score comes with its standard error, computed from each item's value as the eval stage
computes it (eval/scores.py `item_stderr`: closed form for a mean, a seeded bootstrap over the
items for another aggregation), and named as the eval stage names it on the pipeline's run:
`eval/<task>/<metric>` beside `eval/stderr/<task>/<metric>`. A task is asked as the eval stage
asks it (eval/suite.py `evaluate_tasks`): with its dimension's few-shot count (the trainer passes
eval.dimensions' as --dimension-shots) and the same seeds, and a generative task through the
tokenizer's chat template as its dimension's `chat` setting says (--dimension-chat; unset:
where the tokenizer has one), its weights in the eval stage's precision (--precision, the
trainer passes eval.precision); only the number of items (`--limit`) is the in-training
evaluation's own. At the same limit, its scores at the last step are the eval stage's.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from forgeline.configs.environment import apply_environment_defaults
from forgeline.model.lifetime import die_with_parent
from forgeline.model.spool import flush_deadline_s, spool_from_environment

if TYPE_CHECKING:  # lm-eval is imported once main() has applied the environment defaults
    from lm_eval.api.model import LM
    from lm_eval.api.task import Task
    from lm_eval.tasks import TaskManager

log = logging.getLogger("forgeline.eval.periodic")


def evaluate_checkpoint(checkpoint: Path, data_dir: Path, tasks: list[str], num_fewshot: dict[str, int],
                        chat: dict[str, bool], limit: int | None, batch_size: int,
                        precision: str) -> dict[str, float]:
    """`score_tasks` on `checkpoint`."""
    # Imported here, after main() applied the environment defaults lm-eval and datasets read.
    from forgeline.eval.lm import ForgelineLM
    from forgeline.eval.suite import render_suite, suite_task_manager

    with tempfile.TemporaryDirectory(prefix="forgeline-periodic-") as scratch:
        task_manager = suite_task_manager(render_suite(Path(scratch), data_dir))
        lm = ForgelineLM(checkpoint=str(checkpoint), tokenizer=str(data_dir / "tokenizer"),
                         batch_size=batch_size, precision=precision)
        return score_tasks(lm, tasks, num_fewshot, limit, task_manager, chat)


def score_tasks(lm: LM, tasks: list[str], num_fewshot: dict[str, int], limit: int | None,
                task_manager: TaskManager, chat: dict[str, bool] | None = None) -> dict[str, float]:
    """`task/metric` -> value for `tasks` on `lm` (each with its `num_fewshot`, 0 if absent; a
    generative one through the chat template as its dimension's setting in `chat` says, unset
    where the tokenizer has one), named as the eval stage names them, and `stderr/task/metric` ->
    its standard error (of every metric of a task that logged two items or more)."""
    from lm_eval.tasks import get_task_dict

    from forgeline.eval.dimensions import dimension_of, is_generative, through_template
    from forgeline.eval.scores import flatten_scores, item_stderrs
    from forgeline.eval.suite import evaluate_tasks

    def leaves(tree: dict) -> Iterator[Task]:  # a group's tasks
        for node in tree.values():
            yield from leaves(node) if isinstance(node, dict) else [node]

    task_dict = get_task_dict(tasks, task_manager)
    aggregations = {task.config.task: task.aggregation() for task in leaves(task_dict)}
    has_template, settings = bool(lm.chat_template(True)), chat or {}
    results: dict[str, dict] = {"results": {}, "samples": {}}

    def asked(task: str) -> tuple[int, bool]:  # its shots, and whether through the chat template
        dimension = dimension_of(task) or ""
        return num_fewshot.get(task, 0), is_generative(task) and through_template(
            dimension, settings.get(dimension), has_template)

    for shots, chat in sorted({asked(task) for task in tasks}):
        group = [task for task in tasks if asked(task) == (shots, chat)]
        done = evaluate_tasks(lm, group, num_fewshot=shots, limit=limit, chat=chat, task_manager=task_manager)
        results["results"] |= done["results"]
        results["samples"] |= done["samples"]
    scores = flatten_scores(results["results"])
    stderrs = item_stderrs(results["samples"], aggregations)
    return scores | {f"stderr/{name}": se for name, se in stderrs.items() if name in scores}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m forgeline.eval.periodic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--tasks", required=True, nargs="+")
    parser.add_argument("--dimension-shots", nargs="*", default=[], metavar="DIMENSION=K",
                        help="few-shot examples per prompt of a dimension's tasks (others: 0)")
    parser.add_argument("--dimension-chat", nargs="*", default=[], metavar="DIMENSION=true|false",
                        help="a dimension's generative tasks through the chat template or not "
                             "(others: where the tokenizer has one)")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--precision", choices=["auto", "bf16_where_native", "fp32", "bf16"], default="auto",
                        help="the weights' precision (eval.precision)")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--step", required=True, type=int)
    args = parser.parse_args(argv)
    # Rank 0 started it: killed outright, it leaves no evaluation behind to load a checkpoint the
    # retry may be replacing, or to hold the memory the retry needs.
    die_with_parent()
    apply_environment_defaults()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from forgeline.eval.dimensions import fewshot_counts

    shots = {name: int(count) for name, _, count in (pair.partition("=") for pair in args.dimension_shots)}
    num_fewshot = fewshot_counts(args.tasks, shots)
    chat = {name: value == "true" for name, _, value in (pair.partition("=") for pair in args.dimension_chat)}
    scores = evaluate_checkpoint(args.checkpoint, args.data_dir, args.tasks, num_fewshot, chat, args.limit,
                                 args.batch_size, args.precision)
    log_scores(args.run_id, args.step, scores)
    log.info("step %d: %s", args.step, describe(scores))


def describe(scores: dict[str, float]) -> str:
    """Each score, ± the half-width of its 95 % interval where it has a standard error."""
    from forgeline.eval.scores import Z95

    def interval(name: str) -> str:
        se = scores.get(f"stderr/{name}")
        return "" if se is None else f" ± {Z95 * se:.4f}"

    return ", ".join(f"{name} {value:.4f}{interval(name)}" for name, value in scores.items()
                     if not name.startswith("stderr/"))


def log_scores(run_id: str, step: int, scores: dict[str, float]) -> None:
    """`eval/<task>/<metric>` and `eval/stderr/<task>/<metric>` metrics of the training run at
    `step`, through the tracking spool."""
    now = int(time.time() * 1000)
    spool = spool_from_environment(run_id, f"eval-step{step}")
    spool.log_batch([(f"eval/{k}", v, now, step) for k, v in scores.items()])
    spool.close(flush_deadline_s())


if __name__ == "__main__":
    main()
