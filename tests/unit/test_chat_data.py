"""The data stage with `sft` set, end to end on small conversation sources (JSONL messages and
instructions, parquet messages: real chats of the shipped dataset) through SmolLM2's tokenizer:
conversations cleaned and deduplicated, packed whole several to a row with their starts (one
longer than a row split at turn boundaries into pieces, an exchange that cannot fit a row left out
and counted, a conversation of which none fits dropped as too_long), shards that carry loss masks
equal to chat.py's; the loader's loss mask aligned with the tokens; the
config rules that keep conversations and documents apart."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from pydantic import ValidationError
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from forgeline.configs.schema import CleaningConfig, ConfigError, SourceConfig
from forgeline.model.training.loader import DocumentBatch, ShardedSampleLoader
from forgeline.model.training.shards import (
    MASK_FIELD,
    SAMPLE_FIELD,
    STARTS_FIELD,
    iter_shard,
    read_manifest,
    split_shards,
)
from forgeline.tasks.data import build
from forgeline.tasks.data.build import build_dataset, check_dropped
from forgeline.tasks.data.chat import ChatTemplateError, conversation_of, load_chat_tokenizer, render_pieces
from forgeline.tasks.data.clean import clean_conversation
from forgeline.tasks.data.sources import SourceError, read_source
from tests.conftest import debug_config
from tests.smollm2_tokenizer import MISSING, SKIP_REASON, smollm2_tokenizer_dir

pytestmark = pytest.mark.skipif(bool(MISSING), reason=SKIP_REASON)
SEQ_LEN = 128


def shipped_chats(count: int) -> list[list[dict[str, str]]]:
    chats = (json.loads(doc.data) for doc in read_source(SourceConfig(kind="chitchat"), 10**6))
    return [chat for chat, _ in zip((c for c in chats if len(c) > 1), range(count), strict=False)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A built SFT dataset and, per source, the conversations written to it."""
    root = tmp_path_factory.mktemp("sft")
    chats = shipped_chats(90)
    unusable = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}],  # empty turn
                [{"role": "user", "content": "Anyone there?"}],  # no assistant turn
                [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Hi"}]]  # opens
    long_exchange = [{"role": "user", "content": "Tell me everything."},
                     {"role": "assistant", "content": "Everything. " * 150},
                     {"role": "user", "content": "In short?"}, {"role": "assistant", "content": "All of it."}]
    messages = chats[:60] + chats[:3] + unusable + [long_exchange]  # three exact duplicates
    instructions = [{"instruction": chat[0]["content"], "output": chat[1]["content"],
                     **({"input": "Answer in one line."} if n % 2 else {})}
                    for n, chat in enumerate(chats[60:80])]
    write_jsonl(root / "chats.jsonl", [{"messages": m} for m in messages])
    write_jsonl(root / "instructions.jsonl", instructions)
    pq.write_table(pa.table({"messages": chats[80:90]}), root / "chats.parquet")
    sources = [{"kind": "files", "path": str(root / name), "format": form, "name": label}
               for name, form, label in (("chats.jsonl", "messages", "chats"),
                                         ("instructions.jsonl", "instruction", "instructions"),
                                         ("chats.parquet", "messages", "parquet"))]
    cfg = debug_config(root, f"data.sources={json.dumps(sources)}", "sft.lora=null",
                       f"data.tokenizer_path={smollm2_tokenizer_dir()}", f"data.seq_len={SEQ_LEN}",
                       "data.val_fraction=0.15", "data.samples_per_shard=32")
    build_dataset(cfg)
    written = {"chats": messages, "instructions": [[{"role": "user", "content": r["instruction"] + (
        f"\n\n{r['input']}" if "input" in r else "")}, {"role": "assistant", "content": r["output"]}]
        for r in instructions], "parquet": chats[80:90]}
    return Path(cfg.data.out_dir), written


def expected_conversations(written: dict) -> tuple[dict[tuple[int, ...], np.ndarray], int]:
    """chat.py's (ids, mask) of every conversation piece the stage keeps, by its ids, and the
    number of conversations they come from."""
    tokenizer, cleaning = load_chat_tokenizer(str(smollm2_tokenizer_dir())), CleaningConfig()
    out, conversations = {}, 0
    for chats in written.values():
        for messages in chats:
            cleaned = clean_conversation(json.dumps(messages).encode(), cleaning, with_signature=False)
            if cleaned.removed_by is None:
                pieces = render_pieces(tokenizer, conversation_of(cleaned.text), SEQ_LEN + 1).rendered
                conversations += bool(pieces)
                out.update((tuple(chat.ids.tolist()), chat.mask) for _, chat in pieces)
    return out, conversations


def samples(data_dir: Path, manifest: dict) -> list[dict[str, np.ndarray]]:
    return [sample for split in ("train", "val") for shard in split_shards(data_dir, manifest, split)
            for sample in iter_shard(shard)]


def test_shards_pack_whole_conversations_with_the_masks_chat_renders(sft_data) -> None:
    data_dir, written = sft_data
    manifest = read_manifest(data_dir)
    assert manifest["loss_masks"] is True and len(manifest["chat_template_sha256"]) == 64
    assert manifest["train_on"] == "all_assistant"
    (expected, conversations), found, packed = expected_conversations(written), [], 0
    for sample in samples(data_dir, manifest):
        tokens, starts, mask = sample[SAMPLE_FIELD], sample[STARTS_FIELD], sample[MASK_FIELD]
        assert tokens.shape == mask.shape == (SEQ_LEN + 1,) and mask.dtype == np.uint8
        ends = [*starts[1:], len(tokens)]
        packed += len(starts) > 1
        for begin, end in zip(starts, ends, strict=True):
            ids = tokens[begin:end]
            if end == len(tokens):  # the row's last conversation: the padding after it is EOS, id 0
                ids = ids[:len(np.trim_zeros(ids, "b"))]
            assert tuple(ids.tolist()) in expected, "a row holds a conversation chat.py does not render so"
            want = expected[tuple(ids.tolist())].copy()
            want[0] = 0  # a conversation's first token: nothing of its own predicts it
            assert mask[begin:begin + len(ids)].tolist() == want.tolist()
            assert not mask[begin + len(ids):end].any()  # padding
            found.append(tuple(ids.tolist()))
    assert sorted(found) == sorted(expected)  # every kept piece once, none cut across rows
    assert len(expected) > conversations and packed > 0  # some were split
    assert sum(entry[f"{split}_documents"] for entry in manifest["sources"].values()
               for split in ("train", "val")) == conversations - 3  # less the exact duplicates
    assert sum(entry[f"{split}_split"] for entry in manifest["sources"].values()
               for split in ("train", "val")) > 0
    loss_tokens = sum(int(sample[MASK_FIELD].sum()) for sample in samples(data_dir, manifest))
    assert loss_tokens == sum(manifest["splits"][split]["loss_tokens"] for split in ("train", "val"))


def test_conversations_are_cleaned_and_deduplicated_per_source(sft_data) -> None:
    data_dir, _ = sft_data
    sources = read_manifest(data_dir)["sources"]
    assert sources["chats"]["removed"] == {"exact_duplicate": 3, "empty_turn": 1, "no_assistant_turn": 1,
                                           "assistant_first": 1}
    # An instruction whose answer alone is longer than a row: nothing of it fits.
    assert sources["instructions"]["removed"] == {"too_long": 1}
    assert sources["chats"]["kept"] == 61 and sources["instructions"]["kept"] == 19
    # long_exchange: its first exchange left out, its second kept
    assert sources["chats"]["train_dropped_turns"] + sources["chats"]["val_dropped_turns"] >= 1
    assert sources["parquet"]["kept"] == 10
    held_out = [json.loads(line) for line in (data_dir / "val_docs.jsonl").read_text().splitlines()]
    assert held_out
    assert all(doc["text"].startswith("<|im_start|>system") and doc["messages"] for doc in held_out)


def test_the_loader_returns_the_loss_mask_aligned_with_the_tokens(sft_data) -> None:
    data_dir, _ = sft_data
    manifest = read_manifest(data_dir)
    shards = split_shards(data_dir, manifest, "train")
    by_tokens = {tuple(s[SAMPLE_FIELD].tolist()): s for shard in shards for s in iter_shard(shard)}
    for document_starts in (True, False):
        batch = ShardedSampleLoader(shards, 8, 0, 1, seed=0, document_starts=document_starts).next_batch()
        assert isinstance(batch, DocumentBatch)
        assert batch.loss_mask.dtype == torch.bool and batch.loss_mask.shape == batch.tokens.shape
        for tokens, documents, loss_mask in zip(batch.tokens, batch.documents, batch.loss_mask, strict=True):
            sample = by_tokens[tuple(tokens.tolist())]
            assert loss_mask.tolist() == sample[MASK_FIELD].astype(bool).tolist()
            begins = np.flatnonzero(np.diff(documents.numpy(), prepend=documents[0].item() - 1))
            assert begins.tolist() == (sample[STARTS_FIELD].tolist() if document_starts else [0])


def test_a_tokenizer_without_a_chat_template_fails_before_anything_is_written(tmp_path: Path) -> None:
    bare = tmp_path / "bare-tokenizer"
    tokenizer = Tokenizer.from_file(str(smollm2_tokenizer_dir() / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(bare)
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in shipped_chats(3)])
    source = {"kind": "files", "path": str(chats), "format": "messages"}
    cfg = debug_config(tmp_path, f"data.sources={json.dumps([source])}", "sft.lora=null",
                       f"data.tokenizer_path={bare}")
    with pytest.raises(ChatTemplateError, match="has no chat template; set data.chat_template"):
        build_dataset(cfg)
    assert not Path(cfg.data.out_dir).exists() and not Path(cfg.data.raw_dir).exists()


def test_sft_trains_on_conversations_only(tmp_path: Path) -> None:
    chats = {"kind": "files", "path": str(tmp_path / "c.jsonl"), "format": "messages"}
    with pytest.raises(ConfigError, match=r"sft is set, but data.sources \['shakespeare'\] hold text"):
        debug_config(tmp_path, "sft.lora=null")
    with pytest.raises(ConfigError, match="hold conversations, which only supervised fine-tuning"):
        debug_config(tmp_path, f"data.sources={json.dumps([chats])}")
    with pytest.raises(ValidationError, match="kind 'chitchat' takes no `format`"):
        SourceConfig(kind="chitchat", format="text")
    # A text source's dump -- hashed into its snapshot and the data manifest -- is what it was before
    # conversation sources existed: their keys are left out at their defaults.
    assert "format" not in SourceConfig(kind="files", path="x.txt").model_dump()
    assert SourceConfig(**chats).model_dump()["format"] == "messages"


def test_a_record_not_of_its_format_names_its_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "Hi"}]},
                                               {"messages": [{"role": "user", "content": 3}]}])
    with pytest.raises(SourceError, match=r"bad.jsonl:2: not a JSON object with a 'messages' list of"):
        list(read_source(SourceConfig(kind="files", path=str(path), format="messages"), 10**6))


