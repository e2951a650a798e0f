"""Replies checked by lm-eval's IFEval instruction registry and paired.

A reply is checked as IFEval's prompt-level strict accuracy checks it (lm-eval's own
`test_instruction_following_strict`: each constraint rebuilt from its id and arguments, an empty
reply following none): it follows its prompt when it follows every constraint. Of a prompt's
replies, those that ended their turn within the token budget are paired, the i-th following one
with the i-th failing one in sample order, so that no reply is in two pairs; a reply cut off at
the budget is in none (as a chosen reply it would teach stopping mid-sentence, as a rejected one
it would teach against ending the turn where it never ended). A prompt without both a following
and a failing reply is dropped, by reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The IFEval hook first: NLTK then finds the packaged punkt, which lm-eval's IFEval modules
# download as they are imported otherwise.
# isort: off
from forgeline.eval.tasks import forgeline_ifeval  # noqa: F401
from lm_eval.tasks.ifeval import instructions_registry
from lm_eval.tasks.ifeval import utils as ifeval
# isort: on

INSTRUCTIONS = instructions_registry.INSTRUCTION_DICT
CONFLICTS = instructions_registry.INSTRUCTION_CONFLICTS
# Why a prompt gave no pair: every finished reply followed it, none did, or none finished.
ALL_PASS, ALL_FAIL, ALL_TRUNCATED = "all_pass", "all_fail", "all_truncated"
DROP_REASONS = (ALL_PASS, ALL_FAIL, ALL_TRUNCATED)


@dataclass(frozen=True)
class Prompt:
    """A user turn with verifiable constraints, as IFEval's records hold them."""

    text: str
    instruction_ids: list[str]
    kwargs: list[dict[str, Any]]
    """Each constraint's arguments (the registry's get_instruction_args; {} for none)."""
    source: str
    """Where its task came from."""


@dataclass(frozen=True)
class Reply:
    text: str
    truncated: bool
    """It reached the token budget without ending its turn."""
    followed: list[bool]
    """Per constraint of its prompt, in order."""

    @property
    def follows_all(self) -> bool:
        return all(self.followed)


def followed(prompt: Prompt, text: str) -> list[bool]:
    """Whether `text` follows each of the prompt's constraints, by the registry's checkers."""
    example = ifeval.InputExample(key=0, instruction_id_list=prompt.instruction_ids, prompt=prompt.text,
                                  kwargs=prompt.kwargs)
    return ifeval.test_instruction_following_strict(example, text).follow_instruction_list


def checked(prompt: Prompt, text: str, truncated: bool) -> Reply:
    return Reply(text, truncated, followed(prompt, text))


def pairs_of(prompt: Prompt, replies: list[Reply], most: int) -> tuple[list[dict[str, Any]], str | None]:
    """Up to `most` pair records of the prompt's replies, and why there is none (None: there are)."""
    finished = [reply for reply in replies if not reply.truncated]
    passing = [reply for reply in finished if reply.follows_all]
    failing = [reply for reply in finished if not reply.follows_all]
    if not finished:
        return [], ALL_TRUNCATED
    if not failing:
        return [], ALL_PASS
    if not passing:
        return [], ALL_FAIL
    matched = zip(passing, failing, strict=False)  # as many pairs as the fewer of the two
    return [pair_record(prompt, chosen, rejected) for chosen, rejected in matched][:most], None


def pair_record(prompt: Prompt, chosen: Reply, rejected: Reply) -> dict[str, Any]:
    """A line of pairs.jsonl: the `preference` format the data stage reads (kind: pairs)."""
    return {"prompt": [{"role": "user", "content": prompt.text}],
            "chosen": [{"role": "assistant", "content": chosen.text}],
            "rejected": [{"role": "assistant", "content": rejected.text}],
            "instruction_ids": prompt.instruction_ids, "kwargs": prompt.kwargs, "source": prompt.source}
