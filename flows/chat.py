"""`forgeline generate` and `forgeline chat`: talk to a model in this process, its tokens written
to stdout as they are made.

The model is anything `model.init_from` takes (tasks/pretrained.py resolves it): a registered
version or alias (models:/NAME@ALIAS, models:/NAME/VERSION; the registry is the config's), a
forgeline checkpoint step directory (its run's tokenizer), a Hugging Face directory (any family
forgeline imports), a .gguf file. Generation is model/inference.py's KV-cached decoding
(stream_batch): greedy at temperature 0, else sampled with temperature and nucleus (top-p)
sampling from a seeded generator. Every reply stops at the tokenizer's end-of-text token and at
its chat template's end-of-turn token (eval/chat.py), as the registered pyfunc's does.

`chat` renders the conversation through the tokenizer's chat template each turn; a tokenizer
without one (a model pretrained on plain text, like tiny.yaml's) gets the conversation as plain
text, one turn per line, for the model to continue. `generate --prompts-file` takes one prompt
per line, or JSON lines of {"prompt": ...} or {"messages": [...]} (rendered by the template, as
the pyfunc's rows are), and writes one JSON line per input with its `output`, in batches decoded
together.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
from transformers import PreTrainedTokenizerFast

from forgeline.configs import Config, ConfigError
from forgeline.eval.chat import Messages, end_of_turn_id, render_chat
from forgeline.model.hf import import_hf
from forgeline.model.inference import load_from_checkpoint, pack_linears, stream_batch
from forgeline.model.transformer import Transformer
from forgeline.tasks.pretrained import resolve_base

log = logging.getLogger(__name__)

PROMPT = "> "  # shown before each line read from a terminal
DEFAULT_NEW_TOKENS = 256  # and at most half the model's context, which keeps the other half for the prompt


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_new_tokens: int
    generator: torch.Generator


@dataclass(frozen=True)
class Talker:
    """A model loaded for generation, with its tokenizer and the tokens a reply stops at."""
    model: Transformer
    tokenizer: PreTrainedTokenizerFast
    stop_tokens: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) or [self.tokenizer.eos_token_id]


def load_talker(cfg: Config, source: str) -> Talker:
    """The model `source` names, resolved as model.init_from would be."""
    base = resolve_base(cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": source})}))
    model = load_from_checkpoint(base.weights) if base.is_checkpoint else import_hf(base.weights)[0]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(base.tokenizer))
    end_of_turn = end_of_turn_id(tokenizer)
    stops = (tokenizer.eos_token_id,) + ((end_of_turn,) if end_of_turn is not None else ())
    return Talker(pack_linears(model), tokenizer, stops)


def sampling(talker: Talker, temperature: float, top_p: float, max_new_tokens: int | None,
             seed: int | None) -> Sampling:
    """The settings of the command line, checked against the model: without a seed, a random one."""
    context = talker.model.shape.max_seq_len
    if max_new_tokens is None:
        max_new_tokens = min(DEFAULT_NEW_TOKENS, context // 2)
    if not 0 < max_new_tokens < context:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: this model's context is {context} tokens, so "
                          f"pass 1 to {context - 1} (the prompt keeps the rest)")
    if not 0 < top_p <= 1 or temperature < 0:
        raise ConfigError(f"--top-p {top_p} --temperature {temperature}: top-p is in (0, 1] and temperature "
                          ">= 0 (0: greedy)")
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return Sampling(temperature, top_p, max_new_tokens, generator)


def stream_text(talker: Talker, prompt: list[int], settings: Sampling) -> Iterator[str]:
    """The reply to `prompt` as pieces of text, each as soon as its tokens are made. A character
    split over several tokens (byte-level BPE) waits for its last byte, so that what is shown is
    never a replacement character; the pieces join to the reply's whole decoded text."""
    tokens: list[int] = []
    text = shown = ""
    for _, token in stream_batch(talker.model, [prompt], settings.max_new_tokens, settings.temperature,
                                 settings.top_p, talker.stop_tokens, generator=settings.generator):
        tokens.append(token)
        text = talker.tokenizer.decode(tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            yield text[len(shown):]
            shown = text
    if text != shown:  # the reply ended inside a character: its bytes as they are
        yield text[len(shown):]


def write_stream(pieces: Iterable[str], out: TextIO) -> str:
    """Each piece written and flushed as it comes, then a newline; the whole text."""
    text = ""
    for piece in pieces:
        out.write(piece)
        out.flush()
        text += piece
    out.write("\n")
    out.flush()
    return text


@dataclass
class Conversation:
    """The turns so far, and the prompt they make for the model's next reply."""
    talker: Talker
    system: str | None = None
    messages: Messages = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()
        if not self.talker.tokenizer.chat_template:
            log.warning("this model's tokenizer has no chat template: the conversation is plain text, one "
                        "turn per line, that the model continues (a model trained on conversations has one)")

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt(self, user: str) -> list[int]:
        """The tokens of the conversation with the user's new turn, the assistant's turn opened."""
        self.messages.append({"role": "user", "content": user})
        if self.talker.tokenizer.chat_template:
            return self.talker.encode(render_chat(self.talker.tokenizer, self.messages))
        return self.talker.encode("".join(f"{message['content']}\n" for message in self.messages))

    def answered(self, reply: str) -> None:
        self.messages.append({"role": "assistant", "content": reply})


def user_lines() -> Iterator[str]:
    """Lines from stdin until EOF: from a terminal with line editing and a prompt, from a pipe as
    they come."""
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (input() then edits lines and keeps their history)
    while True:
        try:
            yield input(PROMPT if interactive else "")
        except EOFError:
            return


def chat(talker: Talker, settings: Sampling, lines: Iterable[str], out: TextIO, system: str | None) -> None:
    """A conversation, one user turn per line: each reply streamed to `out`. `/reset` forgets the
    turns so far, `/exit` (or the end of the lines) ends it."""
    conversation = Conversation(talker, system)
    for line in lines:
        command = line.strip()
        if command == "/exit":
            return
        if command == "/reset":
            conversation.reset()
            log.info("conversation cleared")
            continue
        if not command:
            continue
        conversation.answered(write_stream(stream_text(talker, conversation.prompt(line), settings), out))


def generate(talker: Talker, settings: Sampling, prompt: str, out: TextIO) -> None:
    """One prompt's continuation, streamed."""
    write_stream(stream_text(talker, talker.encode(prompt), settings), out)


def read_prompts(path: Path) -> list[dict]:
    """A prompts file's records: JSON lines ({"prompt": ...} or {"messages": [...]}) for a .jsonl
    file, else one prompt per non-empty line."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return [{"prompt": line} for line in lines]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{number}: not JSON ({err.msg}); {PROMPT_LINE}") from None
        if not is_prompt(record):
            raise ConfigError(f"{path}:{number}: {PROMPT_LINE}")
        records.append(record)
    return records


PROMPT_LINE = ("each line needs a `prompt` (a string) or `messages` (a non-empty list of {role, content}); a "
               "file of plain prompts is read line by line when its name does not end in .jsonl")


def is_prompt(record: object) -> bool:
    """A prompts file's JSON line that can be rendered: a string prompt, or messages to template."""
    if not isinstance(record, dict):
        return False
    if "messages" not in record:
        return isinstance(record.get("prompt"), str)
    messages = record["messages"]
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(message, dict) and all(isinstance(message.get(key), str) for key in ("role", "content"))
        for message in messages)


def generate_file(talker: Talker, settings: Sampling, records: list[dict], out: TextIO,
                  batch_size: int) -> None:
    """Each record with its `output`, as a JSON line, in the records' order: `batch_size` rows
    decode at once, a record whose reply ends giving its row to the next (continuous batching);
    a record is written as soon as it and every record before it are done."""
    prompts = [talker.encode(render_chat(talker.tokenizer, record["messages"]) if "messages" in record
                             else record["prompt"]) for record in records]
    new: list[list[int]] = [[] for _ in records]
    done = [False] * len(records)
    written = 0

    def write_ready(row: int) -> None:
        nonlocal written
        done[row] = True
        while written < len(records) and done[written]:
            output = talker.tokenizer.decode(new[written], skip_special_tokens=True)
            out.write(json.dumps(records[written] | {"output": output}, ensure_ascii=False) + "\n")
            written += 1
        out.flush()

    for row, token in stream_batch(talker.model, prompts, settings.max_new_tokens, settings.temperature,
                                   settings.top_p, talker.stop_tokens, generator=settings.generator,
                                   batch_size=batch_size, ended=write_ready):
        new[row].append(token)
