"""`forgeline generate` and `forgeline chat` (flows/chat.py) on a tiny random model with a ChatML
tokenizer: replies stream token by token, stop at the template's end of turn, follow the
sampling settings and seed; a conversation resets; prompts files are read as documented."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from forgeline.configs import ConfigError
from forgeline.eval.chat import end_of_turn_id, render_chat
from forgeline.flows.chat import (
    Conversation,
    Talker,
    chat,
    generate_file,
    read_prompts,
    sampling,
    stream_text,
)
from forgeline.model.inference import generate_batch, sample_next, stream_batch
from tests.chat import random_model, save_chat_tokenizer

TALK = [{"role": "user", "content": "Write a poem about the sea."}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    return save_chat_tokenizer(tmp_path_factory.mktemp("chat") / "tokenizer")


def talker_of(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast) -> Talker:
    return Talker(model.eval(), tokenizer, (tokenizer.eos_token_id, end_of_turn_id(tokenizer)))


@pytest.fixture(scope="module")
def talker(tokenizer: PreTrainedTokenizerFast) -> Talker:
    return talker_of(random_model(len(tokenizer), max_seq_len=128), tokenizer)


def greedy(talker: Talker, new_tokens: int = 12) -> object:
    return sampling(talker, temperature=0.0, top_p=1.0, max_new_tokens=new_tokens, seed=0)


def test_a_reply_streams_as_its_tokens_are_made(talker: Talker) -> None:
    """The first piece comes after the prompt's forward pass alone, before any later token."""
    forwards = []  # of the output projection: one a decoding step
    hook = talker.model.output.register_forward_hook(lambda module, args, output: forwards.append(1))
    try:
        pieces = stream_text(talker, talker.encode("Write a poem"), greedy(talker))
        next(pieces)
        assert len(forwards) == 1
    finally:
        hook.remove()


def test_a_greedy_stream_is_the_batched_greedy_continuation(talker: Talker) -> None:
    prompt = talker.encode("Write a poem")
    streamed = "".join(stream_text(talker, prompt, greedy(talker)))
    [tokens] = generate_batch(talker.model, [prompt], 12, stop_token=talker.tokenizer.eos_token_id)
    assert streamed == talker.tokenizer.decode(tokens, skip_special_tokens=True) and streamed


def test_a_reply_stops_at_the_templates_end_of_turn(tokenizer: PreTrainedTokenizerFast) -> None:
    """A model made to close its turn at once (<|im_end|> after the opened turn's newline) and
    then to go on (a word after <|im_end|>) replies with nothing; stopping at end-of-text alone,
    it goes on."""
    newline, end_of_turn = tokenizer.convert_tokens_to_ids("Ċ"), end_of_turn_id(tokenizer)
    word = tokenizer.encode(" poem", add_special_tokens=False)[0]
    model = random_model(len(tokenizer), max_seq_len=128)
    a, b = torch.eye(model.shape.dim)[:2]
    with torch.no_grad():  # an input's embedding dominates its position's state
        model.tok_embeddings.weight[newline], model.output.weight[end_of_turn] = 30 * a, 100 * a
        model.tok_embeddings.weight[end_of_turn], model.output.weight[word] = 30 * b, 100 * b
    talker = talker_of(model, tokenizer)
    prompt = Conversation(talker).prompt(TALK[0]["content"])
    assert "".join(stream_text(talker, prompt, greedy(talker))) == ""
    eos_only = Talker(talker.model, tokenizer, (tokenizer.eos_token_id,))
    assert "".join(stream_text(eos_only, prompt, greedy(talker))).startswith(tokenizer.decode([word]))


def test_top_p_samples_from_the_nucleus_only() -> None:
    logits = torch.log(torch.tensor([[0.05, 0.6, 0.3, 0.05]])).repeat(400, 1)
    generator = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, 0.5, generator).tolist()) == {1}
    assert set(sample_next(logits, 1.0, 0.8, generator).tolist()) == {1, 2}
    assert set(sample_next(logits, 1.0, 1.0, generator).tolist()) == {0, 1, 2, 3}
    assert set(sample_next(logits, 0.0, 1.0, generator).tolist()) == {1}


