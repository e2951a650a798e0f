"""bench/eval: the forgeline lm-eval backend against lm-eval's own `hf` backend, in one run.

    .venv/bin/python bench/eval.py [--config tiny-single.yaml] [--limit 40] [--rounds 2]

Both evaluate the same model (the config's architecture, exported to Hugging Face format), on
the same requests: multiple choice (ARC-Easy, HellaSwag), rolling log-likelihood (held-out
documents) and generation (GSM8K), with the same batch size and threads. Reports requests per
second of each (best round) and the ratio (target >= 1.5). Writes bench/results/eval.json.
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

TASKS = ["forgeline_arc_easy", "forgeline_hellaswag", "forgeline_heldout", "forgeline_gsm8k"]


def timed(task_manager: TaskManager, limit: int, model: object) -> tuple[float, int]:
    """Seconds for the whole evaluation and the number of requests it made."""
    started = time.perf_counter()
    results = lm_eval.simple_evaluate(model=model, tasks=TASKS, limit=limit, task_manager=task_manager,
                                      log_samples=True, bootstrap_iters=0, gen_kwargs="max_gen_toks=32")
    elapsed = time.perf_counter() - started
    requests = sum(len(sample["resps"]) for samples in results["samples"].values() for sample in samples)
    return elapsed, requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny-single.yaml")
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())

    with tempfile.TemporaryDirectory(prefix="bench-eval-") as scratch:
        workdir = Path(scratch)
        cfg = load_config(args.config, [f"data.out_dir={workdir / 'data'}"])
        build_dataset(cfg)
        model = Transformer(model_args(cfg, read_manifest(workdir / "data")["vocab_size"]))
        model.init_weights(0)
        hf_dir = export_hf(model, workdir / "data" / "tokenizer", workdir / "hf")
        task_manager = TaskManager(include_path=str(render_suite(workdir / "tasks", workdir / "data")))
        ours = ForgelineLM(hf=str(hf_dir), tokenizer=str(hf_dir), batch_size=args.batch_size)
        theirs = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=args.batch_size)
        forgeline_runs, hf_runs = [], []
        for _ in range(args.rounds):
            forgeline_runs.append(timed(task_manager, args.limit, ours))
            hf_runs.append(timed(task_manager, args.limit, theirs))

    (ours_s, requests), (hf_s, hf_requests) = min(forgeline_runs), min(hf_runs)
    assert requests == hf_requests, "both backends must serve the same requests"
    results = {
        "config": args.config, "params": model.args.num_params(), "tasks": TASKS, "limit": args.limit,
        "requests": requests, "rounds": args.rounds, "batch_size": args.batch_size,
        "forgeline_requests_per_s": round(requests / ours_s, 1),
        "hf_requests_per_s": round(requests / hf_s, 1),
        "forgeline_over_hf": round(hf_s / ours_s, 3),
    }
    write_results("eval", results)


if __name__ == "__main__":
    main()
