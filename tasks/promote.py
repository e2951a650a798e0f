"""The promotion gate: alias `champion` moves to a model version only when its evaluation beats
the champion's by more than noise, item by item on the same items.

The rules (README, "The promotion gate"), with d the candidate's score minus the champion's,
paired on the candidate's items, and [lo, hi] its 95 % interval (eval/scores.py
paired_comparison):
  - promoted: overall lo >= registry.promotion_margin, and no dimension significantly regressed
    by more than registry.max_dimension_regression (its hi < -max_dimension_regression), and the
    two differ on at least one item;
  - rejected: a dimension so regressed, a dimension the champion was scored on and the
    candidate was not, or overall hi < promotion_margin (it misses the margin with 95 %
    confidence);
  - inconclusive: anything else. The decision then states the minimum detectable difference at
    the current item counts and the limits that would resolve a difference the size of d.
The first version becomes champion (there is nothing to compare with); `--force` moves the alias
regardless. A version whose registration is incomplete (tasks/register.py) is never judged, nor
made champion. Where no comparison can be made here (the candidate has no per-item results, or the
champion would have to be evaluated on a suite this code and data do not render), the decision
is inconclusive, saying why: the version stays registered and the alias where it was. Every
decision is a set of version tags: the outcome with its reasons and the intervals it rests on.

The candidate's per-item results are the eval stage's items.json, logged with the version's
run by the register stage; the champion's too. When the champion's do not cover the candidate's
items (another suite version, limit or few-shot count, or a version registered before items were
kept), the champion's registered export is evaluated on the candidate's items first (cached under
$FORGELINE_CACHE/evals by registry, version and suite).
"""

from __future__ import annotations

import logging
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from lm_eval.tasks import TaskManager
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from forgeline.configs import Config
from forgeline.eval.scores import Z80_POWER, Z95, detectable_difference, paired_comparison
from forgeline.eval.suite import render_suite, suite_fingerprint
from forgeline.tasks.compare import ITEMS_ARTIFACT, logged_items
from forgeline.tasks.evaluate import EvaluatedItems, cached_scores
from forgeline.tasks.pretrained import check_complete, registered_export, registry_key

log = logging.getLogger(__name__)

CHAMPION_ALIAS = "champion"
DECISION_TAG = "forgeline.promotion"
EVIDENCE_TAG_PREFIX = "forgeline.promotion."  # + "versus", "overall", "dimension/<name>", "detectable"
PROMOTED, INCONCLUSIVE, REJECTED = "promoted", "inconclusive", "rejected"


class Unpaired(ValueError):
    """The candidate's items cannot be paired with the champion's results here."""


@dataclass(frozen=True)
class Verdict:
    outcome: str  # PROMOTED, INCONCLUSIVE or REJECTED
    reasons: list[str]  # why it is not PROMOTED, or what it rests on


def signed_interval(difference: float, ci95: list[float] | None) -> str:
    if ci95 is None:
        return f"{difference:+.4f} (no interval: a task has fewer than two shared items)"
    return f"{difference:+.4f} [{ci95[0]:+.4f}, {ci95[1]:+.4f}]"


def identical(comparison: dict) -> bool:
    """Every shared item scored alike (a re-evaluated or retrained-identical model)."""
    return comparison["overall_stderr"] == 0 and comparison["overall"] == 0


def judge(comparison: dict, champion_dimensions: list[str], margin: float, max_regression: float) -> Verdict:
    """The gate's rules on a paired comparison (candidate minus champion)."""
    shared = sum(comparison["shared_items"].values())
    unshared = sorted(task for task, count in comparison["shared_items"].items() if not count)
    if unshared:
        return Verdict(INCONCLUSIVE, [f"no shared items in {', '.join(unshared)}"])
    overall = (f"overall {signed_interval(comparison['overall'], comparison['overall_ci95'])} "
               f"on {shared} shared items")
    rejections = [f"dimension {name} was not evaluated (the champion's was)"
                  for name in champion_dimensions if name not in comparison["dimensions"]]
    for name, entry in comparison["dimensions"].items():
        if entry["ci95"] is not None and entry["ci95"][1] < -max_regression:
            change = signed_interval(entry["difference"], entry["ci95"])
            rejections.append(f"dimension {name} regressed: {change}, worse than -{max_regression:g} "
                              "with 95 % confidence")
    low_high = comparison["overall_ci95"]
    if low_high is not None and low_high[1] < margin:
        rejections.append(f"{overall} is below the margin {margin:g} with 95 % confidence")
    if rejections:
        return Verdict(REJECTED, rejections)
    if identical(comparison):
        return Verdict(INCONCLUSIVE, [f"{overall}: identical results on every shared item"])
    if low_high is None:
        return Verdict(INCONCLUSIVE, [overall])
    if low_high[0] >= margin:
        return Verdict(PROMOTED, [f"{overall}: the lower bound clears the margin {margin:g}"])
    return Verdict(INCONCLUSIVE, [f"{overall} holds the margin {margin:g}"])


