"""Eval-gated promotion: alias `champion` moves to a model version only when its eval scores
beat the current champion's by the configured margin without any dimension regressing too far.

Scores are read from the version tags the register stage writes (`eval.overall`,
`eval.dimension/<name>`), so a decision needs nothing but the registry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from forgeline.configs.schema import RegistryConfig

log = logging.getLogger(__name__)

CHAMPION_ALIAS = "champion"
OVERALL_TAG = "eval.overall"
DIMENSION_TAG_PREFIX = "eval.dimension/"
DECISION_TAG = "forgeline.promotion"


@dataclass(frozen=True)
class Scores:
    overall: float
    dimensions: dict[str, float]

    @classmethod
    def of(cls, version: ModelVersion) -> Scores:
        if OVERALL_TAG not in version.tags:
            raise ValueError(f"model version {version.name}/{version.version} has no {OVERALL_TAG} tag: "
                             "it was not registered by the register stage after an eval")
        dimensions = {key.removeprefix(DIMENSION_TAG_PREFIX): float(value)
                      for key, value in version.tags.items() if key.startswith(DIMENSION_TAG_PREFIX)}
        return cls(float(version.tags[OVERALL_TAG]), dimensions)


@dataclass(frozen=True)
class Decision:
    model_name: str
    version: str
    champion_before: str | None
    promoted: bool
    reasons: list[str]  # why the gate failed; empty when it passed

    def describe(self) -> str:
        if self.promoted and self.champion_before == self.version:
            return f"{self.model_name} version {self.version} is already @{CHAMPION_ALIAS}"
        if self.promoted:
            before = f"replacing version {self.champion_before}" if self.champion_before else "first champion"
            return f"{self.model_name} version {self.version} is now @{CHAMPION_ALIAS} ({before})"
        return (f"{self.model_name} version {self.version} stays behind @{CHAMPION_ALIAS} "
                f"(version {self.champion_before}): {'; '.join(self.reasons)}")


def gate(candidate: Scores, champion: Scores, margin: float, max_regression: float) -> list[str]:
    """Why `candidate` may not replace `champion` (empty: it may). A dimension the champion was
    not scored on cannot regress."""
    reasons = []
    needed = champion.overall + margin
    if candidate.overall < needed:
        reasons.append(f"overall {candidate.overall:.4f} < champion {champion.overall:.4f} + margin "
                       f"{margin:g} = {needed:.4f}")
    for name, before in sorted(champion.dimensions.items()):
        after = candidate.dimensions.get(name)
        if after is None:
            reasons.append(f"dimension {name} was not evaluated (champion: {before:.4f})")
        elif before - after > max_regression:
            reasons.append(f"dimension {name} fell {before - after:.4f} ({before:.4f} -> {after:.4f}), "
                           f"more than {max_regression:g}")
    return reasons


def current_champion(client: MlflowClient, model_name: str) -> ModelVersion | None:
    try:
        return client.get_model_version_by_alias(model_name, CHAMPION_ALIAS)
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST" or "alias" in str(err).lower():
            return None
        raise


def promote(client: MlflowClient, rcfg: RegistryConfig, version: str, force: bool = False) -> Decision:
    """Move `champion` to `version` of `rcfg.model_name` if the gate passes (or `force`), and
    record the decision as a version tag."""
    name = rcfg.model_name
    candidate = client.get_model_version(name, version)
    champion = current_champion(client, name)
    before = champion.version if champion else None
    if champion is None or champion.version == candidate.version or force:
        reasons = []
    else:
        reasons = gate(Scores.of(candidate), Scores.of(champion), rcfg.promotion_margin,
                       rcfg.max_dimension_regression)
    decision = Decision(name, str(candidate.version), before and str(before), not reasons, reasons)
    if decision.promoted:
        client.set_registered_model_alias(name, CHAMPION_ALIAS, decision.version)
        tag = "forced" if force and champion is not None else "promoted"
    else:
        tag = "rejected: " + "; ".join(reasons)
    client.set_model_version_tag(name, decision.version, DECISION_TAG, tag[:5000])
    log.info("%s", decision.describe())
    return decision
