"""Eval stage: lm-evaluation-harness on the trained checkpoint through the registered
`forgeline` model class, offline, on the suite under eval/tasks/, scored per capability
dimension.

Each task's value is chance-normalized -- (value - chance) / (best - chance): 0 is random
guessing, 1 perfect -- a dimension's score is the mean over its tasks and the overall score the
mean over dimensions (eval/dimensions.py says which metric, chance and best each task has).

A run that starts from a pretrained base (`model.init_from`) has the base evaluated too, on the
same items (the same suite, limits and few-shot examples): its scores sit beside the run's in
every output -- `base/...` and `versus_base/...` (the run's score minus the base's) in
metrics.json and MLflow, `base` and `versus_base` in report.json, the base's bars beside the
run's in the chart. A base's scores are cached under $FORGELINE_CACHE/evals by its weights'
sha256 and the suite's fingerprint (eval/suite.py), so the runs continued from one base
evaluate it once.

Output (`eval.out_dir`): `report.json` (scores per dimension and task), `metrics.json` (flat;
the DVC metrics file), `lm_eval_results.json` (lm-eval's results per dimension),
`dimensions.png` (a chart of the dimension scores), `tasks/` (the rendered task YAMLs that ran).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import lm_eval
from lm_eval.tasks import TaskManager
from matplotlib.figure import Figure

from forgeline.configs import Config
from forgeline.configs.schema import DimensionConfig, EvalConfig
from forgeline.eval.dimensions import DIMENSION_TASKS, TaskScore
from forgeline.eval.lm import ForgelineLM
from forgeline.eval.scores import aggregate, flatten_scores
from forgeline.eval.suite import render_suite, suite_fingerprint
from forgeline.model.checkpoint.manager import CheckpointError, verify_checkpoint
from forgeline.tasks.atomic import write_text_atomic
from forgeline.tasks.pretrained import Base, forgeline_cache, resolve_base
from forgeline.tasks.tracking import RunTracker
from forgeline.tasks.train.job import read_train_summary

log = logging.getLogger(__name__)

METRICS_NAME = "metrics.json"
REPORT_NAME = "report.json"
RESULTS_NAME = "lm_eval_results.json"
CHART_NAME = "dimensions.png"


@dataclass(frozen=True)
class EvalResult:
    out_dir: str
    checkpoint: str
    overall: float
    dimensions: dict[str, float]
    metrics: dict[str, float]  # flat: every task metric, "dimension/<name>" and "overall" (and base/...)
    base_overall: float | None = None  # the pretrained base's, on the same items
    base_dimensions: dict[str, float] | None = None

    def markdown(self) -> str:
        if self.base_dimensions is None:
            rows = [f"| {name} | {score:.3f} |" for name, score in self.dimensions.items()]
            overall = f"| **overall** | **{self.overall:.3f}** |"
            return "\n".join(["| dimension | score |", "|---|---|", *rows, overall])
        rows = [f"| {name} | {score:.3f} | {self.base_dimensions[name]:.3f} | "
                f"{score - self.base_dimensions[name]:+.3f} |" for name, score in self.dimensions.items()]
        overall = (f"| **overall** | **{self.overall:.3f}** | **{self.base_overall:.3f}** | "
                   f"**{self.overall - self.base_overall:+.3f}** |")
        return "\n".join(["| dimension | score | base | change |", "|---|---|---|---|", *rows, overall])


def plan_tasks(ecfg: EvalConfig) -> dict[str, tuple[list[TaskScore], DimensionConfig]]:
    """The registered tasks each configured dimension runs (with task_source=hub, lm-eval's
    standard task where there is one); unknown names fail here, before any model is loaded."""
    plan = {}
    for name, dcfg in ecfg.dimensions.items():
        registered = {score.task: score for score in DIMENSION_TASKS[name]}
        wanted = dcfg.tasks if dcfg.tasks is not None else list(registered)
        unknown = [task for task in wanted if task not in registered]
        if unknown:
            raise ValueError(f"eval.dimensions.{name}.tasks: {unknown} are not {name} tasks; "
                             f"available: {sorted(registered)}")
        scores = [registered[task] for task in wanted]
        if ecfg.task_source == "hub":
            scores = [replace(s, task=s.hub_task) if s.hub_task else s for s in scores]
        plan[name] = (scores, dcfg)
    return plan


def check_task_source(ecfg: EvalConfig) -> None:
    """Hub tasks need the Hub: refuse before any work rather than time out in lm-eval."""
    offline = [var for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
               if os.environ.get(var, "").lower() in ("1", "true", "yes", "on")]
    if ecfg.task_source == "hub" and offline:
        raise ValueError(f"eval.task_source=hub reads benchmark data from the Hugging Face Hub, but "
                         f"{' and '.join(offline)} is set; run with {' '.join(v + '=0' for v in offline)} "
                         f"or use eval.task_source=packaged")


def preflight_eval(cfg: Config) -> None:
    """The tasks exist and, for hub tasks, the Hub may be reached."""
    plan_tasks(cfg.eval)
    check_task_source(cfg.eval)


def eval_stage(cfg: Config, run: RunTracker, parent: RunTracker | None) -> EvalResult:
    """The eval stage's function (tasks/stage.py)."""
    return evaluate_model(cfg)