def resolution(comparison: dict, plan: dict[str, dict], margin: float) -> str:
    """What an inconclusive comparison would need: the minimum detectable difference at these
    counts, and the per-dimension limits at which a true difference the size of the observed one
    would clear the margin with 80 % power (the standard error shrinks as 1/sqrt(items))."""
    stderr = comparison["overall_stderr"]
    if stderr is None:
        return "at least two shared items per task are needed for an interval"
    if stderr == 0:
        return "more items cannot resolve it: the two score alike on every shared item"
    found = (f"the smallest overall difference these items detect (80 % power, 5 % two-sided) is "
             f"{detectable_difference(stderr):.4f}")
    effect = abs(comparison["overall"] - margin)
    if effect < 1e-9:
        return found + "; the observed difference equals the margin, so no number of items resolves it"
    factor = ((Z95 + Z80_POWER) * stderr / effect) ** 2
    if factor <= 1:
        return found
    limits = []
    for name, entry in plan.items():
        counts = [comparison["shared_items"][task] for task in entry["tasks"]]
        limits.append(f"eval.dimensions.{name}.limit={math.ceil(max(counts) * factor)}")
    return (found + f"; a difference of {comparison['overall']:+.4f} needs about {factor:.1f}x the items: "
            + " ".join(limits) + " (where the tasks have that many)")


@dataclass(frozen=True)
class Decision:
    model_name: str
    version: str
    champion_before: str | None
    outcome: str  # PROMOTED, INCONCLUSIVE or REJECTED
    reasons: list[str] = field(default_factory=list)
    advice: str = ""  # for an inconclusive decision: what would resolve it

    @property
    def promoted(self) -> bool:
        return self.outcome == PROMOTED

    def describe(self) -> str:
        if self.promoted and self.champion_before == self.version:
            return f"{self.model_name} version {self.version} is already @{CHAMPION_ALIAS}"
        if self.promoted:
            before = f"replacing version {self.champion_before}" if self.champion_before else "first champion"
            because = f": {'; '.join(self.reasons)}" if self.reasons else ""
            return f"{self.model_name} version {self.version} is now @{CHAMPION_ALIAS} ({before}){because}"
        text = (f"{self.model_name} version {self.version} stays behind @{CHAMPION_ALIAS} (version "
                f"{self.champion_before}), {self.outcome}: {'; '.join(self.reasons)}")
        return text + (f". {self.advice[0].upper()}{self.advice[1:]}" if self.advice else "")


def aliased(client: MlflowClient, model_name: str, alias: str) -> ModelVersion | None:
    """The version `alias` points at; None when the model or the alias does not exist (not when
    the registry fails to answer: that raises)."""
    try:
        return client.get_model_version_by_alias(model_name, alias)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def current_champion(client: MlflowClient, model_name: str) -> ModelVersion | None:
    return aliased(client, model_name, CHAMPION_ALIAS)


def champion_on_items(cfg: Config, client: MlflowClient, champion: ModelVersion,
                      candidate: EvaluatedItems) -> EvaluatedItems:
    """The champion's results on every item of the candidate's: its registered ones when they
    cover them, else its registered export evaluated on the candidate's items, which needs the
    candidate's suite here (this code and `data.out_dir`'s held-out documents)."""
    registered = logged_items(client, champion.run_id)
    why = registered.unpaired(candidate) if registered else ["no per-item results were registered with it"]
    if not why:
        return registered
    label = f"champion {champion.name}/{champion.version}"
    log.info("%s does not cover the candidate's items (%s): evaluating it on them", label, "; ".join(why))
    with tempfile.TemporaryDirectory() as scratch:
        data_dir = Path(cfg.data.out_dir)
        suite_dir = render_suite(Path(scratch) / "tasks", data_dir)
        here = suite_fingerprint(suite_dir, data_dir)
        if here != candidate.suite:
            raise Unpaired(f"the {label} must be evaluated on the candidate's items ({'; '.join(why)}), "
                           f"but the suite here (fingerprint {here[:12]}, from this code and {data_dir}) "
                           f"is not the candidate's ({candidate.suite[:12]}): run `forgeline promote` with "
                           "the candidate's code and data.out_dir, or re-run the candidate's eval and "
                           "register stages")
        export = registered_export(client.tracking_uri, champion.name, str(champion.version))
        model = {"registry": registry_key(client.tracking_uri), "model": champion.name,
                 "version": str(champion.version), "run": champion.run_id}
        scored = cached_scores(model, label, {"hf": str(export), "tokenizer": str(export)},
                               cfg.eval.batch_size, candidate.eval_plan(),
                               TaskManager(include_path=str(suite_dir)), candidate.suite)
    return EvaluatedItems(candidate.suite, candidate.plan, scored.items)


