"""Preference pairs for the data stage: records of each shape read into one canonical pair,
cleaned as a whole, each side rendered through SmolLM2's real tokenizer and chat template exactly
as SFT renders the same conversation, with the mask on the reply alone; a `kind: pairs` source
reads the pairs stage's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forgeline.configs.schema import CleaningConfig, ConfigError, SourceConfig
from forgeline.tasks.data.chat import (
    PromptNotShared,
    load_chat_tokenizer,
    pair_of,
    pair_text,
    render,
    render_pair,
)
from forgeline.tasks.data.clean import clean_pair
from forgeline.tasks.data.sources import SourceError, preflight_sources, read_source
from tests.conftest import debug_config
from tests.smollm2_tokenizer import MISSING, SKIP_REASON, smollm2_tokenizer_dir
from tests.unit.test_chat_masks import family_tokenizer

pytestmark = pytest.mark.skipif(bool(MISSING), reason=SKIP_REASON)


@pytest.fixture(scope="module")
def tokenizer():
    return load_chat_tokenizer(str(smollm2_tokenizer_dir()))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def read_pairs(tmp_path: Path, records: list[dict], **source: object) -> list[dict]:
    """The records of a jsonl `format: preference` source as the snapshot reads them."""
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    config = SourceConfig(kind="files", path=str(path), format="preference", **source)
    return [pair_of(doc.data.decode()) for doc in read_source(config, 10**6)]


def cleaned(pair: dict, **cleaning: object) -> tuple[str | None, dict | None]:
    kept = clean_pair(pair_text(pair).encode(), CleaningConfig(**cleaning), with_signature=False)
    return kept.removed_by, (pair_of(kept.text) if kept.removed_by is None else None)


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


STRING_PAIR = {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Green, I think."}
LIST_PAIR = {"prompt": [{"role": "system", "content": "Be brief."}, user("Hi"), assistant("Hello!"),
                        user("Say yes.")],
             "chosen": [assistant("Yes."), user("Why?"), assistant("You asked.")],
             "rejected": [assistant("No.")]}
IMPLICIT_PAIR = {"chosen": [user("Hi"), assistant("Hello!"), user("Say yes."), assistant("Yes.")],
                 "rejected": [user("Hi"), assistant("Hello!"), user("Say yes."), assistant("Nope.")]}
TRAINED = {"string": ("Blue.<|im_end|>", "Green, I think.<|im_end|>"),
           "list": ("Yes.<|im_end|>You asked.<|im_end|>", "No.<|im_end|>"),
           "implicit": ("Yes.<|im_end|>", "Nope.<|im_end|>")}


@pytest.mark.parametrize(("shape", "record"), [("string", STRING_PAIR), ("list", LIST_PAIR),
                                               ("implicit", IMPLICIT_PAIR)])
def test_each_reply_renders_as_sft_renders_its_conversation_with_the_mask_on_the_reply_alone(
        tmp_path: Path, tokenizer, shape: str, record: dict) -> None:
    [read] = read_pairs(tmp_path, [record])
    reason, pair = cleaned(read)
    assert reason is None and pair == read
    both = render_pair(tokenizer, pair)
    # The prompt as the model reads it before either reply: the template's generation prompt.
    prompt_text = tokenizer.apply_chat_template(pair["prompt"], tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    assert both.prompt_tokens == len(prompt_ids)
    for side, rendered in (("chosen", both.chosen), ("rejected", both.rejected)):
        sft = render(tokenizer, pair["prompt"] + pair[side])  # SFT's rendering: every assistant turn trained
        assert rendered.text == sft.text and rendered.ids.tolist() == sft.ids.tolist()
        assert rendered.ids[:len(prompt_ids)].tolist() == prompt_ids
        restricted = sft.mask.copy()
        restricted[:both.prompt_tokens] = 0  # the prompt's own assistant turns are not the reply
        assert rendered.mask.tolist() == restricted.tolist()
    assert (tokenizer.decode(both.chosen.ids[both.chosen.mask == 1]),
            tokenizer.decode(both.rejected.ids[both.rejected.mask == 1])) == TRAINED[shape]


def test_records_of_every_shape_read_into_one_canonical_pair(tmp_path: Path) -> None:
    """A string prompt is a user turn and a string reply an assistant turn; ShareGPT messages
    and a source's role names as for conversations; without a prompt, the messages both replies
    open with; keys the format does not name (the pairs stage's instruction ids) are not read."""
    sharegpt = {"prompt": [{"from": "human", "value": "Hi"}], "chosen": [{"from": "gpt", "value": "Hello"}],
                "rejected": "Go away.", "instruction_ids": ["punctuation:no_comma"]}
    renamed = {"question": "Hi", "good": [{"role": "agent", "content": "Hello"}], "bad": "Go away."}
    records = [STRING_PAIR, LIST_PAIR, IMPLICIT_PAIR, sharegpt]
    [string, listed, implicit, shared] = read_pairs(tmp_path, records)
    assert string == {"prompt": [user("Name a colour.")], "chosen": [assistant("Blue.")],
                      "rejected": [assistant("Green, I think.")]}
    assert listed == LIST_PAIR
    assert implicit == {"prompt": IMPLICIT_PAIR["chosen"][:3], "chosen": [assistant("Yes.")],
                        "rejected": [assistant("Nope.")]}
    assert shared == {"prompt": [user("Hi")], "chosen": [assistant("Hello")],
                      "rejected": [assistant("Go away.")]}
    [fields] = read_pairs(tmp_path, [renamed], prompt_field="question", chosen_field="good",
                          rejected_field="bad", roles={"agent": "assistant"})
    assert fields == shared


def test_a_record_not_of_the_format_names_its_line(tmp_path: Path) -> None:
    """Strings with no prompt: there is no conversation to take the prompt from."""
    with pytest.raises(SourceError, match=r"pairs.jsonl:2: not a JSON object with 'chosen' and 'rejected' "
                                          r"replies.*must be whole conversations"):
        read_pairs(tmp_path, [STRING_PAIR, {"chosen": "Yes.", "rejected": "No."}])


@pytest.mark.parametrize(("record", "reason"), [
    ({"prompt": "Hi", "chosen": " ", "rejected": "Hello"}, "empty_turn"),
    ({"prompt": "Hi", "chosen": [], "rejected": "Hello"}, "no_completion"),
    ({"prompt": "Hi", "chosen": [user("Hi"), assistant("Hello")], "rejected": "Hello"},
     "completion_not_reply"),  # the prompt again in a reply
    ({"chosen": [user("Hi"), assistant("Hello")], "rejected": [user("Hey"), assistant("Hello")]},
     "completion_not_reply"),  # no prompt, and the conversations part before the replies
    ({"chosen": [user("Hi"), assistant("Hello")], "rejected": [user("Hi"), assistant("Hello")]},
     "no_completion"),  # no prompt, and nothing after the messages both open with
    ({"prompt": "Hi", "chosen": "Hello!", "rejected": "Hello!"}, "identical_replies"),
    ({"prompt": [{"role": "system", "content": "Be kind."}], "chosen": "Hi", "rejected": "Go"},
     "no_user_turn"),
    ({"prompt": [assistant("Hi"), user("Hey")], "chosen": "Hi", "rejected": "Go"}, "assistant_first"),
    ({"prompt": [{"role": "customer", "content": "Hi"}], "chosen": "Hi", "rejected": "Go"}, "unknown_role"),
])
def test_a_pair_that_cannot_be_trained_is_dropped_by_reason(tmp_path: Path, record: dict,
                                                           reason: str) -> None:
    [pair] = read_pairs(tmp_path, [record])
    assert cleaned(pair)[0] == reason


def test_each_side_is_cleaned_and_the_pair_is_keyed_whole(tmp_path: Path) -> None:
    """PII is scrubbed on every side (replies that differ in it alone are the same reply); the same
    replies the other way round are another pair."""
    record = {"prompt": "Call 555-123-4567 now.", "chosen": "Done.", "rejected": "Mail me at a@example.com."}
    mails = {"prompt": "Mail me.", "chosen": "a@example.com", "rejected": "b@example.org"}
    [pair, addresses] = read_pairs(tmp_path, [record, mails])
    _, kept = cleaned(pair, scrub_pii=True)
    assert kept["prompt"][0]["content"] == "Call <PHONE> now." and "<EMAIL>" in kept["rejected"][0]["content"]
    assert cleaned(addresses, scrub_pii=True)[0] == "identical_replies" and cleaned(addresses)[0] is None
    swapped = {**pair, "chosen": pair["rejected"], "rejected": pair["chosen"]}
    keys = [clean_pair(pair_text(p).encode(), CleaningConfig(), with_signature=False).dedup_key
            for p in (pair, swapped)]
    assert keys[0] != keys[1]


# Mistral v3's rule on a ChatML template: the system turn is written in the last user turn.
FOLDING_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] != 'system' %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if loop.index0 == ns.last and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_pair_whose_renderings_differ_before_the_replies_is_refused(tokenizer) -> None:
    """A template that writes the prompt according to what follows it: a reply of two exchanges
    moves the system turn out of the prompt. And a reply whose first characters join the
    prompt's last token (`\\n` + `\\n\\n...` is one token, which the other reply's prompt lacks)."""
    pair = {"prompt": [{"role": "system", "content": "Be brief."}, user("Say yes.")],
            "chosen": [assistant("Yes."), user("Again?"), assistant("Yes.")], "rejected": [assistant("No.")]}
    with pytest.raises(PromptNotShared, match="differ before their replies"):
        render_pair(tokenizer, pair, FOLDING_TEMPLATE)
    assert render_pair(tokenizer, {**pair, "chosen": pair["chosen"][:1]}, FOLDING_TEMPLATE).prompt_tokens > 0
    with pytest.raises(PromptNotShared) as refused:
        render_pair(tokenizer, {**pair, "chosen": [assistant("\n\nYes.")]})
    assert refused.value.reason == "prompt_not_shared"


