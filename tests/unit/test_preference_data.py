"""The data stage with `preference` set, on preference pairs read as they ship -- a `kind: pairs`
source (the pairs stage's pairs.jsonl) and a parquet `format: preference` source; real chats of
the shipped dataset as prompts and replies -- through SmolLM2's real tokenizer and chat template:
records of each shape read into one canonical pair, cleaned and deduplicated as a whole, each
side rendered exactly as SFT renders the same conversation with the mask on the reply alone, a
pair packed whole (chosen then rejected, mask 1 then 2) and dropped, never cut, when it does not
fit in a row; the same bytes from another executor and partitioning."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from forgeline.configs import Config
from forgeline.configs.schema import CleaningConfig, ConfigError, SourceConfig
from forgeline.model.fileio import sha256_file
from forgeline.model.training.shards import (
    CHOSEN,
    MASK_FIELD,
    REJECTED,
    SAMPLE_FIELD,
    STARTS_FIELD,
    iter_shard,
    read_manifest,
    split_shards,
)
from forgeline.tasks.data import snapshot
from forgeline.tasks.data.build import build_dataset, partition_members
from forgeline.tasks.data.chat import (
    PromptNotShared,
    load_chat_tokenizer,
    pair_of,
    pair_text,
    render,
    render_pair,
)
from forgeline.tasks.data.clean import clean_pair
from forgeline.tasks.data.snapshot import SOURCES_NAME, SnapshotError, load_snapshot, snapshot_members
from forgeline.tasks.data.sources import PAIRS_FILE, SourceError, preflight_sources, read_source
from forgeline.tasks.runner import MissingInputError, check_stage_inputs
from forgeline.tasks.stage import stage_named
from tests.conftest import debug_config
from tests.smollm2_tokenizer import MISSING, SKIP_REASON, smollm2_tokenizer_dir
from tests.unit.test_chat_masks import family_tokenizer

pytestmark = pytest.mark.skipif(bool(MISSING), reason=SKIP_REASON)
SEQ_LEN = 256
PAIRS = 40  # kept pairs of the pairs source, one shape in three each


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


def test_a_saved_dataset_of_pairs_is_read_as_its_jsonl_records_are(tmp_path: Path) -> None:
    import datasets  # heavy: this test only

    records = [LIST_PAIR,
               {"prompt": [user("Hi")], "chosen": [assistant("Hello")], "rejected": [assistant("Go.")]}]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    source = SourceConfig(kind="hf", path=str(tmp_path / "saved"), format="preference")
    assert [pair_of(doc.data.decode()) for doc in read_source(source, 10**6)] == read_pairs(tmp_path, records)
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
    preflight_sources(cfg)  # the pairs are the pairs stage's output: `forgeline run` makes them first
    missing = r"stage 'data' reads the output of pairs, which is missing \(.*none/manifest.json\)"
    with pytest.raises(MissingInputError, match=missing + r"; run `forgeline stage pairs` first"):
        check_stage_inputs(stage_named("data"), cfg)  # the data stage alone
    check_stage_inputs(stage_named("data"), cfg, from_snapshot=True)  # its snapshot holds them
    with pytest.raises(ConfigError, match="a `kind: pairs` source reads the pairs the pairs stage makes"):
        debug_config(tmp_path, "data.sources=[{kind: pairs}]", *preferring)


# -- the data stage ------------------------------------------------------------------------------


def short_chats(count: int) -> list[list[dict]]:
    """Shipped chats of four turns or more whose first four fit a row twice over, four turns each."""
    chats = (json.loads(doc.data) for doc in read_source(SourceConfig(kind="chitchat"), 10**6))
    short = (chat[:4] for chat in chats if len(chat) >= 4 and sum(len(m["content"]) for m in chat[:4]) < 240)
    return [chat for chat, _ in zip(short, range(count), strict=False)]


def pairs_records(chats: list[list[dict]]) -> list[dict]:
    """PAIRS records of the three shapes, each chat's reply against another chat's, as the pairs
    stage writes them (with its own keys), and five it cannot train on."""
    records = []
    for n in range(PAIRS):
        chat, other = chats[n], chats[(n + 7) % len(chats)]
        if n % 3 == 0:
            record = {"prompt": chat[0]["content"], "chosen": chat[1]["content"],
                      "rejected": other[1]["content"]}
        elif n % 3 == 1:
            record = {"prompt": chat[:3], "chosen": [chat[3]], "rejected": other[3]["content"]}
        else:
            record = {"chosen": chat, "rejected": [*chat[:3], other[3]]}
        records.append({**record, "instruction_ids": ["punctuation:no_comma"]})
    unusable = [{"prompt": "Tell me everything.", "chosen": "Everything. " * 40,
                 "rejected": "All of it. " * 40},
                {"prompt": "Hi", "chosen": "Hello!", "rejected": "Hello!"},
                {"prompt": "Hi", "chosen": "  ", "rejected": "Hello"}]
    return records + unusable + records[:2]  # too long together, identical, empty; two exact duplicates


def parquet_pairs(chats: list[list[dict]]) -> list[dict]:
    return [{"prompt": chat[:1], "chosen": [chat[1]], "rejected": [other[1]]}
            for chat, other in zip(chats, chats[3:] + chats[:3], strict=True)]


def preference_config(root: Path, pairs_dir: Path, *overrides: str):
    parquet = {"kind": "files", "path": str(root / "pairs.parquet"), "format": "preference",
               "name": "parquet"}
    sources = [{"kind": "pairs"}, parquet]
    return debug_config(root, f"data.sources={json.dumps(sources)}", "preference.beta=0.1",
                        f"model.init_from={root / 'base'}", f"pairs.out_dir={pairs_dir}",
                        "pairs.instruction_types=[punctuation:no_comma]",
                        f"data.tokenizer_path={smollm2_tokenizer_dir()}", f"data.seq_len={SEQ_LEN}",
                        "data.val_fraction=0.25", "data.samples_per_shard=4", *overrides)


@pytest.fixture(scope="module")
def preference_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Config, dict]:
    """The config of a preference dataset built on Dask from a snapshot in gzip members of 2 KB,
    and the records it was built from, by source."""
    root = tmp_path_factory.mktemp("preference")
    chats = short_chats(PAIRS + 8)
    (root / "pairs").mkdir()
    write_jsonl(root / "pairs" / PAIRS_FILE, pairs_records(chats[:PAIRS]))
    pq.write_table(pa.Table.from_pylist(parquet_pairs(chats[PAIRS:])), root / "pairs.parquet")
    cfg = preference_config(root, root / "pairs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(snapshot, "MEMBER_BYTES", 2048)
        build_dataset(cfg)
    written = {"pairs": pairs_records(chats[:PAIRS]), "parquet": parquet_pairs(chats[PAIRS:])}
    return cfg, written


def expected_pairs(tokenizer, cfg: Config) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    """chat.py's rendering of every pair the stage keeps (as the snapshot holds it, cleaned), by
    its two conversations' ids; the exact duplicates, and the pair that does not fit, left out."""
    out = {}
    for raw in load_snapshot(cfg.data):
        reason, pair = cleaned(pair_of(raw.data.decode()))
        if reason is None:
            both = render_pair(tokenizer, pair)
            if len(both.chosen.ids) + len(both.rejected.ids) <= SEQ_LEN + 1:
                out[(tuple(both.chosen.ids.tolist()), tuple(both.rejected.ids.tolist()))] = (
                    both.chosen.mask, both.rejected.mask)
    return out


