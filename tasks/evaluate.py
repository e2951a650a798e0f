"""Eval stage: lm-evaluation-harness on the trained checkpoint through the registered
`forgeline` model class, offline, on the suite under eval/tasks/.

Output (`eval.out_dir`): `metrics.json` (flat `task/metric` scores; the DVC metrics file),
`lm_eval_results.json` (lm-eval's full results) and `tasks/` (the rendered task YAMLs that ran).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import lm_eval
from lm_eval.tasks import TaskManager

from forgeline.configs import Config
from forgeline.eval.lm import ForgelineLM
from forgeline.eval.suite import render_suite
from forgeline.model.checkpoint import CheckpointError, verify_checkpoint
from forgeline.tasks.atomic import write_text_atomic
from forgeline.tasks.train import read_train_summary

log = logging.getLogger(__name__)

METRICS_NAME = "metrics.json"


@dataclass(frozen=True)
class EvalResult:
    out_dir: str
    checkpoint: str
    metrics: dict[str, float]


def evaluate_model(cfg: Config) -> EvalResult:
    ecfg = cfg.eval
    checkpoint = Path(read_train_summary(cfg).checkpoint)
    problems = verify_checkpoint(checkpoint)
    if problems:
        raise CheckpointError(f"trained checkpoint {checkpoint} is not usable: {'; '.join(problems)}")
    data_dir = Path(cfg.data.out_dir)
    out_dir = Path(ecfg.out_dir)
    task_manager = TaskManager(include_path=str(render_suite(out_dir / "tasks", data_dir)))
    unknown = [t for t in ecfg.tasks if t not in task_manager.all_tasks]
    if unknown:
        raise ValueError(f"eval.tasks: unknown task(s) {unknown}; offline tasks here: "
                         f"{sorted(t for t in task_manager.all_tasks if t.startswith('forgeline_'))}")

    lm = ForgelineLM(checkpoint=str(checkpoint), tokenizer=str(data_dir / "tokenizer"),
                     batch_size=ecfg.batch_size)
    log.info("evaluating %s on %s (limit %s)", checkpoint, ", ".join(ecfg.tasks), ecfg.limit)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(ecfg.tasks),
        num_fewshot=ecfg.num_fewshot,
        limit=ecfg.limit,
        task_manager=task_manager,
        log_samples=False,
        bootstrap_iters=0,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )
    metrics = flatten_scores(results["results"])
    write_text_atomic(out_dir / "lm_eval_results.json",
                      json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
    write_text_atomic(out_dir / METRICS_NAME, json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    for name, value in metrics.items():
        log.info("%s = %.4f", name, value)
    return EvalResult(out_dir=str(out_dir), checkpoint=str(checkpoint), metrics=metrics)


def flatten_scores(results: dict[str, dict]) -> dict[str, float]:
    """{"task": {"acc,none": 0.3, "acc_stderr,none": ...}} -> {"task/acc": 0.3}. Only
    `metric,filter` entries with a finite number are kept, standard errors dropped; a filter
    other than `none` stays in the name (`task/exact_match/strict-match`)."""
    flat = {}
    for task, entries in sorted(results.items()):
        for key, value in entries.items():
            metric, comma, flt = key.partition(",")
            if not comma or metric.endswith("_stderr"):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                continue
            name = f"{task}/{metric}" if flt == "none" else f"{task}/{metric}/{flt}"
            flat[name] = float(value)
    return flat


def read_eval_metrics(cfg: Config) -> dict[str, float]:
    path = Path(cfg.eval.out_dir) / METRICS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the eval stage first (`forgeline stage eval`)")
    return json.loads(path.read_text())
