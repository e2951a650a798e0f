"""The loss mask of each chat template family, by hand: a conversation rendered through a template
written after the family's public one (on a small local tokenizer with the family's special
tokens: nothing is downloaded), and exactly the token strings it trains -- each assistant turn's
content and the end-of-turn token that closes it, never a header or a prompt. The end-of-turn
token is the one generation stops at (eval/chat.py's `end_of_turn`). Also: `sft.train_on:
last_assistant`, and a conversation longer than a row split at turn boundaries."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from forgeline.configs.schema import CleaningConfig, SourceConfig
from forgeline.eval.chat import end_of_turn, end_of_turn_id
from forgeline.tasks.cache import stage_inputs
from forgeline.tasks.data import work as w
from forgeline.tasks.data.chat import (
    ChatTemplateError,
    conversation_of,
    conversation_text,
    render,
    render_pieces,
    trained_turns,
)
from forgeline.tasks.data.sources import conversation_record
from forgeline.tasks.stage import stage_named
from tests.conftest import debug_config

LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
QWEN2 = (
    "{%- for message in messages %}{%- if loop.first and messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Qwen3's: the reasoning of a reply (in <think>...</think> at its start) is kept only after the
# last user turn, where the last reply always gets a <think> block, empty if it has none.
QWEN3 = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}{%- set ns.multi_step_tool = false %}"
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- set content = message.content %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Mistral's: no system role -- the system turn is folded into the first user turn (v0.2) or the
# last one (v0.3); the prompt ends with [/INST], and a reply is ' ' + content + '</s>'.
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}"
    "{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if FOLD and system_message is defined %}"
    "{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported') }}{%- endif %}"
    "{%- endfor %}")
LLAMA2 = (
    "{%- if messages[0]['role'] == 'system' %}{%- set loop_messages = messages[1:] %}"
    "{%- set system_message = messages[0]['content'] %}{%- else %}{%- set loop_messages = messages %}"
    "{%- set system_message = false %}{%- endif %}{%- for message in loop_messages %}"
    "{%- if loop.index0 == 0 and system_message != false %}"
    "{%- set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{%- else %}{%- set content = message['content'] %}{%- endif %}"
    "{%- if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{%- endif %}"
    "{%- endfor %}")
# Phi-3's: a rendering without the generation prompt ends with EOS, after the last <|end|>.
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
# ChatML with transformers' generation markers (SmolLM3's way): the template says what is trained.
MARKED = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# family: (template, special tokens (bos, eos, then the others), other added tokens)
FAMILIES = {
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"], []),
    "qwen2": (QWEN2, [None, "<|endoftext|>", "<|im_start|>", "<|im_end|>"], []),
    "qwen3": (QWEN3, [None, "<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<think>", "</think>"]),
    "mistral": (MISTRAL.replace("FOLD", "loop.first"), ["<s>", "</s>"], []),
    "mistral-v3": (MISTRAL.replace("FOLD", "message == user_messages[-1]"),
                   ["<s>", "</s>", "[INST]", "[/INST]"], []),
    "llama2": (LLAMA2, ["<s>", "</s>"], []),
    "phi3": (PHI3, ["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], []),
    "gemma": (GEMMA, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], []),
    "generation-markers": (MARKED, [None, "<|endoftext|>", "<|im_start|>", "<|im_end|>"], []),
}
SYSTEM = {"role": "system", "content": "Be brief."}
CHAT = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Germany?"}, {"role": "assistant", "content": "Berlin."}]
TEXT = "Capital of France? Paris. And of Germany? Berlin. Be brief. system user assistant model " * 8

# What each family trains of CHAT (after SYSTEM where it has a system role), and its end of turn.
TRAINED = {
    "llama3": (["Paris.<|eot_id|>", "Berlin.<|eot_id|>"], "<|eot_id|>"),
    "qwen2": (["Paris.<|im_end|>", "Berlin.<|im_end|>"], "<|im_end|>"),
    # the last reply is written (and generated) with a <think> block: trained with it
    "qwen3": (["Paris.<|im_end|>", "<think>\n\n</think>\n\nBerlin.<|im_end|>"], "<|im_end|>"),
    "mistral": ([" Paris.</s>", " Berlin.</s>"], "</s>"),
    "mistral-v3": ([" Paris.</s>", " Berlin.</s>"], "</s>"),
    "llama2": ([" Paris. </s>", " Berlin. </s>"], "</s>"),
    "phi3": (["Paris.<|end|>", "Berlin.<|end|>"], "<|end|>"),  # not the EOS after the last <|end|>\n
    "gemma": (["Paris.<end_of_turn>", "Berlin.<end_of_turn>"], "<end_of_turn>"),
    "generation-markers": (["Paris.<|im_end|>", "Berlin.<|im_end|>"], "<|im_end|>"),
}


def family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text encodes) with the family's special and added tokens
    and its template."""
    template, (bos, eos, *others), added = FAMILIES[family]
    specials = [token for token in (bos, eos, *others) if token is not None]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos,
                                        additional_special_tokens=others)
    tokenizer.add_tokens(added)
    tokenizer.chat_template = template
    return tokenizer