def record_eval(cfg: Config, run: RunTracker, parent: RunTracker | None, result: EvalResult) -> None:
    """Every score, the report, lm-eval's results and the chart; the scores and chart on the parent."""
    run.log_metrics(result.metrics)
    for name in (REPORT_NAME, RESULTS_NAME, CHART_NAME):
        run.log_artifact(Path(result.out_dir) / name, "eval")
    if parent:
        parent.log_metrics({f"eval/{k}": v for k, v in result.metrics.items()})
        parent.log_artifact(Path(result.out_dir) / CHART_NAME, "eval")


Plan = dict[str, tuple[list[TaskScore], DimensionConfig]]


def evaluate_model(cfg: Config) -> EvalResult:
    plan = plan_tasks(cfg.eval)
    checkpoint = Path(read_train_summary(cfg).checkpoint)
    problems = verify_checkpoint(checkpoint)
    if problems:
        raise CheckpointError(f"trained checkpoint {checkpoint} is not usable: {'; '.join(problems)}")
    data_dir, out_dir = Path(cfg.data.out_dir), Path(cfg.eval.out_dir)
    suite_dir = render_suite(out_dir / "tasks", data_dir)
    task_manager = TaskManager(include_path=str(suite_dir))
    raw, full_results = score_model(dict(checkpoint=str(checkpoint), tokenizer=str(data_dir / "tokenizer")),
                                    cfg.eval, plan, task_manager)
    report = aggregate(raw, {name: scores for name, (scores, _) in plan.items()})
    dimensions = {name: entry["score"] for name, entry in report["dimensions"].items()}
    metrics = raw | {f"dimension/{name}": score for name, score in dimensions.items()}
    metrics["overall"] = report["overall"]
    result = EvalResult(out_dir=str(out_dir), checkpoint=str(checkpoint), overall=report["overall"],
                        dimensions=dimensions, metrics=metrics)
    if cfg.model.init_from:
        base = resolve_base(cfg)
        base_raw = base_scores(base, cfg.eval, plan, task_manager, suite_fingerprint(suite_dir, data_dir))
        result = beside_base(result, report, base, aggregate(base_raw, {n: s for n, (s, _) in plan.items()}),
                             base_raw)
    write_text_atomic(out_dir / RESULTS_NAME,
                      json.dumps(full_results, indent=2, sort_keys=True, default=str) + "\n")
    write_text_atomic(out_dir / REPORT_NAME, json.dumps(report, indent=2) + "\n")
    write_text_atomic(out_dir / METRICS_NAME, json.dumps(result.metrics, indent=2, sort_keys=True) + "\n")
    plot_dimensions(result, out_dir / CHART_NAME)
    log.info("eval scores:\n%s", result.markdown())
    return result


def score_model(model_args: dict[str, str], ecfg: EvalConfig, plan: Plan,
                task_manager: TaskManager) -> tuple[dict[str, float], dict[str, dict]]:
    """Every planned task on one model (ForgelineLM's arguments): the flat metrics, and lm-eval's
    results per dimension. The model is freed on return (a second may be loaded next)."""
    lm = ForgelineLM(batch_size=ecfg.batch_size, **model_args)
    raw: dict[str, float] = {}
    full_results = {}
    for name, (scores, dcfg) in plan.items():
        log.info("evaluating %s: %s (limit %s, %d-shot)", name, ", ".join(s.task for s in scores),
                 dcfg.limit, dcfg.num_fewshot)
        results = lm_eval.simple_evaluate(
            model=lm, tasks=[s.task for s in scores], num_fewshot=dcfg.num_fewshot, limit=dcfg.limit,
            task_manager=task_manager, log_samples=False, bootstrap_iters=0,
            random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
        )
        full_results[name] = results
        raw |= flatten_scores(results["results"])
    del lm
    gc.collect()
    return raw, full_results