def test_the_seed_decides_a_sampled_reply(talker: Talker) -> None:
    prompt = talker.encode("Write a poem")

    def reply(seed: int) -> str:
        return "".join(stream_text(talker, prompt, sampling(talker, 1.0, 1.0, 16, seed)))

    assert reply(1) == reply(1)
    assert len({reply(seed) for seed in range(4)}) > 1


def test_sampling_settings_the_model_cannot_take_name_their_flag(talker: Talker) -> None:
    with pytest.raises(ConfigError, match="--max-new-tokens 128: this model's context is 128"):
        sampling(talker, 0.0, 1.0, 128, 0)
    with pytest.raises(ConfigError, match="--top-p 0"):
        sampling(talker, 0.7, 0.0, 8, 0)
    assert sampling(talker, 0.7, 0.9, None, 0).max_new_tokens == 64  # half the context


def test_a_conversation_goes_through_the_template_and_resets(talker: Talker) -> None:
    """Each turn's prompt is the whole conversation rendered; /reset starts over, so the same
    line then gets the first reply again; /exit ends before the next line."""
    out = io.StringIO()
    line = TALK[0]["content"]
    chat(talker, greedy(talker), [line, line, "/reset", line, "/exit", line], out, system=None)
    first = reply_to(talker, TALK)
    second = reply_to(talker, [*TALK, {"role": "assistant", "content": first}, *TALK])
    assert out.getvalue() == f"{first}\n{second}\n{first}\n"


def reply_to(talker: Talker, messages: list[dict[str, str]]) -> str:
    prompt = talker.encode(render_chat(talker.tokenizer, messages))
    return "".join(stream_text(talker, prompt, greedy(talker)))


def test_prompts_files_are_lines_or_json_lines(tmp_path: Path) -> None:
    (tmp_path / "plain.txt").write_text("ROMEO:\n\nJULIET:\n")
    assert read_prompts(tmp_path / "plain.txt") == [{"prompt": "ROMEO:"}, {"prompt": "JULIET:"}]
    (tmp_path / "rows.jsonl").write_text('{"prompt": "ROMEO:"}\n'
                                         '{"messages": [{"role": "user", "content": "Hi"}]}\n')
    assert read_prompts(tmp_path / "rows.jsonl")[1]["messages"][0]["content"] == "Hi"
    (tmp_path / "bad.jsonl").write_text('{"text": "ROMEO:"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1: each line needs a `prompt`"):
        read_prompts(tmp_path / "bad.jsonl")
    # An empty message list (it ended in KeyError: 'prompt'), a message without content, not JSON.
    for number, bad in enumerate(['{"messages": []}', '{"messages": [{"role": "user"}]}', "ROMEO:"], 2):
        (tmp_path / "bad.jsonl").write_text('{"prompt": "ROMEO:"}\n' * (number - 1) + bad + "\n")
        with pytest.raises(ConfigError, match=f"bad.jsonl:{number}: .*each line needs a `prompt`"):
            read_prompts(tmp_path / "bad.jsonl")


def test_a_prompts_file_is_answered_in_its_order_with_rows_handed_on(talker: Talker) -> None:
    """Two rows for three records: each record's output is its own greedy reply, in the file's order."""
    records = [{"prompt": "Write a poem"}, {"messages": TALK}, {"prompt": "The sea"}]
    out = io.StringIO()
    generate_file(talker, greedy(talker), records, out, batch_size=2)
    prompts = [talker.encode("Write a poem"), talker.encode(render_chat(talker.tokenizer, TALK)),
               talker.encode("The sea")]
    alone = [[token for _, token in stream_batch(talker.model, [prompt], 12, stop_tokens=talker.stop_tokens)]
             for prompt in prompts]
    replies = [talker.tokenizer.decode(tokens, skip_special_tokens=True) for tokens in alone]
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line.pop("output") for line in lines] == replies
    assert lines == records