def trained_runs(tokenizer: PreTrainedTokenizerFast, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The text of each run of trained tokens, in order."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [tokenizer.decode(ids[start:end].tolist())
            for start, end in zip(edges[0::2], edges[1::2], strict=True)]


def conversation(family: str) -> list[dict[str, str]]:
    return CHAT if family == "gemma" else [SYSTEM, *CHAT]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_exactly_its_replies_and_their_end_of_turn_token(family: str) -> None:
    tokenizer = family_tokenizer(family)
    rendered = render(tokenizer, conversation(family))
    runs, token = TRAINED[family]
    assert trained_runs(tokenizer, rendered.ids, rendered.mask) == runs
    assert end_of_turn(tokenizer) == token  # one definition: the mask ends and generation stops there
    assert end_of_turn_id(tokenizer) == tokenizer.convert_tokens_to_ids(token)
    untrained = tokenizer.decode(rendered.ids[rendered.mask == 0].tolist())
    assert all(turn["content"] in untrained for turn in conversation(family) if turn["role"] != "assistant")


def test_generation_markers_give_transformers_own_mask() -> None:
    tokenizer = family_tokenizer("generation-markers")
    messages = [SYSTEM, *CHAT]
    reference = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
    rendered = render(tokenizer, messages)
    assert rendered.ids.tolist() == list(reference["input_ids"])
    assert rendered.mask.tolist() == list(reference["assistant_masks"])
    last = render(tokenizer, messages, train_on="last_assistant")
    assert trained_runs(tokenizer, last.ids, last.mask) == ["Berlin.<|im_end|>"]


def test_qwen3_trains_a_replys_reasoning_where_the_template_writes_it() -> None:
    tokenizer = family_tokenizer("qwen3")
    messages = [SYSTEM, CHAT[0], {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nParis."},
                CHAT[2], {"role": "assistant", "content": "<think>\nThe capital.\n</think>\n\nBerlin."}]
    rendered = render(tokenizer, messages)
    # An earlier reply's reasoning is left out of the text by the template; the last keeps its own.
    assert trained_runs(tokenizer, rendered.ids, rendered.mask) == [
        "Paris.<|im_end|>", "<think>\nThe capital.\n</think>\n\nBerlin.<|im_end|>"]


def test_gemma_rejects_a_system_turn() -> None:
    with pytest.raises(ChatTemplateError, match="rejects a conversation of roles .*System role not"):
        render(family_tokenizer("gemma"), [SYSTEM, *CHAT])


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen3"])
def test_last_assistant_trains_the_last_reply_only(family: str) -> None:
    tokenizer = family_tokenizer(family)
    rendered = render(tokenizer, conversation(family), train_on="last_assistant")
    assert trained_runs(tokenizer, rendered.ids, rendered.mask) == TRAINED[family][0][-1:]


def exchange(n: int, reply: str | None = None) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question {n}?"},
            {"role": "assistant", "content": reply or f"Answer {n}."}]