def evidence_tags(comparison: dict, champion: str, advice: str) -> dict[str, str]:
    """The intervals a decision rests on, as version tags."""
    tags = {"versus": f"version {champion}",
            "overall": signed_interval(comparison["overall"], comparison["overall_ci95"]),
            "shared_items": str(sum(comparison["shared_items"].values()))}
    tags |= {f"dimension/{name}": signed_interval(entry["difference"], entry["ci95"])
             for name, entry in comparison["dimensions"].items()}
    if advice:
        tags["resolution"] = advice
    return {EVIDENCE_TAG_PREFIX + key: value for key, value in tags.items()}


def decide(cfg: Config, client: MlflowClient, candidate: ModelVersion,
           champion: ModelVersion) -> tuple[Decision, dict[str, str]]:
    """The gate on `candidate` against `champion`: the decision and its evidence tags."""
    candidate_items = logged_items(client, candidate.run_id)
    try:
        if candidate_items is None:
            raise Unpaired(f"it has no per-item eval results ({ITEMS_ARTIFACT} of run {candidate.run_id}): "
                           "re-run its eval and register stages, or move the alias with --force")
        champion_items = champion_on_items(cfg, client, champion, candidate_items)
    except Unpaired as err:  # no evidence either way: the version stays registered, the alias stays
        return Decision(candidate.name, str(candidate.version), str(champion.version), INCONCLUSIVE,
                        [f"not compared: {err}"]), {}
    comparison = paired_comparison(candidate_items.items, champion_items.items, candidate_items.scores())
    rcfg = cfg.registry
    verdict = judge(comparison, list(champion_items.plan), rcfg.promotion_margin,
                    rcfg.max_dimension_regression)
    advice = resolution(comparison, candidate_items.plan, rcfg.promotion_margin) \
        if verdict.outcome == INCONCLUSIVE else ""
    decision = Decision(candidate.name, str(candidate.version), str(champion.version), verdict.outcome,
                        verdict.reasons, advice)
    return decision, evidence_tags(comparison, str(champion.version), advice)


def recorded_decision(version: ModelVersion) -> str | None:
    """The gate's decision recorded on `version`, in words; None if the gate has not decided on it."""
    tag = version.tags.get(DECISION_TAG)
    return None if tag is None else f"{version.name} version {version.version} was decided on before: {tag}"


def promote(cfg: Config, client: MlflowClient, version: str, force: bool = False) -> Decision:
    """Move `champion` to `version` of `registry.model_name` if the gate passes (or `force`), and
    record the decision and its evidence as version tags. A version whose registration is
    incomplete is refused (pretrained.IncompleteRegistration): it never becomes champion."""
    name = cfg.registry.model_name
    candidate = check_complete(client.get_model_version(name, version), client.tracking_uri)
    champion = current_champion(client, name)
    before = str(champion.version) if champion else None
    evidence = {}
    if champion is None or before == str(candidate.version):
        decision = Decision(name, str(candidate.version), before, PROMOTED)
    elif force:
        decision = Decision(name, str(candidate.version), before, PROMOTED, ["forced"])
    else:
        decision, evidence = decide(cfg, client, candidate, champion)
    if decision.promoted:
        client.set_registered_model_alias(name, CHAMPION_ALIAS, decision.version)
    tag = decision.outcome if not decision.reasons else f"{decision.outcome}: {'; '.join(decision.reasons)}"
    for key, value in {DECISION_TAG: tag, **evidence}.items():
        client.set_model_version_tag(name, decision.version, key, value[:5000])
    log.info("%s", decision.describe())
    return decision
