"""bench/gate: the promotion gate's error rates and power on the shipped suite's item counts, in
one run, through the gate's own code (eval/scores.py paired_comparison, tasks/promote.py judge).

    .venv/bin/python bench/gate.py [--config tiny.yaml] [--draws 400]

The config's plan (its dimensions, tasks and `limit`s: 10 to 30 items a task on tiny.yaml) is
filled with simulated per-item results of a champion and a candidate of known difference:

    right/wrong tasks   item i has a difficulty q_i (the task's accuracy, chance + 20 % of the
                        way to best, give or take 0.2), which both models share; each answers
                        right with q_i, plus the candidate's shift
    held-out bits/byte  documents of 300-3,000 bytes at 2.5 +- 0.3 bits a byte (shared), each model
                        +- 0.02 of its own; the candidate's shift lowers it
    StereoSet ICAT      (ss, lms, lms) triples at 0.5 (chance); the candidate's shift raises lms
    shared contexts     BoolQ's questions come two to a passage, StereoSet's three to a target,
                        sharing the difficulty (the gate clusters them, eval/scores.py)

Three scenarios, `--draws` comparisons each:

    equal       no difference: false rejections and false promotions (goals <= 5 % each)
    detectable  the candidate better overall by the "smallest overall change these items detect"
                that the eval stage prints (tasks/evaluate.py detectable_overall, the median of
                the champion's simulated evals), spread over the tasks in proportion to their
                standard errors (each dimension as hard to detect as the others, so that no one
                dimension carries it): the share promoted, the power (goal >= 80 %)

Writes bench/results/gate.json.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from results_file import write_results  # bench/, the script's own directory

from forgeline.configs import load_config
from forgeline.eval.dimensions import TaskScore
from forgeline.eval.scores import TaskItems, aggregate, paired_comparison
from forgeline.tasks.evaluate import detectable_overall, plan_scores, plan_tasks
from forgeline.tasks.promote import PROMOTED, REJECTED, judge

CLUSTER_SIZE = {"forgeline_boolq": 2, "forgeline_stereoset": 3}  # items sharing a context
MAX_REGRESSION = 0.05  # registry.max_dimension_regression's default


def accuracy_of(score: TaskScore) -> float:
    """A small model's accuracy on a right/wrong task: a fifth of the way from chance to best."""
    return score.chance + 0.2 * (score.best - score.chance)


def difficulties(rng: random.Random, score: TaskScore, n: int) -> tuple[list[float], list[str]]:
    """Each item's shared difficulty (a probability, or bits per byte for held-out text) and its
    cluster; the items of a cluster share one."""
    size = CLUSTER_SIZE.get(score.task, 1)
    clusters = [f"context-{i // size}" for i in range(n)]
    per_cluster: dict[str, float] = {}
    for cluster in clusters:
        if score.aggregation == "bits_per_byte":
            per_cluster.setdefault(cluster, rng.gauss(2.5, 0.3))
        else:
            per_cluster.setdefault(cluster, min(1.0, max(0.0, rng.gauss(accuracy_of(score), 0.2))))
    return [per_cluster[cluster] for cluster in clusters], clusters


def answers(rng: random.Random, score: TaskScore, shared: list[float], sizes: list[int],
            shift: float) -> list:
    """One model's per-item values on the items of `shared` difficulty; `shift`: its normalized
    advantage on this task."""
    if score.aggregation == "bits_per_byte":
        bits = [b - shift * (score.chance - score.best) + rng.gauss(0, 0.02) for b in shared]
        return [[-b * size * math.log(2), size] for b, size in zip(bits, sizes, strict=True)]
    if score.aggregation == "icat":  # at ss = 0.5, icat = lms: a normalized shift moves lms by half
        lms = 0.5 + 0.5 * shift
        return [[float(rng.random() < 0.5), float(rng.random() < lms), float(rng.random() < lms)]
                for _ in shared]
    step = shift * (score.best - score.chance)
    return [float(rng.random() < min(1.0, max(0.0, q + step))) for q in shared]