def test_a_long_conversation_is_split_at_turn_boundaries_each_piece_with_the_system_turn() -> None:
    tokenizer = family_tokenizer("qwen2")
    messages = [SYSTEM, *exchange(1), *exchange(2), *exchange(3), *exchange(4, "Paris. " * 60),
                *exchange(5), *exchange(6)]
    two = len(render(tokenizer, [SYSTEM, *exchange(1), *exchange(2)]).ids)
    pieces = render_pieces(tokenizer, messages, max_tokens=two + 2)
    assert pieces.dropped_turns == 1  # exchange 4 does not fit a row alone
    assert [[turn["content"] for turn in piece] for piece, _ in pieces.rendered] == [
        ["Be brief.", "Question 1?", "Answer 1.", "Question 2?", "Answer 2."],
        ["Be brief.", "Question 3?", "Answer 3."],
        ["Be brief.", "Question 5?", "Answer 5.", "Question 6?", "Answer 6."]]
    for piece, rendered in pieces.rendered:
        assert len(rendered.ids) <= two + 2 and not rendered.truncated
        assert rendered.ids.tolist() == render(tokenizer, piece).ids.tolist()
    trained = [run for _, rendered in pieces.rendered
               for run in trained_runs(tokenizer, rendered.ids, rendered.mask)]
    assert trained == [f"Answer {n}.<|im_end|>" for n in (1, 2, 3, 5, 6)]
    whole = render_pieces(tokenizer, messages, max_tokens=10_000)
    assert len(whole.rendered) == 1 and whole.rendered[0][0] == messages and whole.dropped_turns == 0


def test_last_assistant_keeps_the_most_exchanges_that_fit_before_the_last_reply() -> None:
    tokenizer = family_tokenizer("qwen2")
    messages = [SYSTEM, *exchange(1, "Paris. " * 60), *exchange(2), *exchange(3), *exchange(4)]
    two = len(render(tokenizer, [SYSTEM, *exchange(3), *exchange(4)]).ids)
    [(piece, rendered)] = render_pieces(tokenizer, messages, two, train_on="last_assistant").rendered
    assert piece == [SYSTEM, *exchange(3), *exchange(4)]
    assert trained_runs(tokenizer, rendered.ids, rendered.mask) == ["Answer 4.<|im_end|>"]
    long_last = [SYSTEM, *exchange(1), *exchange(2, "Paris. " * 60)]
    nothing = render_pieces(tokenizer, long_last, two, train_on="last_assistant")
    assert nothing.rendered == [] and nothing.dropped_turns == 1


