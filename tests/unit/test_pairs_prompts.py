"""The pairs stage's prompts: writing tasks from the packaged conversations with constraints drawn
from lm-eval's IFEval registry (trained types only, no conflicting two, reproducible by seed), and
IFEval's own prompts excluded by overlap and counted."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from forgeline.configs import ConfigError
from forgeline.configs.schema import IFEVAL_INSTRUCTION_TYPES, PairsConfig
from forgeline.eval.suite import ifeval_rows
from forgeline.tasks.data.sources import CHATTERBOT_EXCLUDED
from forgeline.tasks.pairs.checks import CONFLICTS, INSTRUCTIONS
from forgeline.tasks.pairs.prompts import (
    FRAMING,
    REPEAT_PROMPT,
    Overlap,
    Task,
    asks_something,
    candidate_tasks,
    make_prompts,
    prompts_apart_from_ifeval,
    words,
)
from tests.conftest import debug_config

TRAINED = ["punctuation:no_comma", "detectable_format:title", "keywords:existence",
           "change_case:english_lowercase", "change_case:english_capital",
           "detectable_format:constrained_response", REPEAT_PROMPT,
           "length_constraints:number_paragraphs", "length_constraints:nth_paragraph_first_word"]
TASKS = [Task(f"What would you do with {n} free afternoons in a row?", f"test {n}") for n in range(300)]


def test_the_configs_instruction_types_are_lm_evals_registry() -> None:
    assert IFEVAL_INSTRUCTION_TYPES == tuple(INSTRUCTIONS)


def test_unknown_or_repeated_instruction_types_are_refused_naming_the_registrys(tmp_path: Path) -> None:
    pairs = ["preference.beta=0.1", "model.init_from=base-dir", "data.sources=[{kind: pairs}]"]
    with pytest.raises(ConfigError, match=r"\['punctuation:no_comas'\] are not IFEval instruction types; "
                                          r"lm-eval's registry has keywords:existence, .*no_comma"):
        debug_config(tmp_path, *pairs, "pairs.instruction_types=[punctuation:no_comas]")
    with pytest.raises(ConfigError, match="named twice"):
        debug_config(tmp_path, *pairs, "pairs.instruction_types=[punctuation:no_comma, punctuation:no_comma]")
    cfg = debug_config(tmp_path, *pairs, "pairs.instruction_types=[punctuation:no_comma]")
    assert cfg.pairs.held_out_types == [t for t in IFEVAL_INSTRUCTION_TYPES if t != "punctuation:no_comma"]


def test_constraints_are_the_registrys_of_the_trained_types_described_by_its_own_classes() -> None:
    prompts = make_prompts(TASKS, TRAINED, 200, 3, seed=0)
    assert {len(prompt.instruction_ids) for prompt in prompts} == {1, 2, 3}
    assert {name for prompt in prompts for name in prompt.instruction_ids} == set(TRAINED)
    for prompt in prompts:
        assert len(set(prompt.instruction_ids)) == len(prompt.instruction_ids)
        framed = FRAMING.format(TASKS[int(prompt.source.split()[1])].message)
        assert prompt.text.startswith(framed)
        # Each constraint's description is what the registry's class writes for its recorded
        # arguments -- as its checker rebuilds it (a paragraph past the last is drawn again).
        rebuilt = [INSTRUCTIONS[name](name).build_description(**kwargs)
                   for name, kwargs in zip(prompt.instruction_ids, prompt.kwargs, strict=True)]
        assert prompt.text == " ".join([framed, *rebuilt])
        if REPEAT_PROMPT in prompt.instruction_ids:  # last: the reply repeats everything before it
            assert prompt.instruction_ids[-1] == REPEAT_PROMPT
            assert prompt.text.startswith(prompt.kwargs[-1]["prompt_to_repeat"] + " First repeat the request")


def test_no_prompt_has_two_constraints_the_registry_says_conflict() -> None:
    prompts = make_prompts(TASKS, TRAINED, 300, 3, seed=1)
    for prompt in prompts:
        for first, second in itertools.combinations(prompt.instruction_ids, 2):
            assert second not in CONFLICTS[first] and first not in CONFLICTS[second], prompt.instruction_ids
    # constrained_response conflicts with every type: it is always alone.
    alone = "detectable_format:constrained_response"
    with_it = [p.instruction_ids for p in prompts if alone in p.instruction_ids]
    assert with_it and all(ids == [alone] for ids in with_it)


def test_prompts_are_reproducible_by_seed_and_leave_the_random_module_as_it_was() -> None:
    random.seed(123)
    state = random.getstate()
    first = make_prompts(TASKS, TRAINED, 50, 3, seed=7)
    assert random.getstate() == state  # lm-eval's classes drew from it, seeded, and it was restored
    random.random()  # another state of the module: the prompts do not depend on it
    assert make_prompts(TASKS, TRAINED, 50, 3, seed=7) == first
    other = make_prompts(TASKS, TRAINED, 50, 3, seed=8)
    assert [p.text for p in other] != [p.text for p in first]


def test_an_ifeval_prompt_among_the_candidates_is_excluded_and_counted() -> None:
    ifeval = ifeval_rows()[1]["prompt"]  # one of IFEval's 541, verbatim
    # A task that copies a run of eight of its words, and one sharing only seven.
    copied = f"Hey, {' '.join(words(ifeval)[2:10])} -- have you heard?"
    near = f"Hey, {' '.join(words(ifeval)[2:9])} -- have you heard?"
    candidates = [*TASKS[:20], Task(ifeval, "ifeval"), Task(copied, "copied"), Task(near, "near")]
    pcfg = PairsConfig(instruction_types=TRAINED, num_prompts=21)
    prompts, account = prompts_apart_from_ifeval(candidates, pcfg)
    assert account["excluded_ifeval_overlap"] == 2 and account["candidates"] == 23 and account["made"] == 21
    assert {prompt.source for prompt in prompts} == {task.source for task in TASKS[:20]} | {"near"}
    with pytest.raises(ValueError, match=r"pairs.num_prompts=22, but there are 21 tasks"):
        prompts_apart_from_ifeval(candidates, PairsConfig(instruction_types=TRAINED, num_prompts=22))


def test_overlap_is_a_run_of_eight_words_or_the_whole_of_a_shorter_text() -> None:
    overlap = Overlap(["Write a letter to a friend in all lowercase letters, asking them to go vote."])
    assert "please WRITE a letter to a friend in all LOWERCASE!" in overlap  # case and punctuation aside
    assert "a letter to a friend in all caps" not in overlap  # seven words in a row
    assert "Asking them to go vote?" in overlap  # shorter than eight: all of it
    assert "asking them to vote?" not in overlap


def test_candidates_are_asking_turns_and_topics_of_the_packaged_conversations() -> None:
    candidates = candidate_tasks()
    assert len(candidates) > 10_000
    assert len({task.message.lower() for task in candidates}) == len(candidates)
    assert all(asks_something(task.message) for task in candidates)
    kinds = {task.source.split()[0] for task in candidates}
    assert kinds == {"chitchat", "chatterbot"}
    assert any(task.source == "chitchat topic" for task in candidates)
    chatterbot_files = {task.source.split()[1].split("#")[0] for task in candidates
                        if task.source.startswith("chatterbot")}
    assert chatterbot_files and not chatterbot_files & CHATTERBOT_EXCLUDED
    assert not asks_something("hi is anyone there??")  # a greeting, not a task