def test_qwen3_writes_the_same_prompt_before_both_replies(tokenizer) -> None:
    """Qwen3 keeps the <think> block of a reply after the last user turn only: a prompt's earlier
    reply loses its reasoning whichever reply follows, and each reply is trained with the empty
    <think> block the template writes before it."""
    qwen3 = family_tokenizer(tokenizer, "Qwen3")
    pair = {"prompt": [user("Hi"), assistant("<think>\nGreet back.\n</think>\n\nHello!"), user("Say yes.")],
            "chosen": [assistant("Yes.")], "rejected": [assistant("No.")]}
    both = render_pair(qwen3, pair)
    assert "Greet back." not in both.chosen.text
    assert qwen3.decode(both.chosen.ids[both.chosen.mask == 1]) == "<think>\n\n</think>\n\nYes.<|im_end|>"
    assert both.chosen.ids[:both.prompt_tokens].tolist() == both.rejected.ids[:both.prompt_tokens].tolist()


def test_a_pairs_source_needs_the_pairs_section_and_the_pairs_stage_output(tmp_path: Path) -> None:
    preferring = ("preference.beta=0.1", f"model.init_from={tmp_path / 'base'}")
    cfg = debug_config(tmp_path, "data.sources=[{kind: pairs}]", *preferring,
                       f"pairs.out_dir={tmp_path / 'none'}", "pairs.instruction_types=[punctuation:no_comma]")
    with pytest.raises(SourceError, match=r"data.sources\[pairs\]: no .*none/pairs.jsonl: run the pairs "
                                          r"stage first \(`forgeline stage pairs`\)"):
        preflight_sources(cfg)
    with pytest.raises(ConfigError, match="a `kind: pairs` source reads the pairs the pairs stage makes"):
        debug_config(tmp_path, "data.sources=[{kind: pairs}]", *preferring)