def test_the_data_stage_trains_on_pieces_and_counts_what_it_leaves_out(tmp_path) -> None:
    """tokenize_piece's conversations (work.render_piece): pieces packed as conversations of their
    own, each with its mask; the exchanges and conversations left out counted; sft.train_on."""
    tokenizer = family_tokenizer("qwen2")
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    row = len(render(tokenizer, [SYSTEM, *exchange(1), *exchange(2)]).ids) + 2
    chats = [[SYSTEM, *exchange(1), *exchange(2), *exchange(3, "Paris. " * 60), *exchange(4)],  # 2 pieces
             [SYSTEM, *exchange(1, "Paris. " * 60)],  # too long
             exchange(5)]  # fits whole
    plan = w.Plan(str(tmp_path / "work"), "", CleaningConfig(), ("chats",), (1.0,), 0.1, 1, (0,), True)
    (tmp_path / "work" / "tokens").mkdir(parents=True)
    names = ["a", "b", "c"]
    replies = [["Answer 1.<|im_end|>", "Answer 2.<|im_end|>"], ["Answer 4.<|im_end|>"],
               ["Answer 5.<|im_end|>"]]
    for train_on, trained in (("all_assistant", replies), ("last_assistant", replies[1:])):
        chat = w.ChatWork(str(tmp_path / "tokenizer"), row, train_on)
        work = w.PieceWork(0, "val", 1, "", 0, "<u4", plan, chat)
        texts = [(conversation_text(messages), 0) for messages in chats]
        [counts] = w.render_piece(work, texts, names).values()
        documents, tokens, several, loss, dropped, dropped_turns, examples = counts
        ids, mask = np.load(f"{work.stem}.ids.npy"), np.load(f"{work.stem}.mask.npy")
        docs = np.load(f"{work.stem}.docs.npy")
        ends = np.cumsum(docs["length"])
        assert [trained_runs(tokenizer, ids[end - length:end], mask[end - length:end])
                for end, length in zip(ends, docs["length"], strict=True)] == trained
        assert (documents, several, dropped) == (2, int(train_on == "all_assistant"), {"too_long": 1})
        # last_assistant: exchange 3 is not left out but before the piece that ends with the last reply
        assert dropped_turns == (train_on == "all_assistant") and tokens == len(ids) and loss == mask.sum()
        assert examples == ["b: too_long (no exchange fits in a row)"]
        held_out = [json.loads(line) for line in work.stem.with_suffix(".jsonl").read_text().splitlines()]
        assert [doc["messages"] for doc in held_out][-1] == chats[-1]
        assert all(doc["messages"][0] == SYSTEM for doc in held_out[:-1])
        assert [doc["name"] for doc in held_out] == (["a (part 1 of 2)", "a (part 2 of 2)", "c"]
                                                     if train_on == "all_assistant" else ["a", "c"])


def test_sft_train_on_is_part_of_the_data_stages_cache_key(tmp_path) -> None:
    """The masks follow sft.train_on: a change must rebuild the data, not replay it."""
    cfg = debug_config(tmp_path, "sft.lora=null", "data.sources=[{kind: chitchat}]")
    last = cfg.with_values({"sft.train_on": "last_assistant"})
    data = stage_named("data")
    Path(cfg.data.raw_dir).mkdir()  # the snapshot's hash is in the key too
    assert stage_inputs(data, cfg)["params"]["sft.train_on"] == "all_assistant"
    assert stage_inputs(data, last)["params"]["sft.train_on"] == "last_assistant"


def test_a_template_that_writes_todays_date_renders_the_same_every_day() -> None:
    """Llama 3.1+'s system header holds strftime_now's date unless given date_string."""
    tokenizer = family_tokenizer("llama3")
    dated = ("{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
             "{%- endif %}{{- 'Today Date: ' + date_string + '\\n' }}" + LLAMA3)
    assert render(tokenizer, CHAT, chat_template=dated).text.startswith("Today Date: 26 Jul 2024\n")


def test_a_message_with_train_false_is_not_trained_even_an_assistant_turn() -> None:
    """A message's "train": false keeps its turn out of the loss (train_on: all_assistant, and a
    template with generation markers alike); the turn stays in the text, as context."""
    skipped = [SYSTEM, CHAT[0], {**CHAT[1], "train": False}, *CHAT[2:]]
    for family in ("qwen2", "llama3", "generation-markers"):
        tokenizer = family_tokenizer(family)
        rendered = render(tokenizer, skipped)
        assert trained_runs(tokenizer, rendered.ids, rendered.mask) == TRAINED[family][0][1:], family
        assert rendered.ids.tolist() == render(tokenizer, [SYSTEM, *CHAT]).ids.tolist()
    last = [SYSTEM, *CHAT[:3], {**CHAT[3], "train": False}]
    tokenizer = family_tokenizer("qwen2")
    rendered = render(tokenizer, last, train_on="last_assistant")
    assert trained_runs(tokenizer, rendered.ids, rendered.mask) == []
    # nothing to learn: no piece (the data stage drops it as no_trained_turn)
    assert render_pieces(tokenizer, last, 10_000, train_on="last_assistant").rendered == []