def base_scores(base: Base, ecfg: EvalConfig, plan: Plan, task_manager: TaskManager,
                suite: str) -> dict[str, float]:
    """The base's flat metrics on the same items as the run's, from the cache when this base
    was evaluated under the same suite fingerprint, plan and batch size before."""
    plan_key = {name: ([s.task for s in scores], dcfg.limit, dcfg.num_fewshot)
                for name, (scores, dcfg) in plan.items()}
    key = hashlib.sha256(json.dumps([base.sha256, base.tokenizer_sha256, suite, plan_key, ecfg.batch_size],
                                    sort_keys=True).encode()).hexdigest()
    cached = forgeline_cache() / "evals" / f"base-{key[:32]}.json"
    if cached.is_file():
        log.info("the base %s on these items: scores from %s", base.uri, cached)
        return json.loads(cached.read_text())["metrics"]
    log.info("evaluating the base %s on the same items", base.uri)
    source = {"checkpoint" if base.is_checkpoint else "hf": str(base.weights)}
    raw, _ = score_model(source | {"tokenizer": str(base.tokenizer)}, ecfg, plan, task_manager)
    write_text_atomic(cached, json.dumps({"base": base.lineage(), "suite": suite, "plan": plan_key,
                                          "metrics": raw}, indent=2, sort_keys=True) + "\n")
    return raw


def beside_base(result: EvalResult, report: dict, base: Base, base_report: dict,
                base_raw: dict[str, float]) -> EvalResult:
    """The run's result with the base's scores beside it; `report` gains `base` and
    `versus_base` (the run's scores minus the base's)."""
    base_dimensions = {name: entry["score"] for name, entry in base_report["dimensions"].items()}
    report["base"] = {"uri": base.uri, "weights_sha256": base.sha256} | base_report
    report["versus_base"] = {
        "overall": result.overall - base_report["overall"],
        "dimensions": {name: score - base_dimensions[name] for name, score in result.dimensions.items()},
    }
    versus = report["versus_base"]
    metrics = (result.metrics | {f"base/{key}": value for key, value in base_raw.items()}
               | {f"base/dimension/{name}": score for name, score in base_dimensions.items()}
               | {"base/overall": base_report["overall"], "versus_base/overall": versus["overall"]}
               | {f"versus_base/dimension/{name}": change for name, change in versus["dimensions"].items()})
    return replace(result, metrics=metrics, base_overall=base_report["overall"],
                   base_dimensions=base_dimensions)


def plot_dimensions(result: EvalResult, path: Path) -> None:
    """Horizontal bars of the dimension scores; the base's beside them when there is one."""
    names = list(result.dimensions)
    figure = Figure(figsize=(7, 0.5 * len(names) * (2 if result.base_dimensions else 1) + 1.5))  # no pyplot
    axes = figure.subplots()
    title = f"capability profile -- overall {result.overall:.3f}"
    if result.base_dimensions is None:
        axes.barh(names, [result.dimensions[n] for n in names], color="#4C72B0")
    else:
        rows = range(len(names))
        axes.barh([r - 0.2 for r in rows], [result.dimensions[n] for n in names], height=0.4,
                  color="#4C72B0", label=f"this run ({result.overall:.3f})")
        axes.barh([r + 0.2 for r in rows], [result.base_dimensions[n] for n in names], height=0.4,
                  color="#A0A0A0", label=f"its base ({result.base_overall:.3f})")
        axes.set_yticks(list(rows), names)
        axes.legend(loc="lower right")
        title += f", base {result.base_overall:.3f}"
    axes.axvline(0, color="black", linewidth=0.8)
    axes.invert_yaxis()
    axes.set_xlabel("chance-normalized score (0 = chance, 1 = best)")
    axes.set_title(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def read_eval_metrics(cfg: Config) -> dict[str, float]:
    path = Path(cfg.eval.out_dir) / METRICS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the eval stage first (`forgeline stage eval`)")
    return json.loads(path.read_text())