def test_the_shipped_chats_are_conversations_of_two_alternating_speakers() -> None:
    chats = [json.loads(doc.data) for doc in read_source(SourceConfig(kind="chitchat"), 10**6)]
    assert len(chats) == 7168
    assert all(message["role"] == ("user", "assistant")[n % 2]
               for chat in chats for n, message in enumerate(chat))
    assert sum(len(chat) > 1 for chat in chats) == 4018  # the others hold one speaker's messages only
    assert "(MIT)" in SourceConfig(kind="chitchat").provenance


def read_conversations(tmp_path: Path, records: list[dict], **source: object) -> list[list[dict]]:
    path = write_jsonl(tmp_path / "records.jsonl", records)
    config = SourceConfig(kind="files", path=str(path), **{"format": "messages", **source})
    return [json.loads(doc.data) for doc in read_source(config, 10**6)]


def test_sharegpt_records_and_their_role_names_are_read_as_conversations(tmp_path: Path) -> None:
    record = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                {"from": "gpt", "value": "Hello"}, {"from": "Human", "value": "Bye"},
                                {"from": "model", "value": "Bye!"}]}
    [chat] = read_conversations(tmp_path, [record], messages_field="conversations")
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in chat] == ["Be brief.", "Hi", "Hello", "Bye", "Bye!"]


