"""The registered pyfunc model (tasks/register.py HFGenerator) generates a request's rows
together: one padded `generate` call whose greedy replies are those of each row alone."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

from forgeline.model.hf import export_hf
from forgeline.tasks.register import HFGenerator
from tests.chat import random_model, save_chat_tokenizer

NEW_TOKENS = 8
TALK = [{"role": "user", "content": "Write a poem about the sea."}]
PROMPTS = ["ROMEO:", "Write", "a short poem about the sea in fewer than fifty words", "", "use no commas. "]


@pytest.fixture(scope="module")
def generator(tmp_path_factory: pytest.TempPathFactory) -> HFGenerator:
    """The pyfunc over a Hugging Face export of a tiny random model with a ChatML tokenizer."""
    root = tmp_path_factory.mktemp("batch")
    tokenizer = save_chat_tokenizer(root / "tokenizer")
    export = export_hf(random_model(len(tokenizer), max_seq_len=128), root / "tokenizer", root / "hf")
    model = HFGenerator()
    model.load_context(SimpleNamespace(artifacts={"hf": str(export)}))
    return model


def rows() -> pd.DataFrame:
    """Prompts of unlike lengths (an empty one among them) and conversations, in one frame."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(14)]
    return pd.DataFrame({"prompt": prompts + [None, None], "messages": [None] * 14 + [TALK, TALK]})


def test_a_batch_answers_as_its_rows_one_at_a_time(generator: HFGenerator) -> None:
    frame = rows()
    together = generator.predict(None, frame, {"max_new_tokens": NEW_TOKENS})
    alone = [generator.predict(None, frame.iloc[[row]], {"max_new_tokens": NEW_TOKENS})[0]
             for row in range(len(frame))]
    assert together == alone
    assert len(set(together)) > 2  # the rows' prompts decide their replies: not one text for all


def test_a_batch_is_decoded_in_one_generate_call(generator: HFGenerator) -> None:
    """16 rows take the forward passes of one: a prefill and one per new token after the first."""
    forwards = []
    hook = generator.model.register_forward_hook(lambda module, args, output: forwards.append(1))
    try:
        generator.predict(None, rows(), {"max_new_tokens": NEW_TOKENS})
    finally:
        hook.remove()
    assert len(forwards) <= NEW_TOKENS

