"""Preference pairs for tests: a few pairs rendered through a ChatML template, packed into rows as
the data stage packs them (model/training/shards.py: a pair's chosen sequence, then its rejected
one, the loss mask 1 and 2 on their replies), and the same pairs as TRL's DPOTrainer takes them
(prompt, chosen and rejected token ids: the completion is exactly the tokens forgeline trains)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from forgeline.model.training.loader import DocumentBatch
from forgeline.model.training.preference import CHOSEN, REJECTED
from forgeline.tasks.data.chat import render

PAIRS = [
    ("Write a haiku about rain.", "soft rain on the roof", "Rain! It is raining a lot today, I think, yes."),
    ("Answer in one word: the sea?", "Blue.", "The sea is very large and it is blue and deep."),
    ("Say hello without commas.", "hello there friend", "Hello, there, friend, hello."),
    ("List two colours.", "red and green", "I like colours. Red, maybe green, or blue."),
    ("Reply in lowercase: the sky?", "it is blue", "THE SKY IS BLUE AND WIDE"),
    ("Use no commas: your name?", "my name is bot", "My name, dear user, is Bot."),
]


@dataclass(frozen=True)
class RenderedPair:
    chosen: np.ndarray  # the prompt and the chosen reply's token ids
    chosen_mask: np.ndarray  # 1 on the reply's trained tokens
    rejected: np.ndarray
    rejected_mask: np.ndarray

    def trl_example(self) -> dict[str, list[int]]:
        """TRL's tokenized example: the prompt (the tokens before the reply) and each reply's
        trained tokens -- the reply and its end-of-turn token, not what the template writes after."""
        start = int(np.argmax(self.chosen_mask))
        assert start == int(np.argmax(self.rejected_mask))
        assert np.array_equal(self.chosen[:start], self.rejected[:start])
        return {"prompt_ids": self.chosen[:start].tolist(),
                "chosen_ids": self.chosen[start:start + int(self.chosen_mask.sum())].tolist(),
                "rejected_ids": self.rejected[start:start + int(self.rejected_mask.sum())].tolist()}


def rendered_pairs(tokenizer: PreTrainedTokenizerBase, pairs: list[tuple[str, str, str]] = PAIRS,
                   ) -> list[RenderedPair]:
    out = []
    for prompt, chosen, rejected in pairs:
        sides = [render(tokenizer, [{"role": "user", "content": prompt},
                                    {"role": "assistant", "content": reply}], train_on="last_assistant")
                 for reply in (chosen, rejected)]
        out.append(RenderedPair(sides[0].ids, sides[0].mask, sides[1].ids, sides[1].mask))
    return out


def packed_rows(pairs: list[RenderedPair], row_tokens: int, pad_id: int) -> DocumentBatch:
    """The pairs packed into rows of `row_tokens`, each pair whole, in order (the data stage's
    rule), with their documents, loss masks and sides."""
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    for pair in pairs:
        pieces = [(pair.chosen, pair.chosen_mask * CHOSEN), (pair.rejected, pair.rejected_mask * REJECTED)]
        if sum(len(ids) for ids, _ in rows[-1] + pieces) > row_tokens:
            rows.append([])
        rows[-1] += pieces
    tokens = np.full((len(rows), row_tokens), pad_id, np.int64)
    documents = np.zeros((len(rows), row_tokens), np.int32)
    sides = np.zeros((len(rows), row_tokens), np.uint8)
    for r, row in enumerate(rows):
        at = 0
        for number, (ids, mask) in enumerate(row):
            tokens[r, at:at + len(ids)] = ids
            sides[r, at:at + len(ids)] = mask
            sides[r, at] = 0  # nothing in its own sequence predicts a sequence's first token
            documents[r, at:] = number + 1
            at += len(ids)
    sides_t = torch.from_numpy(sides)
    return DocumentBatch(torch.from_numpy(tokens), torch.from_numpy(documents), sides_t > 0, sides_t)