def test_openai_content_parts_and_case_insensitive_roles_are_read(tmp_path: Path) -> None:
    record = {"messages": [{"role": "USER", "content": [{"type": "text", "text": "Two "},
                                                        {"type": "text", "text": "parts"}]},
                           {"role": "Assistant", "content": "One reply"}]}
    [chat] = read_conversations(tmp_path, [record])
    assert chat == [{"role": "user", "content": "Two parts"}, {"role": "assistant", "content": "One reply"}]


def test_a_source_extends_the_role_table_and_an_unknown_role_drops_its_conversation(tmp_path: Path) -> None:
    record = {"messages": [{"role": "customer", "content": "Hi"}, {"role": "agent", "content": "Hello"}]}
    [mapped] = read_conversations(tmp_path, [record], roles={"Customer": "user", "AGENT": "assistant"})
    assert [m["role"] for m in mapped] == ["user", "assistant"]
    [unmapped] = read_conversations(tmp_path, [record])
    cleaned = clean_conversation(json.dumps(unmapped).encode(), CleaningConfig(), with_signature=False)
    assert cleaned.removed_by == "unknown_role"


def test_an_assistant_turn_with_tool_calls_and_no_text_is_kept_with_its_calls(tmp_path: Path) -> None:
    """Its calls are what it says (chat.py renders them through the template, or refuses a
    template that writes none); a turn with neither text nor calls is empty."""
    call = {"id": "1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    record = {"messages": [{"role": "user", "content": "Weather?"},
                           {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}
    [chat] = read_conversations(tmp_path, [record])
    assert chat[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    cleaned = clean_conversation(json.dumps(chat).encode(), CleaningConfig(), with_signature=False)
    assert cleaned.removed_by is None
    assert conversation_of(cleaned.text) == chat
    other_call = [{**call, "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]
    calling_oslo = [chat[0], {**chat[1], "tool_calls": other_call}, *chat[2:]]
    other = clean_conversation(json.dumps(calling_oslo).encode(), CleaningConfig(), with_signature=False)
    assert other.dedup_key != cleaned.dedup_key  # another call is another conversation
    silent = [chat[0], {"role": "assistant", "content": ""}, *chat[2:]]
    assert clean_conversation(json.dumps(silent).encode(), CleaningConfig(),
                              with_signature=False).removed_by == "empty_turn"


def test_a_messages_train_setting_survives_cleaning(tmp_path: Path) -> None:
    record = {"messages": [{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello.", "train": False},
                           {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]}
    [chat] = read_conversations(tmp_path, [record])
    cleaned = clean_conversation(json.dumps(chat).encode(), CleaningConfig(), with_signature=False)
    assert [m.get("train") for m in json.loads(cleaned.text)] == [None, False, None, None]


def test_alpaca_records_with_a_system_field_are_read(tmp_path: Path) -> None:
    records = [{"instruction": "Add", "input": "2 and 3", "output": "5", "system": "Be exact."},
               {"instruction": "Greet", "output": "Hi"}]
    chats = read_conversations(tmp_path, records, format="instruction")
    assert chats == [[{"role": "system", "content": "Be exact."},
                      {"role": "user", "content": "Add\n\n2 and 3"}, {"role": "assistant", "content": "5"}],
                     [{"role": "user", "content": "Greet"}, {"role": "assistant", "content": "Hi"}]]


STRICT_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'tool' %}"
                   "{{ raise_exception('no tool turns') }}{% endif %}"
                   "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_conversation_the_template_rejects_is_dropped_and_counted_not_the_stage(tmp_path: Path) -> None:
    chats = shipped_chats(30)
    tool = [chats[0][0], {"role": "tool", "content": "{}"}, *chats[0][1:]]
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in [*chats[1:], tool]])
    source = {"kind": "files", "path": str(path), "format": "messages", "name": "chats"}
    cfg = debug_config(tmp_path, f"data.sources={json.dumps([source])}", "sft.lora=null",
                       f"data.tokenizer_path={smollm2_tokenizer_dir()}", f"data.seq_len={SEQ_LEN}",
                       "data.val_fraction=0.2", f"data.chat_template={json.dumps(STRICT_TEMPLATE)}")
    build_dataset(cfg)
    entry = read_manifest(Path(cfg.data.out_dir))["sources"]["chats"]
    assert entry["removed"] == {"template_rejects": 1} and entry["kept"] == 29
    assert entry["train_documents"] + entry["val_documents"] == 29


def test_a_tool_call_the_template_does_not_write_is_dropped_with_its_own_reason(tmp_path: Path,
                                                                               caplog) -> None:
    """SmolLM2's template writes a message's content only: the calling turn would train as an
    empty reply. The build reports the source's conversations with their splits at turn
    boundaries (it called them documents, without the splits, for a while)."""
    chats = shipped_chats(30)
    call = {"id": "1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    calling = [chats[0][0], {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "content": "sunny"}, *chats[0][1:]]
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in [*chats[1:], calling]])
    source = {"kind": "files", "path": str(path), "format": "messages", "name": "chats"}
    cfg = debug_config(tmp_path, f"data.sources={json.dumps([source])}", "sft.lora=null",
                       f"data.tokenizer_path={smollm2_tokenizer_dir()}", f"data.seq_len={SEQ_LEN}",
                       "data.val_fraction=0.2")
    with caplog.at_level("INFO", logger="forgeline"):
        build_dataset(cfg)
    entry = read_manifest(Path(cfg.data.out_dir))["sources"]["chats"]
    assert entry["removed"] == {"tool_calls_not_rendered": 1} and entry["kept"] == 29
    assert "source chats: 30 conversations read, 29 kept" in caplog.text
    assert "exchanges left out (alone longer than a row)" in caplog.text


def test_a_source_that_loses_too_many_conversations_fails_with_counts_and_examples(caplog) -> None:
    stats = {"chats": {"input": {"documents": 100}, "kept": 40,
                       "removed": {"unknown_role": 6, "no_assistant_turn": 50, "exact_duplicate": 4}},
             "other": {"input": {"documents": 10}, "kept": 10, "removed": {}}}
    examples = {"chats": ["a.jsonl:1: unknown_role", "a.jsonl:2: unknown_role", "a.jsonl:3: unknown_role"],
                "other": []}
    with caplog.at_level("INFO", logger="forgeline"):
        check_dropped(stats, examples, max_fraction=0.06)  # 6 %: no_assistant_turn and duplicates allowed
    assert "source chats: 100 conversations read, 40 kept, dropped {'exact_duplicate': 4, " in caplog.text
    with pytest.raises(ValueError, match=r"chats loses 6 of its 100 conversations \(6.0%\), more than "
                                         r"data.max_dropped_fraction=0.05.*'a.jsonl:3: unknown_role'"):
        check_dropped(stats, examples, max_fraction=0.05)


def test_a_refused_source_is_refused_before_any_shard_is_scheduled(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The train split's shards were scheduled before the check: their writes raced the cleanup
    (FileNotFoundError tracebacks from the workers, the reason said four times)."""
    chats = shipped_chats(30)
    unknown = [[{"role": "narrator", "content": "Once."}, *chat] for chat in chats[:5]]
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in [*chats[5:], *unknown]])
    source = {"kind": "files", "path": str(path), "format": "messages", "name": "chats"}
    cfg = debug_config(tmp_path, f"data.sources={json.dumps([source])}", "sft.lora=null",
                       f"data.tokenizer_path={smollm2_tokenizer_dir()}", f"data.seq_len={SEQ_LEN}",
                       "data.val_fraction=0.2", "data.max_dropped_fraction=0.05")
    scheduled = []
    monkeypatch.setattr(build, "shard_groups", lambda split, *args: scheduled.append(split))
    with pytest.raises(ValueError, match=r"chats loses 5 of its 30 conversations"):
        build_dataset(cfg)
    assert scheduled == []
    assert not Path(cfg.data.out_dir).exists()


def cleaned_turns(messages: list[dict]) -> tuple[str | None, list[dict] | None]:
    cleaned = clean_conversation(json.dumps(messages).encode(), CleaningConfig(), with_signature=False)
    return cleaned.removed_by, (conversation_of(cleaned.text) if cleaned.removed_by is None else None)


def test_whitespace_inside_turns_is_kept_and_an_empty_system_turn_is_left_out() -> None:
    code = "```python\ndef f():\n    return 1\n```\n"
    reason, kept = cleaned_turns([{"role": "system", "content": " "}, {"role": "user", "content": "Code?"},
                                  {"role": "assistant", "content": code}])
    assert reason is None
    assert kept == [{"role": "user", "content": "Code?"}, {"role": "assistant", "content": code}]


def test_a_conversation_without_a_user_turn_is_dropped() -> None:
    assert cleaned_turns([{"role": "system", "content": "Be kind."},
                          {"role": "assistant", "content": "Hello"}])[0] == "no_user_turn"
    assert cleaned_turns([{"role": "system", "content": "Be kind."}, {"role": "assistant", "content": "Hi"},
                          {"role": "user", "content": "Hi"}])[0] == "assistant_first"
