"""Replies checked by lm-eval's IFEval registry as IFEval's prompt-level strict accuracy checks
them, and paired: a reply that follows every constraint with one that does not, in sample order,
each reply in one pair at most, replies cut off at the token budget in none."""

from __future__ import annotations

from forgeline.eval.suite import ifeval_rows
from forgeline.tasks.pairs.checks import (
    ALL_FAIL,
    ALL_PASS,
    ALL_TRUNCATED,
    Prompt,
    checked,
    followed,
    pairs_of,
)
from forgeline.tasks.pairs.prompts import global_random_seeded

NO_COMMA_WITH_TEA = Prompt(text='Write a reply to this message: "Tea or coffee?" Do not use any commas. '
                                "Include keywords ['tea'] in the response.",
                           instruction_ids=["punctuation:no_comma", "keywords:existence"],
                           kwargs=[{}, {"keywords": ["tea"]}], source="test")


def replies(*texts: str, truncated: tuple[int, ...] = ()) -> list:
    return [checked(NO_COMMA_WITH_TEA, text, i in truncated) for i, text in enumerate(texts)]


def test_each_constraint_is_checked_by_the_registry_and_an_empty_reply_follows_none() -> None:
    assert followed(NO_COMMA_WITH_TEA, "I drink tea every morning.") == [True, True]
    assert followed(NO_COMMA_WITH_TEA, "Tea, always.") == [False, True]
    assert followed(NO_COMMA_WITH_TEA, "Coffee please") == [True, False]
    assert followed(NO_COMMA_WITH_TEA, "  ") == [False, False]


def test_a_reply_follows_its_prompt_as_ifevals_prompt_level_strict_accuracy_counts() -> None:
    from lm_eval.tasks.ifeval.utils import process_results  # lm-eval's scoring of an IFEval item

    for row in ifeval_rows()[:40]:
        prompt = Prompt(row["prompt"], row["instruction_id_list"], row["kwargs"], "ifeval")
        for reply in ("Sure.", row["prompt"], row["prompt"].lower() + " P.S. done", "<<title>>\n\nsome text"):
            # The same state of `random` for both: some of IFEval's own items draw as they are
            # checked (letter_frequency of "!", not a letter: a random letter is counted instead).
            with global_random_seeded(0):
                scores = process_results(row, [reply])
            with global_random_seeded(0):
                assert checked(prompt, reply, False).follows_all == scores["prompt_level_strict_acc"]
            with global_random_seeded(0):
                assert followed(prompt, reply) == scores["inst_level_strict_acc"]


def test_the_first_following_reply_pairs_with_the_first_failing_one() -> None:
    sampled = replies("Coffee please", "I like tea.", "Tea, of course.", "Green tea is nice.")
    [pair], reason = pairs_of(NO_COMMA_WITH_TEA, sampled, most=1)
    assert reason is None
    assert pair == {"prompt": [{"role": "user", "content": NO_COMMA_WITH_TEA.text}],
                    "chosen": [{"role": "assistant", "content": "I like tea."}],
                    "rejected": [{"role": "assistant", "content": "Coffee please"}],
                    "instruction_ids": ["punctuation:no_comma", "keywords:existence"],
                    "kwargs": [{}, {"keywords": ["tea"]}], "source": "test"}


def test_more_pairs_match_the_ith_following_with_the_ith_failing_reply_each_in_one_pair() -> None:
    sampled = replies("Coffee please", "I like tea.", "Tea, of course.", "Green tea is nice.", "")
    pairs, _ = pairs_of(NO_COMMA_WITH_TEA, sampled, most=5)
    assert [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == [
        ("I like tea.", "Coffee please"), ("Green tea is nice.", "Tea, of course.")]


def test_a_reply_cut_off_at_the_budget_is_in_no_pair() -> None:
    sampled = replies("I like tea.", "Coffee please", "Tea is fine.", truncated=(0,))
    [pair], _ = pairs_of(NO_COMMA_WITH_TEA, sampled, most=1)
    assert pair["chosen"][0]["content"] == "Tea is fine."
    # The only following reply was cut off: among those that ended, none follows.
    cut_off = replies("I like tea.", "Coffee please", truncated=(0,))
    assert pairs_of(NO_COMMA_WITH_TEA, cut_off, 1) == ([], ALL_FAIL)


def test_prompts_without_both_kinds_of_reply_are_dropped_by_reason() -> None:
    assert pairs_of(NO_COMMA_WITH_TEA, replies("Tea.", "More tea."), 1) == ([], ALL_PASS)
    assert pairs_of(NO_COMMA_WITH_TEA, replies("Coffee.", "Tea, tea."), 1) == ([], ALL_FAIL)
    assert pairs_of(NO_COMMA_WITH_TEA, replies("Tea.", "Coffee", truncated=(0, 1)), 1) == ([], ALL_TRUNCATED)
