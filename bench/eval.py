"""bench/eval: the forgeline lm-eval backend against lm-eval's own `hf` backend, in one run.

    .venv/bin/python bench/eval.py [--config tiny-single.yaml] [--rounds 2] [--limit N]

Both evaluate the same model (the config's architecture, exported to Hugging Face format) on
the same requests: the eval stage's own suite, every dimension with the config's tasks, item
limits and few-shot counts (`--limit` overrides the limits), with the same batch size and
threads. A backend's throughput is requests per second of the time spent in its request
methods (loglikelihood, loglikelihood_rolling, generate_until): lm-eval's own work around them
-- building prompts, scoring, aggregating -- is the same for both and is reported apart, as the
end-to-end time. Per dimension (best round) and in all, with the ratios (target >= 1.5 for the
backend). Writes bench/results/eval.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from forgeline.configs.environment import apply_environment_defaults

apply_environment_defaults()  # before lm-eval, datasets and transformers are imported

import lm_eval  # noqa: E402
import torch  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from random_model import random_model_on_suite  # noqa: E402  (bench/, the script's own directory)
from results_file import write_results  # noqa: E402

from forgeline.eval.lm import ForgelineLM  # noqa: E402
from forgeline.tasks.evaluate import plan_tasks  # noqa: E402

Plan = dict[str, tuple[list[str], int | None, int]]  # dimension -> tasks, limit, few-shot
Timing = tuple[float, float, int]  # seconds in the backend, seconds end to end, requests
REQUEST_METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


class BackendClock:
    """Adds up the seconds an lm-eval model instance spends in its request methods."""

    def __init__(self, model: object) -> None:
        self.seconds = 0.0
        for name in REQUEST_METHODS:
            setattr(model, name, self._timed(getattr(model, name)))  # lm-eval calls getattr(lm, name)

    def _timed(self, method):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return timed


def timed(plan: Plan, task_manager: TaskManager, model: object, clock: BackendClock) -> dict[str, Timing]:
    """Per dimension: seconds in the backend and end to end, and the number of requests."""
    timings = {}
    for dimension, (tasks, limit, num_fewshot) in plan.items():
        clock.seconds, started = 0.0, time.perf_counter()
        results = lm_eval.simple_evaluate(model=model, tasks=tasks, limit=limit, num_fewshot=num_fewshot,
                                          task_manager=task_manager, log_samples=True, bootstrap_iters=0)
        elapsed = time.perf_counter() - started
        requests = sum(len(sample["resps"]) for samples in results["samples"].values() for sample in samples)
        timings[dimension] = clock.seconds, elapsed, requests
    return timings


def summary(requests: int, ours: tuple[float, float], hf: tuple[float, float]) -> dict:
    """Backend requests/s of each and their ratio; the end-to-end ratio beside it."""
    return {"requests": requests, "forgeline_requests_per_s": round(requests / ours[0], 1),
            "hf_requests_per_s": round(requests / hf[0], 1), "forgeline_over_hf": round(hf[0] / ours[0], 3),
            "end_to_end_s": {"forgeline": round(ours[1], 2), "hf": round(hf[1], 2)},
            "end_to_end_forgeline_over_hf": round(hf[1] / ours[1], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny-single.yaml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="items per task (default: the config's)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())

    with tempfile.TemporaryDirectory(prefix="bench-eval-") as scratch:
        cfg, model, hf_dir, task_manager = random_model_on_suite(args.config, Path(scratch))
        plan = {name: ([s.task for s in scores], args.limit or dcfg.limit, dcfg.num_fewshot)
                for name, (scores, dcfg) in plan_tasks(cfg.eval).items()}
        ours = ForgelineLM(hf=str(hf_dir), tokenizer=str(hf_dir), batch_size=cfg.eval.batch_size)
        theirs = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=cfg.eval.batch_size)
        clocks = {"ours": BackendClock(ours), "hf": BackendClock(theirs)}
        runs: dict[str, list[dict[str, Timing]]] = {"ours": [], "hf": []}
        for _ in range(args.rounds):  # interleaved, so both see the same machine
            runs["ours"].append(timed(plan, task_manager, ours, clocks["ours"]))
            runs["hf"].append(timed(plan, task_manager, theirs, clocks["hf"]))

    # Per dimension and backend, the round with the least backend time.
    best = {name: {d: min((run[d] for run in rounds), key=lambda t: t[0]) for d in plan}
            for name, rounds in runs.items()}
    per_dimension = {}
    for dimension in plan:
        ours_t, hf_t = best["ours"][dimension], best["hf"][dimension]
        assert ours_t[2] == hf_t[2], f"{dimension}: both backends must serve the same requests"
        per_dimension[dimension] = summary(ours_t[2], ours_t[:2], hf_t[:2])
    total = {name: (sum(t[0] for t in timings.values()), sum(t[1] for t in timings.values()))
             for name, timings in best.items()}
    results = {"config": args.config, "params": model.shape.num_params(), "rounds": args.rounds,
               "batch_size": cfg.eval.batch_size,
               "plan": {d: {"tasks": t, "limit": lim, "num_fewshot": n} for d, (t, lim, n) in plan.items()},
               "dimensions": per_dimension,
               **summary(sum(d["requests"] for d in per_dimension.values()), total["ours"], total["hf"])}
    write_results("eval", results)


if __name__ == "__main__":
    main()
