"""bench/eval_uncertainty: what the eval stage's uncertainty costs -- logging every item's value,
the standard errors (closed form for means, a 1,000-draw bootstrap over items otherwise), the
suite's fingerprint and writing items.json (what the promotion gate pairs) -- as a share of the
stage's scoring, in one run.

    .venv/bin/python bench/eval_uncertainty.py [--config tiny-single.yaml] [--rounds 3]

The config's model (random weights, exported to Hugging Face format) on the eval stage's own
suite and plan, scored the two ways in alternating rounds with one loaded model:

    before   lm_eval.simple_evaluate(log_samples=False) per dimension, then the point scores
    now      tasks/evaluate.py score_lm (log_samples=True, per-item values), the report with
             standard errors and intervals, the suite fingerprint, items.json written

Reported: the median seconds of each, the added share (now / before - 1; goal <= 5 %) and the
seconds of the step after scoring alone (report, fingerprint, items.json). Writes
bench/results/eval_uncertainty.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from forgeline.configs.environment import apply_environment_defaults

apply_environment_defaults()  # before lm-eval, datasets and transformers are imported

import lm_eval  # noqa: E402
import torch  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from random_model import random_model_on_suite  # noqa: E402  (bench/, the script's own directory)
from results_file import write_results  # noqa: E402

from forgeline.eval.lm import ForgelineLM  # noqa: E402
from forgeline.eval.scores import aggregate, flatten_scores  # noqa: E402
from forgeline.eval.suite import suite_fingerprint  # noqa: E402
from forgeline.tasks.evaluate import Plan, plan_record, plan_scores, plan_tasks, score_lm  # noqa: E402


def point_scores(lm: ForgelineLM, plan: Plan, task_manager: TaskManager) -> dict:
    """The eval stage before uncertainty: no per-item values, bare point scores."""
    raw = {}
    for scores, dcfg in plan.values():
        results = lm_eval.simple_evaluate(
            model=lm, tasks=[s.task for s in scores], num_fewshot=dcfg.num_fewshot, limit=dcfg.limit,
            task_manager=task_manager, log_samples=False, bootstrap_iters=0,
            random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
        raw |= flatten_scores(results["results"])
    return aggregate(raw, plan_scores(plan))


def with_uncertainty(lm: ForgelineLM, plan: Plan, task_manager: TaskManager,
                     workdir: Path) -> tuple[dict, float]:
    """The eval stage now; also the seconds after scoring (report, fingerprint, items.json)."""
    scored = score_lm(lm, plan, task_manager)
    started = time.perf_counter()
    report = scored.report(plan)
    suite = {"fingerprint": suite_fingerprint(workdir / "tasks", workdir / "data"), "plan": plan_record(plan)}
    (workdir / "items.json").write_text(json.dumps({"suite": suite, "model": scored.items_record(plan)},
                                                   separators=(",", ":")) + "\n")
    return report, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny-single.yaml")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())

    with tempfile.TemporaryDirectory(prefix="bench-eval-uncertainty-") as scratch:
        workdir = Path(scratch)
        cfg, _, hf_dir, task_manager = random_model_on_suite(args.config, workdir)
        plan = plan_tasks(cfg.eval)
        lm = ForgelineLM(hf=str(hf_dir), tokenizer=str(hf_dir), batch_size=cfg.eval.batch_size)
        times: dict[str, list[float]] = {"before": [], "now": [], "after_scoring": []}
        for round_index in range(args.rounds):  # alternating order, so both see the same machine
            for which in (["before", "now"] if round_index % 2 == 0 else ["now", "before"]):
                started = time.perf_counter()
                if which == "before":
                    before = point_scores(lm, plan, task_manager)
                else:
                    now, after_scoring = with_uncertainty(lm, plan, task_manager, workdir)
                    times["after_scoring"].append(after_scoring)
                times[which].append(time.perf_counter() - started)
        items_bytes = (workdir / "items.json").stat().st_size
        record = json.loads((workdir / "items.json").read_text())["model"]

    assert abs(now["overall"] - before["overall"]) < 1e-12, "both ways must give the same scores"
    before_s, now_s = statistics.median(times["before"]), statistics.median(times["now"])
    write_results("eval_uncertainty", {
        "config": args.config, "rounds": args.rounds, "tasks": len(record),
        "items": sum(len(entry["ids"]) for entry in record.values()),
        "before_s": round(before_s, 2), "now_s": round(now_s, 2),
        "added_share": round(now_s / before_s - 1, 4),
        "after_scoring_s": round(statistics.median(times["after_scoring"]), 3),
        "after_scoring_share": round(statistics.median(times["after_scoring"]) / before_s, 4),
        "items_json_bytes": items_bytes, "times": times,
        "overall": now["overall"], "overall_stderr": now["overall_stderr"],
        "load_avg_1min": round(os.getloadavg()[0], 2),
    })


if __name__ == "__main__":
    main()
