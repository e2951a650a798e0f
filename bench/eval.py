"""bench/eval: the forgeline lm-eval backend against lm-eval's own `hf` backend, in one run.

    .venv/bin/python bench/eval.py [--config tiny-single.yaml] [--rounds 2] [--limit N]

Both evaluate the same model (the config's architecture, exported to Hugging Face format) on
the same requests: the eval stage's own suite, every dimension with the config's tasks, item
limits and few-shot counts (`--limit` overrides the limits), with the same batch size and
threads. Reports requests per second of each backend per dimension (best round) and in all,
and the ratio (target >= 1.5). Writes bench/results/eval.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import lm_eval
import torch
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from results_file import write_results  # bench/, the script's own directory

import forgeline.tasks  # noqa: F401  (offline defaults before datasets/transformers)
from forgeline.configs import load_config
from forgeline.eval.lm import ForgelineLM
from forgeline.eval.suite import render_suite
from forgeline.model.data import read_manifest
from forgeline.model.hf import export_hf
from forgeline.model.llama import Transformer
from forgeline.model.train import model_args
from forgeline.tasks.data import build_dataset
from forgeline.tasks.evaluate import plan_tasks

Plan = dict[str, tuple[list[str], int | None, int]]  # dimension -> tasks, limit, few-shot
Timings = dict[str, tuple[float, int]]  # dimension -> seconds, requests


def timed(plan: Plan, task_manager: TaskManager, model: object) -> Timings:
    """Per dimension: seconds for its evaluation and the number of requests it made."""
    timings = {}
    for dimension, (tasks, limit, num_fewshot) in plan.items():
        started = time.perf_counter()
        results = lm_eval.simple_evaluate(model=model, tasks=tasks, limit=limit, num_fewshot=num_fewshot,
                                          task_manager=task_manager, log_samples=True, bootstrap_iters=0)
        elapsed = time.perf_counter() - started
        requests = sum(len(sample["resps"]) for samples in results["samples"].values() for sample in samples)
        timings[dimension] = elapsed, requests
    return timings


def summary(requests: int, ours_s: float, hf_s: float) -> dict:
    return {"requests": requests, "forgeline_requests_per_s": round(requests / ours_s, 1),
            "hf_requests_per_s": round(requests / hf_s, 1), "forgeline_over_hf": round(hf_s / ours_s, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny-single.yaml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="items per task (default: the config's)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())

    with tempfile.TemporaryDirectory(prefix="bench-eval-") as scratch:
        workdir = Path(scratch)
        cfg = load_config(args.config, [f"data.out_dir={workdir / 'data'}"])
        plan = {name: ([s.task for s in scores], args.limit or dcfg.limit, dcfg.num_fewshot)
                for name, (scores, dcfg) in plan_tasks(cfg.eval).items()}
        build_dataset(cfg)
        model = Transformer(model_args(cfg, read_manifest(workdir / "data")["vocab_size"]))
        model.init_weights(0)
        hf_dir = export_hf(model, workdir / "data" / "tokenizer", workdir / "hf")
        task_manager = TaskManager(include_path=str(render_suite(workdir / "tasks", workdir / "data")))
        ours = ForgelineLM(hf=str(hf_dir), tokenizer=str(hf_dir), batch_size=cfg.eval.batch_size)
        theirs = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=cfg.eval.batch_size)
        forgeline_runs, hf_runs = [], []
        for _ in range(args.rounds):  # interleaved, so both see the same machine
            forgeline_runs.append(timed(plan, task_manager, ours))
            hf_runs.append(timed(plan, task_manager, theirs))

    per_dimension = {}
    for dimension in plan:
        (ours_s, requests), (hf_s, hf_requests) = (min(run[dimension] for run in runs)
                                                   for runs in (forgeline_runs, hf_runs))
        assert requests == hf_requests, f"{dimension}: both backends must serve the same requests"
        per_dimension[dimension] = summary(requests, ours_s, hf_s)
    best = {name: {d: min(run[d] for run in runs)[0] for d in plan}
            for name, runs in (("ours", forgeline_runs), ("hf", hf_runs))}
    results = {"config": args.config, "params": model.args.num_params(), "rounds": args.rounds,
               "batch_size": cfg.eval.batch_size,
               "plan": {d: {"tasks": t, "limit": lim, "num_fewshot": n} for d, (t, lim, n) in plan.items()},
               "dimensions": per_dimension,
               **summary(sum(d["requests"] for d in per_dimension.values()),
                         sum(best["ours"].values()), sum(best["hf"].values()))}
    write_results("eval", results)


if __name__ == "__main__":
    main()