def rows(data_dir: Path, manifest: dict, split: str) -> list[dict[str, np.ndarray]]:
    return [sample for shard in split_shards(data_dir, manifest, split) for sample in iter_shard(shard)]


def test_shards_pack_whole_pairs_chosen_then_rejected_with_masks_one_and_two(preference_data,
                                                                             tokenizer) -> None:
    cfg, _ = preference_data
    data_dir = Path(cfg.data.out_dir)
    manifest = read_manifest(data_dir)
    assert manifest["preference"] is True and manifest["loss_masks"] is True and "train_on" not in manifest
    expected, found, several = expected_pairs(tokenizer, cfg), [], 0
    for split in ("train", "val"):
        loss = {CHOSEN: 0, REJECTED: 0}
        for sample in rows(data_dir, manifest, split):
            tokens, starts, mask = sample[SAMPLE_FIELD], sample[STARTS_FIELD], sample[MASK_FIELD]
            assert tokens.shape == mask.shape == (SEQ_LEN + 1,) and mask.dtype == np.uint8
            assert len(starts) % 2 == 0  # whole pairs only
            several += len(starts) > 2
            end = len(np.trim_zeros(tokens, "b"))  # the padding after the last pair is EOS, id 0
            assert not mask[end:].any()
            bounds = [*starts.tolist(), end]
            for k in range(0, len(starts), 2):
                chosen, rejected = (slice(bounds[k + i], bounds[k + i + 1]) for i in (0, 1))
                key = (tuple(tokens[chosen].tolist()), tuple(tokens[rejected].tolist()))
                assert key in expected, "a row holds a pair chat.py does not render so"
                for part, rendered, value in ((chosen, expected[key][0], CHOSEN),
                                              (rejected, expected[key][1], REJECTED)):
                    want = rendered * value
                    want[0] = 0  # a document's first token: nothing of its own predicts it
                    assert mask[part].tolist() == want.tolist()
                first = int(np.argmax(mask[chosen] > 0))  # the prompt: the same tokens before both replies
                assert tokens[chosen][:first].tolist() == tokens[rejected][:first].tolist()
                found.append(key)
            loss[CHOSEN] += int((mask == CHOSEN).sum())
            loss[REJECTED] += int((mask == REJECTED).sum())
        counts = manifest["splits"][split]
        assert counts["pairs"] > 0
        assert counts["chosen_loss_tokens"] == loss[CHOSEN]
        assert counts["rejected_loss_tokens"] == loss[REJECTED]
        assert counts["loss_tokens"] == loss[CHOSEN] + loss[REJECTED]
    assert sorted(found) == sorted(expected) and several > 0  # every kept pair once, several to a row
    assert len(found) == sum(manifest["splits"][split]["pairs"] for split in ("train", "val"))