def test_train_true_trains_an_assistant_turn_under_last_assistant() -> None:
    tokenizer = family_tokenizer("qwen2")
    marked = [SYSTEM, CHAT[0], {**CHAT[1], "train": True}, *CHAT[2:]]
    rendered = render(tokenizer, marked, train_on="last_assistant")
    assert trained_runs(tokenizer, rendered.ids, rendered.mask) == ["Paris.<|im_end|>", "Berlin.<|im_end|>"]
    assert render(tokenizer, marked, train_on="last_assistant").mask.tolist() == rendered.mask.tolist()
    markers = family_tokenizer("generation-markers")
    rendered = render(markers, marked, train_on="last_assistant")
    assert trained_runs(markers, rendered.ids, rendered.mask) == ["Paris.<|im_end|>", "Berlin.<|im_end|>"]
    assert trained_turns(marked, "last_assistant") == [2, 4]
    assert trained_turns(marked[:4], "last_assistant") == [2]


def test_a_long_conversation_trains_its_marked_turns_in_every_piece() -> None:
    """Split to fit a row under last_assistant, a conversation trains the reply that says
    "train": true in its own piece and the last reply in its, and no other: a piece's last reply
    is not the conversation's. The same pieces every time."""
    tokenizer = family_tokenizer("qwen2")
    messages = [SYSTEM, *exchange(1), *exchange(2), *exchange(3), *exchange(4)]
    messages[4] = {**messages[4], "train": True}  # Answer 2.
    two = len(render(tokenizer, [SYSTEM, *exchange(1), *exchange(2)]).ids)
    pieces = render_pieces(tokenizer, messages, two + 2, train_on="last_assistant")
    assert [[turn["content"] for turn in piece] for piece, _ in pieces.rendered] == [
        ["Be brief.", "Question 1?", "Answer 1.", "Question 2?", "Answer 2."],
        ["Be brief.", "Question 3?", "Answer 3.", "Question 4?", "Answer 4."]]
    assert pieces.rendered[0][0][4] is messages[4]  # the conversation's own messages
    assert [trained_runs(tokenizer, rendered.ids, rendered.mask) for _, rendered in pieces.rendered] == [
        ["Answer 2.<|im_end|>"], ["Answer 4.<|im_end|>"]]
    again = render_pieces(tokenizer, messages, two + 2, train_on="last_assistant")
    assert [rendered.mask.tolist() for _, rendered in again.rendered] == [
        rendered.mask.tolist() for _, rendered in pieces.rendered]


def test_a_messages_train_is_read_carried_and_counted(tmp_path) -> None:
    """`train` is read from a `messages` record, kept in the conversation's text, and a conversation
    that trains no turn is dropped as no_trained_turn, not as too_long."""
    source = SourceConfig(kind="files", path=str(tmp_path / "chats.jsonl"), format="messages")
    record = {"messages": [{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello", "train": False}]}
    messages = conversation_record(source, record)
    assert messages[1]["train"] is False and conversation_of(conversation_text(messages)) == messages
    with pytest.raises(TypeError, match="train is 'no', not true or false"):
        conversation_record(source, {"messages": [{"role": "assistant", "content": "Hi", "train": "no"}]})
    tokenizer = family_tokenizer("qwen2")
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    plan = w.Plan(str(tmp_path / "work"), "", CleaningConfig(), ("chats",), (1.0,), 0.1, 1, (0,), True)
    (tmp_path / "work" / "tokens").mkdir(parents=True)
    work = w.PieceWork(0, "train", 1, "", 0, "<u4", plan, w.ChatWork(str(tmp_path / "tokenizer"), 512))
    [counts] = w.render_piece(work, [(conversation_text(messages), 0)], ["a"]).values()
    assert counts[0] == 0 and counts[4] == {"no_trained_turn": 1}
