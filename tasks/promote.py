"""The promotion gate: alias `champion` moves to a model version only when its evaluation beats
the champion's by more than noise, item by item on the same items.

The rules (docs/promotion.md), with d the candidate's score minus the champion's, paired on the
candidate's items (eval/scores.py paired_comparison): each dimension's d is tested against 0 and
the overall d against registry.promotion_margin by the paired swap test (exact or permutation,
clusters of items kept together), and the p-values of all these tests together are corrected by
Holm's method, so that of two equally good models any of them is called different in at most
5 % of comparisons (ALPHA). A dimension is significantly worse (better) when its corrected
p-value is at most 5 % and d < 0 (d > 0); the overall is significantly below (above) the margin
likewise.
  - rejected: a dimension significantly worse while none is significantly better, whatever
    registry.max_dimension_regression (averaging in dimensions at chance must not wash out a real
    loss); in a trade-off (some dimension significantly better), a dimension significantly worse
    whose 95 % interval lies below -registry.max_dimension_regression; a dimension the champion
    was scored on and the candidate was not; or the overall significantly below the margin;
  - promoted: none of those, the two differ on at least one item, and either the overall is
    significantly above the margin, or (with a margin of at most 0) a dimension is significantly
    better and none significantly worse -- the mirror of the rejection, with the same error;
  - inconclusive: anything else -- no dimension decided. The decision then states the minimum
    detectable difference at the current item counts and the limits that would resolve a
    difference the size of d.
While the line has no champion, a candidate trained from a base (`model.init_from`) faces its base
as it would a champion -- these rules, on the items the eval stage scored both on (items.json's
`base`, logged with the version's run), the base named by the version's BASE_TAG --: promoted,
rejected or inconclusive alike, the alias staying unset unless promoted: the first champion is
never a model the evidence says is worse than what the line started from. A candidate with no base
among its per-item results (trained from scratch) becomes the first champion. `--force` moves the
alias regardless. A version whose registration is incomplete (tasks/register.py) is never judged,
nor made champion. Where no comparison can be made here (the candidate has no per-item results, or
the champion would have to be evaluated on a suite this code and data do not render), the decision
is inconclusive, saying why: the version stays registered and the alias where it was. A registry
or artifact store that fails to answer is an error, never a decision. Every decision is a set of
version tags: the outcome with the champion (or base) it was compared with and its reasons, and
the intervals it rests on.

The candidate's per-item results are the eval stage's items.json, logged with the version's
run by the register stage; the champion's too. When the champion's do not cover the candidate's
items (another suite version, limit or few-shot count, or a version registered before items were
kept), the champion's registered export is evaluated on the candidate's items first (cached under
$FORGELINE_CACHE/evals by registry, version and suite).

Decisions are serialized by the promotion lock (`promotion_lock`), so that two registrations at
once cannot both move the alias on a comparison with the same champion. The gate decides outside
it (an evaluation of the champion can take minutes); under it, the champion is read again and the
decision recorded and the alias moved only if the champion is still the one the decision was made
against (still none, for a decision against the base) -- else the gate decides again, against the
new one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion, RegisteredModel
from mlflow.exceptions import MlflowException
from transformers import AutoConfig

from forgeline.configs import Config
from forgeline.eval.scores import ALPHA, detectable_difference, holm, paired_comparison
from forgeline.eval.suite import render_suite, suite_fingerprint, suite_task_manager
from forgeline.model.hf import model_shape_from_hf
from forgeline.tasks.compare import ITEMS_ARTIFACT, logged_items, run_items_beside_base
from forgeline.tasks.evaluate import EvaluatedItems, cached_scores
from forgeline.tasks.pretrained import check_complete, registered_export, registry_key

log = logging.getLogger(__name__)

CHAMPION_ALIAS = "champion"
DECISION_TAG = "forgeline.promotion"
EVIDENCE_TAG_PREFIX = "forgeline.promotion."  # + "versus": the champion (or base) the decision faced
# On a version trained from a base: the base's `model.init_from`, as train/job.py base_tags names it on
# the train run. The register stage sets it (tasks/register.py version_tags); the gate names the base by it.
BASE_TAG = "forgeline.base"
# The rest of the evidence, in one tag (JSON: "overall", "shared_items", "dimension/<name>",
# "p_values", "resolution"): one tag each filled MLflow's versions list with a column per row.
EVIDENCE_TAG = f"{EVIDENCE_TAG_PREFIX}evidence"
# A promotion's decision, written before the alias moves and replaced by DECISION_TAG after: a
# process that dies in between leaves the champion with it, and the next `promote` records it.
PENDING_TAG = "forgeline.promotion.pending"
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


OVERALL = "overall"  # the overall test's name among the dimensions' in the corrected family


def corrected_p_values(comparison: dict) -> dict[str, float]:
    """Holm's adjusted p-values of every test of the comparison: each dimension's (d = 0) and the
    overall one (d = the margin), by name (OVERALL for the overall)."""
    tested = {name: entry["p_value"] for name, entry in comparison["dimensions"].items()}
    return holm({**tested, OVERALL: comparison["overall_p_value"]})


def significance(p_value: float, corrected: float) -> str:
    return f"p = {p_value:.3g}, {corrected:.3g} corrected for all the comparison's tests"


def judge(comparison: dict, champion_dimensions: list[str], max_regression: float) -> Verdict:
    """The gate's rules on a paired comparison (candidate minus champion), whose overall was
    tested against the promotion margin (paired_comparison's `margin`)."""
    margin = comparison["margin"]
    shared = sum(comparison["shared_items"].values())
    unshared = sorted(task for task, count in comparison["shared_items"].items() if not count)
    if unshared:
        return Verdict(INCONCLUSIVE, [f"no shared items in {', '.join(unshared)}"])
    overall = (f"overall {signed_interval(comparison['overall'], comparison['overall_ci95'])} "
               f"on {shared} shared items")
    rejections = [f"dimension {name} was not evaluated (the champion's was)"
                  for name in champion_dimensions if name not in comparison["dimensions"]]
    if comparison["overall_p_value"] is None:
        return Verdict(REJECTED, rejections) if rejections else Verdict(INCONCLUSIVE, [overall])
    corrected = corrected_p_values(comparison)
    rejections += regressions(comparison["dimensions"], corrected, max_regression)
    overall_decided = corrected[OVERALL] <= ALPHA
    evidence = significance(comparison["overall_p_value"], corrected[OVERALL])
    if overall_decided and comparison["overall"] < margin:
        rejections.append(f"{overall} is below the margin {margin:g} with 95 % confidence ({evidence})")
    if rejections:
        return Verdict(REJECTED, rejections)
    if identical(comparison):
        return Verdict(INCONCLUSIVE, [f"{overall}: identical results on every shared item"])
    if overall_decided:
        return Verdict(PROMOTED, [f"{overall} is above the margin {margin:g} ({evidence})"])
    better = improvements(comparison["dimensions"], corrected)
    worse = worse_dimensions(comparison["dimensions"], corrected)
    if better and margin <= 0 and not worse:
        return Verdict(PROMOTED, [*better, "no dimension is worse"])
    held = f"{overall} holds the margin {margin:g} ({evidence})"
    if better or worse:  # a trade-off within the tolerance, or a gain short of a positive margin
        return Verdict(INCONCLUSIVE, [held, *better, *(f"dimension {name} is worse, within the tolerance"
                                                       for name in worse)])
    return Verdict(INCONCLUSIVE, [f"{held}; no dimension decided"])


def worse_dimensions(dimensions: dict[str, dict], corrected: dict[str, float]) -> list[str]:
    return [name for name in significant(dimensions, corrected) if dimensions[name]["difference"] < 0]


def better_dimensions(dimensions: dict[str, dict], corrected: dict[str, float]) -> list[str]:
    return [name for name in significant(dimensions, corrected) if dimensions[name]["difference"] > 0]


def significant(dimensions: dict[str, dict], corrected: dict[str, float]) -> list[str]:
    """The dimensions whose difference from 0 is significant after the correction."""
    return [name for name in dimensions if corrected[name] <= ALPHA]


def change(dimensions: dict[str, dict], name: str, corrected: dict[str, float]) -> str:
    entry = dimensions[name]
    return (f"{signed_interval(entry['difference'], entry['ci95'])} "
            f"({significance(entry['p_value'], corrected[name])})")


def improvements(dimensions: dict[str, dict], corrected: dict[str, float]) -> list[str]:
    """The dimensions significantly better, in words."""
    return [f"dimension {name} improved: {change(dimensions, name, corrected)}"
            for name in better_dimensions(dimensions, corrected)]


def regressions(dimensions: dict[str, dict], corrected: dict[str, float], max_regression: float) -> list[str]:
    """The dimensions that reject the candidate. With no dimension significantly better, each one
    significantly worse: a loss that nothing pays for, however small. In a trade-off (some
    dimension significantly better), each one significantly worse whose 95 % interval lies below
    -max_regression: the loss the tolerance does not cover."""
    worse = worse_dimensions(dimensions, corrected)
    better = better_dimensions(dimensions, corrected)
    if not better:
        return [f"dimension {name} regressed: {change(dimensions, name, corrected)}, worse with 95 % "
                "confidence, and no dimension is better" for name in worse]
    return [f"dimension {name} regressed: {change(dimensions, name, corrected)}, worse than "
            f"-{max_regression:g} with 95 % confidence (the tolerance for a trade-off: {', '.join(better)} "
            "better)" for name in worse if dimensions[name]["ci95"][1] < -max_regression]


def resolution(comparison: dict, plan: dict[str, dict]) -> str:
    """What an inconclusive comparison -- one no dimension decided -- would need: the minimum
    detectable difference at these counts (80 % power at the gate's corrected level), and the
    per-dimension limits at which a true difference the size of the observed one would clear
    the margin with that power (the standard error shrinks as 1/sqrt(items))."""
    stderr = comparison["overall_stderr"]
    if stderr is None:
        return "at least two shared items per task are needed for an interval"
    if stderr == 0:
        return "more items cannot resolve it: the two score alike on every shared item"
    detectable = detectable_difference(stderr, tests=len(comparison["dimensions"]) + 1)
    found = (f"the smallest overall difference these items detect (80 % power, 5 % family-wise over "
             f"the {len(comparison['dimensions']) + 1} tests) is {detectable:.4f}")
    effect = abs(comparison["overall"] - comparison["margin"])
    if effect < 1e-9:
        return found + "; the observed difference equals the margin, so no number of items resolves it"
    factor = (detectable / effect) ** 2
    if factor <= 1:
        return found
    limits = []
    for name, entry in plan.items():
        counts = [comparison["shared_items"][task] for task in entry["tasks"]]
        limits.append(f"eval.dimensions.{name}.limit={math.ceil(max(counts) * factor)}")
    return (found + f"; a difference of {comparison['overall']:+.4f} needs about {factor:.1f}x the items: "
            + " ".join(limits) + " (where the tasks have that many)")


@dataclass(frozen=True)
class ChampionVersion:
    """The version of the line that was @champion when the gate decided."""
    number: str

    def __str__(self) -> str:  # `versus version 2`, and the evidence's `versus` tag
        return f"version {self.number}"

    @property
    def named(self) -> str:  # `rejected against champion version 2`
        return f"champion {self}"


@dataclass(frozen=True)
class TrainedFrom:
    """The base the candidate was trained from, faced while the line has no champion."""
    uri: str | None
    """Its `model.init_from` (BASE_TAG); None for a version registered before the tag was set."""

    def __str__(self) -> str:
        return f"its base {self.uri}" if self.uri else "its base"

    @property
    def named(self) -> str:
        return str(self)


Faced = ChampionVersion | TrainedFrom


@dataclass(frozen=True)
class Decision:
    model_name: str
    version: str
    faced: Faced | None
    """What the candidate was compared with (or moved over, forced); None: the line had no champion
    and the candidate no base to face."""
    outcome: str  # PROMOTED, INCONCLUSIVE or REJECTED
    reasons: list[str] = field(default_factory=list)
    advice: str = ""  # for an inconclusive decision: what would resolve it
    forced: bool = False  # `--force`: the alias moved without the gate
    gist: str = ""  # what decided it, in a few words (one_line); the reasons say it in full

    def one_line(self) -> str:
        """The decision in one line: the version's description, which the registry's pages show
        first (the tags hold the evidence). `promoted to champion over version 2: better on
        reasoning (+0.021 ± 0.008), no dimension worse`; `rejected against champion version 2:
        worse on knowledge (-0.030 ± 0.011)`; `rejected against its base package:...: worse on
        instruction_following (-0.068 ± 0.031)`."""
        if self.forced:
            over = f" over {self.faced}" if self.faced else ", no champion before"
            return f"promoted to champion by --force{over} (no gate)"
        if self.outcome == PROMOTED:
            if self.faced is None:
                return "promoted to champion: the first version, no champion to compare with"
            head = f"promoted to champion over {self.faced}"
        else:
            head = f"{self.outcome} against {self.faced.named}"
        return f"{head}: {self.gist or (self.reasons[0] if self.reasons else self.outcome)}"

    @property
    def promoted(self) -> bool:
        return self.outcome == PROMOTED

    @property
    def champion_before(self) -> str | None:
        """The champion's version when the gate decided; None while the line had none."""
        return self.faced.number if isinstance(self.faced, ChampionVersion) else None

    @property
    def already(self) -> bool:
        """Nothing to decide: the version is the champion."""
        return self.champion_before == self.version

    def against(self) -> str:
        """What it was compared with (`versus version 2`, `versus its base URI`), or why nothing."""
        if self.forced:
            return f"forced over {self.faced}" if self.faced else "forced, no champion before"
        return f"versus {self.faced}" if self.faced else "no champion before"

    def record(self) -> str:
        """The version's DECISION_TAG: the outcome, what it was decided against, and why."""
        return f"{self.outcome}: " + "; ".join([self.against(), *self.reasons])

    def describe(self) -> str:
        if self.already:
            return f"{self.model_name} version {self.version} is already @{CHAMPION_ALIAS}"
        if self.promoted:
            because = f": {'; '.join(self.reasons)}" if self.reasons else ""
            return (f"{self.model_name} version {self.version} is now @{CHAMPION_ALIAS} ({self.against()})"
                    + because)
        behind = (f"@{CHAMPION_ALIAS} ({self.faced})" if isinstance(self.faced, ChampionVersion)
                  else f"{self.faced} (no @{CHAMPION_ALIAS} yet)")
        text = (f"{self.model_name} version {self.version} stays behind {behind}, {self.outcome}: "
                f"{'; '.join(self.reasons)}")
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


def version_of(version: ModelVersion | None) -> str | None:
    return None if version is None else str(version.version)


def champion_on_items(cfg: Config, client: MlflowClient, champion: ModelVersion,
                      candidate: EvaluatedItems) -> EvaluatedItems:
    """The champion's results on every item of the candidate's: its registered ones when they
    cover them, else its registered export evaluated on the candidate's items (in its windows and
    precision), which needs the candidate's suite here (this code and `data.out_dir`'s held-out
    documents)."""
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
        scored = cached_scores(model, label, scored_as(candidate, export, label), cfg.eval.batch_size,
                               candidate.eval_plan(), suite_task_manager(suite_dir), candidate.suite)
    return EvaluatedItems(candidate.suite, candidate.plan, scored.items, candidate.max_length,
                          candidate.precision)


def scored_as(candidate: EvaluatedItems, export: Path, label: str) -> dict[str, str | int]:
    """ForgelineLM's arguments for scoring the champion's `export` in the candidate's windows and
    precision (tasks/evaluate.py Scoring): a score depends on both, so the two must share them.
    No window recorded (items from before windows were kept): the champion's own context."""
    model_args = {"hf": str(export), "tokenizer": str(export), "precision": candidate.precision}
    if candidate.max_length is None:
        return model_args
    context = model_shape_from_hf(AutoConfig.from_pretrained(str(export))).max_seq_len
    if candidate.max_length > context:
        raise Unpaired(f"the candidate was scored in windows of {candidate.max_length} tokens, longer than "
                       f"the {label}'s context of {context}: the two cannot be scored alike")
    return model_args | {"max_length": candidate.max_length}


def evidence_tags(comparison: dict, faced: Faced, advice: str) -> dict[str, str]:
    """The intervals a decision rests on, as two version tags: what it faced (`version 2`, `its
    base URI`), and the rest under EVIDENCE_TAG (flows/reports.py renders them)."""
    evidence = {"overall": signed_interval(comparison["overall"], comparison["overall_ci95"]),
            "shared_items": str(sum(comparison["shared_items"].values()))}
    evidence |= {f"dimension/{name}": signed_interval(entry["difference"], entry["ci95"])
                 for name, entry in comparison["dimensions"].items()}
    if comparison["overall_p_value"] is not None:
        corrected = corrected_p_values(comparison)
        tested = {OVERALL: comparison["overall_p_value"]} | {
            name: entry["p_value"] for name, entry in comparison["dimensions"].items()}
        evidence["p_values"] = "; ".join(f"{name} {p_value:.3g} (corrected {corrected[name]:.3g})"
                                         for name, p_value in tested.items())
    if advice:
        evidence["resolution"] = advice
    return {f"{EVIDENCE_TAG_PREFIX}versus": str(faced), EVIDENCE_TAG: json.dumps(evidence)}


def decide(cfg: Config, client: MlflowClient, candidate: ModelVersion,
           champion: ModelVersion) -> tuple[Decision, dict[str, str]]:
    """The gate on `candidate` against `champion`: the decision and its evidence tags."""
    faced = ChampionVersion(str(champion.version))
    candidate_items = logged_items(client, candidate.run_id)
    try:
        if candidate_items is None:
            raise Unpaired(f"it has no per-item eval results ({ITEMS_ARTIFACT} of run {candidate.run_id}): "
                           "re-run its eval and register stages, or move the alias with --force")
        champion_items = champion_on_items(cfg, client, champion, candidate_items)
    except Unpaired as err:  # no evidence either way: the version stays registered, the alias stays
        return Decision(candidate.name, str(candidate.version), faced, INCONCLUSIVE,
                        [f"not compared: {err}"], gist="not compared: " + str(err).partition(":")[0]), {}
    return judged(cfg, candidate, candidate_items, faced, champion_items)


def decide_without_champion(cfg: Config, client: MlflowClient,
                            candidate: ModelVersion) -> tuple[Decision, dict[str, str]]:
    """The gate on `candidate` in a line with no champion: against the base it was trained from,
    on the items the eval stage scored both on, as against a champion; the first champion when no
    base is among its per-item results (trained from scratch, or registered without them)."""
    beside_base = None if candidate.run_id is None else run_items_beside_base(client, candidate.run_id)
    if beside_base is None:
        return Decision(candidate.name, str(candidate.version), None, PROMOTED), {}
    candidate_items, base_items = beside_base
    return judged(cfg, candidate, candidate_items, TrainedFrom(candidate.tags.get(BASE_TAG)), base_items)


def judged(cfg: Config, candidate: ModelVersion, candidate_items: EvaluatedItems, faced: Faced,
           faced_items: EvaluatedItems) -> tuple[Decision, dict[str, str]]:
    """The gate's rules on the candidate's items against those of what it faced, scored on all of
    them alike: the decision and its evidence tags."""
    rcfg = cfg.registry
    comparison = paired_comparison(candidate_items.items, faced_items.items, candidate_items.scores(),
                                   rcfg.promotion_margin)
    verdict = judge(comparison, list(faced_items.plan), rcfg.max_dimension_regression)
    advice = resolution(comparison, candidate_items.plan) if verdict.outcome == INCONCLUSIVE else ""
    decision = Decision(candidate.name, str(candidate.version), faced, verdict.outcome, verdict.reasons,
                        advice, gist=gist(verdict, comparison, list(faced_items.plan)))
    return decision, evidence_tags(comparison, faced, advice)


def short_interval(difference: float, ci95: list[float] | None) -> str:
    """`+0.021 ± 0.008`: the difference and the half-width of its 95 % interval."""
    return f"{difference:+.3f}" + ("" if ci95 is None else f" ± {(ci95[1] - ci95[0]) / 2:.3f}")


def gist(verdict: Verdict, comparison: dict, champion_dimensions: list[str]) -> str:
    """What decided the verdict, in a few words: the dimensions significantly better and worse
    with their differences, the overall against the margin where it decided, a dimension missing."""
    dimensions, margin = comparison["dimensions"], comparison["margin"]
    missing = [name for name in champion_dimensions if name not in dimensions]
    overall = f"overall {short_interval(comparison['overall'], comparison['overall_ci95'])}"
    if verdict.reasons and verdict.reasons[0].startswith("no shared items"):
        return verdict.reasons[0]
    if comparison["overall_p_value"] is None:
        words = [f"not evaluated on {', '.join(missing)}"] if missing else []
        return ", ".join([*words, f"{overall}, too few shared items to decide"])
    corrected = corrected_p_values(comparison)

    def listed(names: list[str]) -> str:
        intervals = {name: short_interval(dimensions[name]["difference"], dimensions[name]["ci95"])
                     for name in names}
        return ", ".join(f"{name} ({interval})" for name, interval in intervals.items())

    better, worse = better_dimensions(dimensions, corrected), worse_dimensions(dimensions, corrected)
    words = [f"not evaluated on {', '.join(missing)}"] if missing else []
    if corrected[OVERALL] <= ALPHA:
        side = "above" if comparison["overall"] >= margin else "below"
        words.append(f"{overall}, {side} the margin {margin:g}")
    if better:
        words.append(f"better on {listed(better)}")
    if worse:
        words.append(f"worse on {listed(worse)}")
    elif verdict.outcome == PROMOTED:
        words.append("no dimension worse")
    if not words:
        words.append(f"{overall}; no dimension decided" if not identical(comparison)
                     else f"{overall}, identical on every shared item")
    return ", ".join(words)


def decided(cfg: Config, client: MlflowClient, candidate: ModelVersion, champion: ModelVersion | None,
            force: bool) -> tuple[Decision, dict[str, str]]:
    """The decision on `candidate` against `champion` (None: there is none, and the candidate
    faces its base if it has one) and its evidence."""
    if force:
        faced = None if champion is None else ChampionVersion(str(champion.version))
        return Decision(candidate.name, str(candidate.version), faced, PROMOTED, forced=True), {}
    if champion is None:
        return decide_without_champion(cfg, client, candidate)
    return decide(cfg, client, candidate, champion)


def recorded_decision(version: ModelVersion) -> str | None:
    """The gate's decision recorded on `version`, in words; None if the gate has not decided on it."""
    tag = version.tags.get(DECISION_TAG)
    return None if tag is None else f"{version.name} version {version.version} was decided on before: {tag}"


def promote(cfg: Config, client: MlflowClient, version: str, force: bool = False) -> Decision:
    """Move `champion` to `version` of `registry.model_name` if the gate passes (or `force`), and
    record the decision and its evidence as version tags, as one step under the promotion lock:
    the champion the decision was made against is still the champion when it is recorded (else
    the gate decides again). A version whose registration is incomplete is refused
    (pretrained.IncompleteRegistration): it never becomes champion."""
    name = cfg.registry.model_name
    candidate = check_complete(client.get_model_version(name, version), client.tracking_uri)
    while True:
        champion = current_champion(client, name)
        if version_of(champion) == str(candidate.version):
            return already_champion(client, champion)
        decision, evidence = decided(cfg, client, candidate, champion, force)
        with promotion_lock(client, name) as lease:
            now = version_of(current_champion(client, name))
            if now == decision.champion_before:
                record(client, candidate, decision, evidence, lease)
                log.info("%s", decision.describe())
                return decision
        log.info("@%s moved from %s to %s while the gate decided on %s version %s: deciding again "
                 "against it", CHAMPION_ALIAS, aliased_to(decision.champion_before), aliased_to(now), name,
                 candidate.version)


def aliased_to(number: str | None) -> str:
    return "no version" if number is None else f"version {number}"


def record(client: MlflowClient, candidate: ModelVersion, decision: Decision, evidence: dict[str, str],
           lease: Lease) -> None:
    """The decision's tags -- the decision last, after its evidence -- and, if promoted, the alias
    move. The decision of a promotion is pending until the alias has moved."""
    name, number = decision.model_name, decision.version
    tags = {**evidence, PENDING_TAG if decision.promoted else DECISION_TAG: decision.record()}
    for key, value in tags.items():
        lease.check()
        client.set_model_version_tag(name, number, key, value[:5000])
    if decision.promoted:
        lease.check()
        client.set_registered_model_alias(name, CHAMPION_ALIAS, number)
        client.set_model_version_tag(name, number, DECISION_TAG, decision.record()[:5000])
    client.update_model_version(name, number, description=decision.one_line())
    if decision.promoted or PENDING_TAG in candidate.tags:  # done, or left by an attempt that died
        client.delete_model_version_tag(name, number, PENDING_TAG)


def already_champion(client: MlflowClient, champion: ModelVersion) -> Decision:
    """The decision on the champion itself: nothing to decide. Its promotion's pending decision is
    recorded if the process that moved the alias died before it could."""
    number = str(champion.version)
    if PENDING_TAG in champion.tags:
        client.set_model_version_tag(champion.name, number, DECISION_TAG, champion.tags[PENDING_TAG])
        client.delete_model_version_tag(champion.name, number, PENDING_TAG)
    return Decision(champion.name, number, ChampionVersion(number), PROMOTED)


# The promotion lock: a registered model NAME.promotion-lock exists while a process records a
# decision on NAME. Creating a registered model whose name exists fails (RESOURCE_ALREADY_EXISTS) in
# a database store and a tracking server alike -- a unique key of the registry's database -- so
# exactly one creator holds it. It carries its holder and the end of its lease (unix time), set in
# the same call. The holder writes only within the first half of its lease (Lease.check before each
# write), which leaves the other half for a write that has started to land (MLflow's requests
# give up after ~95 s with forgeline's bounded waits; configs/environment.py). A lock whose lease
# ended was left by a holder that died or lost the registry: a waiter breaks it by renaming it to
# NAME.promotion-lock.expired-<holder's token>. That name is unique per holder, so of two waiters
# that found the same expired lock one renames it and the other fails; and it stays a lease
# longer, so a waiter that read the expired lock cannot, within the lease, rename the next
# holder's lock in its stead. Clocks of the hosts are assumed to agree to well within the lease.
LOCK_SUFFIX = ".promotion-lock"
LOCK_HOLDER_TAG = "forgeline.lock.holder"  # "<host> pid <pid> token <token>"
LOCK_EXPIRES_TAG = "forgeline.lock.expires"  # unix time at which the lease ends
LOCK_LEASE_S = 300.0
LOCK_WAIT_S = 2 * LOCK_LEASE_S + 60  # a waiter outlasts an expiring lease and a holder after it
LOCK_POLL_S = 0.5


class PromotionLockError(RuntimeError):
    """The promotion lock could not be taken, or its lease ran out before the decision was
    recorded; nothing was decided."""


@dataclass(frozen=True)
class Lease:
    lock: str
    token: str
    write_until: float  # time.monotonic(): half the lease after it was taken

    def check(self) -> None:
        if time.monotonic() > self.write_until:
            raise PromotionLockError(
                f"the promotion lock {self.lock} was held for more than half its lease "
                f"({LOCK_LEASE_S / 2:g} s) before the decision was recorded (a registry that answers "
                "slowly): it was not recorded, so that no other process can act on the same champion at "
                "once. Run it again")


@dataclass(frozen=True)
class LockHolder:
    description: str
    token: str
    expires: float

    @classmethod
    def of(cls, lock: RegisteredModel) -> LockHolder:
        holder = lock.tags.get(LOCK_HOLDER_TAG, "unknown")
        try:
            expires = float(lock.tags.get(LOCK_EXPIRES_TAG, "0"))
        except ValueError:
            expires = 0.0  # not a lock forgeline took: it protects nothing
        return cls(holder, holder.rpartition(" token ")[2], expires)


@contextmanager
def promotion_lock(client: MlflowClient, model_name: str) -> Iterator[Lease]:
    """Held by one process at a time, across hosts, for the registry at `client`."""
    lease = acquire(client, model_name + LOCK_SUFFIX)
    try:
        remove_expired_tombstones(client, lease.lock)
        yield lease
    finally:
        release(client, lease)


def acquire(client: MlflowClient, lock: str) -> Lease:
    waited_until = time.monotonic() + LOCK_WAIT_S
    while True:
        token = uuid.uuid4().hex
        taken = time.monotonic()
        holder = f"{socket.gethostname()} pid {os.getpid()} token {token}"
        try:
            client.create_registered_model(lock, tags={LOCK_HOLDER_TAG: holder,
                                                       LOCK_EXPIRES_TAG: f"{time.time() + LOCK_LEASE_S:.3f}"},
                                           description="forgeline's promotion lock (tasks/promote.py)")
            return Lease(lock, token, taken + LOCK_LEASE_S / 2)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        found = lock_holder(client, lock)
        if found is None:
            continue  # released meanwhile
        if found.token == token:  # our create landed, its answer did not (a retried request)
            return Lease(lock, token, taken + LOCK_LEASE_S / 2)
        if found.expires < time.time():
            break_lock(client, lock, found)
            continue
        if time.monotonic() > waited_until:
            raise PromotionLockError(
                f"the promotion lock {lock} in the registry at {client.tracking_uri} is held by "
                f"{found.description} until {time.ctime(found.expires)}, and was held for the last "
                f"{LOCK_WAIT_S:g} s: if no process is promoting, delete that registered model; then run "
                "it again")
        log.info("waiting for the promotion lock %s, held by %s", lock, found.description)
        time.sleep(LOCK_POLL_S)


def lock_holder(client: MlflowClient, lock: str) -> LockHolder | None:
    try:
        return LockHolder.of(client.get_registered_model(lock))
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def tombstone_of(lock: str, token: str) -> str:
    return f"{lock}.expired-{token}"


def break_lock(client: MlflowClient, lock: str, holder: LockHolder) -> None:
    """Remove the expired lock of `holder`, unless another waiter did (see LOCK_SUFFIX)."""
    try:
        client.rename_registered_model(lock, tombstone_of(lock, holder.token))
    except MlflowException as err:
        if err.error_code in ("RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST"):
            return  # another waiter broke it first
        raise
    log.warning("broke the promotion lock %s: the lease of %s ended at %s", lock, holder.description,
                time.ctime(holder.expires))


def remove_expired_tombstones(client: MlflowClient, lock: str) -> None:
    """The broken locks whose lease ended more than a lease ago: no waiter can still act on them."""
    for model in client.search_registered_models(f"name LIKE '{tombstone_of(lock, '')}%'"):
        if model.name.startswith(tombstone_of(lock, "")) and \
                LockHolder.of(model).expires + LOCK_LEASE_S < time.time():
            try:
                client.delete_registered_model(model.name)
            except MlflowException as err:
                if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise


def release(client: MlflowClient, lease: Lease) -> None:
    """Delete the lock while it is surely ours (in the first half of its lease); later, or when the
    registry does not answer, it is left to expire."""
    if time.monotonic() > lease.write_until:
        return
    try:
        client.delete_registered_model(lease.lock)
    except MlflowException as err:
        log.warning("could not release the promotion lock %s (%s): it expires in %g s", lease.lock,
                    str(err).splitlines()[0][:300], LOCK_LEASE_S)