def test_pairs_are_cleaned_deduplicated_and_dropped_by_reason_per_source(preference_data) -> None:
    cfg, written = preference_data
    data_dir = Path(cfg.data.out_dir)
    manifest = read_manifest(data_dir)
    pairs, parquet = manifest["sources"]["pairs"], manifest["sources"]["parquet"]
    assert pairs["removed"] == {"exact_duplicate": 2, "too_long": 1, "identical_replies": 1, "empty_turn": 1}
    assert pairs["input"]["documents"] == len(written["pairs"]) and pairs["kept"] == PAIRS
    assert parquet["removed"] == {} and parquet["kept"] == len(written["parquet"])
    for entry in (pairs, parquet):
        assert entry["train_pairs"] + entry["val_pairs"] == entry["kept"] and "train_documents" not in entry
    held_out = [json.loads(line) for line in (data_dir / "val_docs.jsonl").read_text().splitlines()]
    assert len(held_out) == manifest["splits"]["val"]["pairs"]
    assert all(doc["text"].startswith("<|im_start|>system") and doc["rejected_text"].endswith("<|im_end|>\n")
               and {"prompt", "chosen", "rejected"} <= doc.keys() for doc in held_out)
    [read] = [entry for entry in json.loads((Path(cfg.data.raw_dir) / SOURCES_NAME).read_text())["sources"]
              if entry["label"] == "pairs"]
    assert read["provenance"] == {"path": f"{cfg.pairs.out_dir}/{PAIRS_FILE}"}


def test_the_same_pairs_give_the_same_bytes_on_a_pool_in_smaller_partitions(preference_data,
                                                                            tmp_path: Path) -> None:
    built, _ = preference_data
    root = Path(built.data.out_dir).parent
    cfg = preference_config(root, root / "pairs", f"data.out_dir={tmp_path / 'data'}", "data.executor=pool",
                            "data.num_workers=2", "data.partition_mb=0.002")
    assert len(partition_members(snapshot_members(cfg.data), cfg.data.partition_mb)) >= 4
    result = build_dataset(cfg, from_snapshot=True)
    assert not result.reused
    digests = [{str(path.relative_to(out)): sha256_file(path) for path in sorted(out.rglob("*"))
                if path.is_file()} for out in (Path(built.data.out_dir), Path(result.out_dir))]
    assert digests[0] == digests[1]


def test_a_snapshot_of_another_pairs_out_dir_is_not_built_from(preference_data, tmp_path: Path) -> None:
    """pairs.out_dir is no part of the sources' config: the snapshot says which pairs it read."""
    built, _ = preference_data
    root = Path(built.data.out_dir).parent
    cfg = preference_config(root, tmp_path / "other-pairs", f"data.out_dir={tmp_path / 'data'}")
    with pytest.raises(SnapshotError, match=r"holds the pairs of .*/pairs/pairs.jsonl, not of this config's "
                                            r"pairs.out_dir \(.*other-pairs/pairs.jsonl\)"):
        build_dataset(cfg, from_snapshot=True)
