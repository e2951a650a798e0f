"""The register stage's Prefect artifact: the version it registered, where the aliases point now
and what moved, and the promotion gate's decision with the per-dimension intervals against the
champion it faced (with none, its base) -- read back from the registry, where the gate recorded
them as the version's tags and description (tasks/promote.py)."""

from __future__ import annotations

import json
import re

from mlflow import MlflowClient

from forgeline.configs import Config
from forgeline.tasks.promote import CHAMPION_ALIAS, DECISION_TAG, EVIDENCE_TAG, EVIDENCE_TAG_PREFIX
from forgeline.tasks.register import CANDIDATE_ALIAS, RegisterResult
from forgeline.tasks.tracking import resolve_tracking_uri

DIMENSION = "dimension/"


def registration_markdown(cfg: Config, result: RegisterResult) -> str:
    """The version, its aliases, the decision and its evidence, as Markdown."""
    uri = resolve_tracking_uri(cfg)
    client = MlflowClient(uri, uri)
    version = client.get_model_version(result.model_name, result.version)
    aliases = client.get_registered_model(result.model_name).aliases  # alias -> version
    tags = version.tags
    decision = tags.get(DECISION_TAG, "")
    outcome = decision.partition(":")[0] or "undecided"
    # A tag each, as versions decided before EVIDENCE_TAG held the rest have them, and EVIDENCE_TAG's.
    evidence = {key.removeprefix(EVIDENCE_TAG_PREFIX): value for key, value in tags.items()
                if key.startswith(EVIDENCE_TAG_PREFIX) and key != EVIDENCE_TAG}
    evidence |= json.loads(tags.get(EVIDENCE_TAG, "{}"))
    champion = None if CHAMPION_ALIAS not in aliases else str(aliases[CHAMPION_ALIAS])
    now = ", ".join(f"@{name} -> v{number}" for name, number in sorted(aliases.items()))
    lines = [f"## {result.model_name} version {result.version}: {outcome}", "",
             f"- registered from MLflow run `{result.run_id}` as `{result.model_uri}`",
             f"- decision: {version.description or decision or result.promotion}",
             f"- aliases now: {now}",
             f"- alias moves: {alias_moves(result, decision, champion)}"]
    if evidence:
        lines += ["", f"Candidate minus {faced(evidence.get('versus'))}, with the 95 % interval, on "
                      f"{evidence.get('shared_items', '?')} shared items:", "",
                  "| | difference [95 % interval] |", "|---|---|",
                  f"| **overall** | {evidence.get('overall', '')} |"]
        lines += [f"| {key.removeprefix(DIMENSION)} | {value} |" for key, value in evidence.items()
                  if key.startswith(DIMENSION)]
        for key, label in (("p_values", "p-values"), ("resolution", "what would decide it")):
            if key in evidence:
                lines += ["", f"{label}: {evidence[key]}"]
    lines += ["", f"The gate's record: {decision or result.promotion}"]
    return "\n".join(lines) + "\n"


def faced(versus: str | None) -> str:
    """What the evidence's `versus` tag says the candidate faced: `champion (version 1)`, or
    `its base URI` while the line had no champion."""
    if versus is None:
        return "the champion"
    return f"champion ({versus})" if versus.startswith("version ") else versus


def alias_moves(result: RegisterResult, decision: str, champion: str | None) -> str:
    """What this registration did to the aliases, as far as the version's record tells."""
    moves = [f"@{CANDIDATE_ALIAS} -> v{result.version}"]
    if "decided on before" in result.promotion:
        return f"none by this run: v{result.version} was registered and decided on before"
    before = re.match(r"promoted: (?:versus|forced over) version (\d+)", decision)
    if decision.startswith("promoted") and champion == str(result.version):
        moves.append(f"@{CHAMPION_ALIAS} -> v{result.version}"
                     + (f" (from v{before[1]})" if before else " (no champion before)"))
    elif champion is not None:
        moves.append(f"@{CHAMPION_ALIAS} stays at v{champion}")
    return ", ".join(moves)