def pair(seed: int, plan: dict[str, list[TaskScore]], limits: dict[str, int],
         shifts: dict[str, float]) -> tuple[dict[str, TaskItems], dict[str, TaskItems]]:
    """A champion's and a candidate's simulated items (the candidate shifted by `shifts`, per task)."""
    rng = random.Random(seed)
    champion, candidate = {}, {}
    for dimension, scores in plan.items():
        for score in scores:
            n = limits[dimension]
            shared, clusters = difficulties(rng, score, n)
            sizes = [rng.randint(300, 3000) for _ in range(n)]
            ids = [f"{score.task}-{i}" for i in range(n)]
            shift = shifts.get(score.task, 0.0)
            champion[score.task] = TaskItems(ids, answers(rng, score, shared, sizes, 0.0), clusters)
            candidate[score.task] = TaskItems(ids, answers(rng, score, shared, sizes, shift), clusters)
    return champion, candidate


def report_of(items: dict[str, TaskItems], plan: dict[str, list[TaskScore]]) -> dict:
    """The eval stage's report of one model's items (scores, standard errors)."""
    scores = [score for scores in plan.values() for score in scores]
    raw = {f"{s.task}/{s.metric}": items[s.task].value(s) for s in scores}
    stderrs = {f"{s.task}/{s.metric}": items[s.task].stderr(s) for s in scores}
    return aggregate(raw, plan, stderrs)


def outcomes(plan: dict[str, list[TaskScore]], limits: dict[str, int], shifts: dict[str, float], draws: int,
             first_seed: int) -> list[str]:
    found = []
    for draw in range(draws):
        champion, candidate = pair(first_seed + draw, plan, limits, shifts)
        comparison = paired_comparison(candidate, champion, plan)
        found.append(judge(comparison, list(plan), MAX_REGRESSION).outcome)
    return found


def spread(overall: float, report: dict, plan: dict[str, list[TaskScore]]) -> dict[str, float]:
    """Per task, a normalized shift in proportion to the task's standard error (in `report`), the
    overall shift (the mean over dimensions of the mean over their tasks) equal to `overall`."""
    weight = {s.task: report["dimensions"][name]["tasks"][s.task]["normalized_stderr"]
              for name, scores in plan.items() for s in scores}
    per_unit = sum(weight[s.task] / len(scores) for scores in plan.values() for s in scores) / len(plan)
    return {task: overall * w / per_unit for task, w in weight.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny.yaml")
    parser.add_argument("--draws", type=int, default=400)
    args = parser.parse_args()
    started = time.monotonic()
    planned = plan_tasks(load_config(args.config).eval)
    plan = plan_scores(planned)
    limits = {name: dcfg.limit for name, (_, dcfg) in planned.items()}

    equal = outcomes(plan, limits, {}, args.draws, first_seed=0)
    reports = [report_of(pair(seed, plan, limits, {})[0], plan) for seed in range(50)]
    detectable = statistics.median(detectable_overall(report) for report in reports)
    shifts = spread(detectable, reports[0], plan)
    better = outcomes(plan, limits, shifts, args.draws, first_seed=10_000)

    figures = {
        "config": args.config, "draws": args.draws,
        "items": {name: f"{len(plan[name])} tasks x {limits[name]}" for name in plan},
        "false_rejections": equal.count(REJECTED) / args.draws,
        "false_promotions": equal.count(PROMOTED) / args.draws,
        "smallest_detectable_change": detectable,
        "power_at_it": better.count(PROMOTED) / args.draws,
        "rejected_at_it": better.count(REJECTED) / args.draws,
        "seconds": time.monotonic() - started,
    }
    counts = ", ".join(f"{name} {count}" for name, count in figures["items"].items())
    print(f"{args.config}: {counts}; {args.draws} draws each")
    print(f"equal candidates: false rejections {figures['false_rejections']:.1%} (goal <= 5 %), "
          f"false promotions {figures['false_promotions']:.1%} (goal <= 5 %)")
    print(f"better by the smallest detectable change the eval prints ({detectable:.4f} overall): promoted "
          f"{figures['power_at_it']:.1%} (goal >= 80 %), rejected {figures['rejected_at_it']:.1%}")
    print(f"{figures['seconds']:.0f} s")
    write_results("gate", figures)


if __name__ == "__main__":
    main()
