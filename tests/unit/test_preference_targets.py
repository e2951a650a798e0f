"""Which tokens of packed preference pairs form which pair (model/training/preference.py)."""

from __future__ import annotations

import torch

from forgeline.model.training.preference import PAIR, SIDE, pair_count, preference_targets

# One row, (T + 1) = 16 tokens, two pairs: the first pair's chosen reply is two assistant turns
# with an untrained user turn between them (mask 1 1 0 0 1), its rejected one a single turn; the
# second pair's rejected reply is the two-turn one.
SIDES = torch.tensor([[0, 1, 1, 0, 0, 1, 0, 2, 2, 0, 1, 0, 2, 0, 0, 2]])
STARTS = [0, 6, 9, 11]  # four documents: chosen, rejected, chosen, rejected
DOCUMENTS = torch.tensor([[sum(start <= t for start in STARTS) - 1 for t in range(16)]])


def test_a_reply_of_several_trained_turns_is_one_reply_of_its_pair() -> None:
    """Counted per masked stretch, the first pair's chosen reply was two replies: the row held
    3 chosen and 3 rejected, and the pairs were numbered across each other (failed before)."""
    targets = preference_targets(torch.arange(16)[None], DOCUMENTS, SIDES, None)
    side, pair = targets[0, :, SIDE].long(), targets[0, :, PAIR].long()
    masked = side > 0
    assert pair[masked].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]  # the first pair's 5 targets, the second's 3
    assert side[masked].tolist() == [1, 1, 1, 2, 2, 1, 2, 2]
    assert pair_count(DOCUMENTS, SIDES) == 2
