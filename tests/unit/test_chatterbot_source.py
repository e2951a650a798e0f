"""The packaged `chatterbot` source: chatterbot-corpus's English conversations read as they ship
(no mock), user first, the topic files that overlap an eval dimension or are no turns left out;
and the snapshot reads it again when the package's files change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from forgeline.configs.schema import SourceConfig
from forgeline.tasks.data import sources
from forgeline.tasks.data.snapshot import provenance, read_stamp, take_snapshot
from forgeline.tasks.data.sources import CHATTERBOT_EXCLUDED, chatterbot_dir, read_source
from tests.conftest import debug_config

SOURCE = SourceConfig(kind="chatterbot")


def read_chats(source: SourceConfig = SOURCE) -> dict[str, list[dict]]:
    return {doc.name: json.loads(doc.data) for doc in read_source(source, 10**6)}


def test_the_packaged_conversations_are_read_user_first_without_the_excluded_files() -> None:
    chats = read_chats()
    assert len(chats) == 1444  # of the package's 2,026
    assert all(len(chat) >= 2 and all(message["role"] == ("user", "assistant")[n % 2]
                                      for n, message in enumerate(chat)) for chat in chats.values())
    shipped = {path.name for path in chatterbot_dir().glob("*.yml")}
    assert CHATTERBOT_EXCLUDED < shipped  # each name a file the package has: a misspelt one excludes nothing
    assert {name.split("#")[0] for name in chats} == shipped - CHATTERBOT_EXCLUDED
    assert chats["greetings.yml#0"] == [{"role": "user", "content": "Hello"},
                                        {"role": "assistant", "content": "Hi"}]
    assert not any("Richard Nixon" in message["content"] for chat in chats.values() for message in chat)


def test_the_source_is_conversations_of_a_packaged_corpus() -> None:
    assert SOURCE.record_format == "messages" and "(BSD)" in SOURCE.provenance
    assert provenance(SOURCE) == {"package": "chatterbot-corpus", "version": "1.3.3"}
    with pytest.raises(ValidationError, match="kind 'chatterbot' takes no `format`"):
        SourceConfig(kind="chatterbot", format="text")
    with pytest.raises(ValidationError, match="kind 'chatterbot' takes no `path`"):
        SourceConfig(kind="chatterbot", path="chats/*.yml")


def test_a_change_of_the_packages_files_is_read_again(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot's read stamp covers the files the source reads, the excluded ones not."""
    copy = Path(shutil.copytree(chatterbot_dir(), tmp_path / "english"))
    monkeypatch.setattr(sources, "chatterbot_dir", lambda: copy)
    cfg = debug_config(tmp_path, "sft.lora=null", "data.sources=[{kind: chatterbot}]")
    stamp = read_stamp(SOURCE, cfg.data.cleaning.max_chars)
    assert stamp is not None and take_snapshot(cfg).written

    (copy / "trivia.yml").write_text("conversations: [[Who was the 37th President?, Nixon]]\n")
    assert read_stamp(SOURCE, cfg.data.cleaning.max_chars) == stamp
    assert not take_snapshot(cfg).written

    (copy / "weather.yml").write_text("categories: [weather]\nconversations: [[Is it raining, Not here.]]\n")
    assert read_stamp(SOURCE, cfg.data.cleaning.max_chars) != stamp
    assert take_snapshot(cfg).written and "weather.yml#0" in read_chats()
