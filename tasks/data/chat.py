"""Conversations rendered through a chat template to token ids and an exact loss mask.

A conversation is a list of {role, content} messages; the data stage stores it as JSON text
(`conversation_text`) from the source to the tokenizing step. `render` turns it into the token
ids the model reads and a mask of the tokens it learns to produce: 1 on each assistant turn's
content and the end-of-turn token that closes it, 0 on everything else -- system, user and tool
turns, the assistant header (`<|im_start|>assistant\\n`), what a template writes after the
end-of-turn token.

The mask is derived from the template's own renderings of the conversation's prefixes, with no
markers in the template. For the assistant turn at position i:

    prompt = render(messages[:i], add_generation_prompt=True)   ends with the assistant header
    upto   = render(messages[:i + 1])                           ends after the turn

The turn's trained characters run from the end of `prompt` to the end of the last special token
in `upto` after it: the end-of-turn token (a reply's own text may spell a special token, but the
template writes the closing one after it). This needs a template that renders a conversation's
prefixes as prefixes of its whole rendering and writes an assistant header for
add_generation_prompt -- ChatML (SmolLM2), Llama 3, Gemma, Mistral do; a template that rewrites
earlier turns fails with a clear error. The characters are then mapped to tokens by their
offsets: a token is trained when it covers a trained character. transformers'
`apply_chat_template(..., return_assistant_tokens_mask=True)` marks the same tokens for a
template with `{% generation %}` markers around the content and end-of-turn token
(tests/unit/test_chat_masks.py compares the two).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from jinja2 import TemplateError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, str]


class ChatTemplateError(ValueError):
    """A conversation cannot be rendered with the chat template, or there is no template."""


@dataclass(frozen=True)
class Rendered:
    text: str  # the whole conversation as the template writes it
    ids: np.ndarray  # (n,) int64 token ids, at most the `max_tokens` asked for
    mask: np.ndarray  # (n,) uint8: 1 on the assistant tokens the model learns to produce
    truncated: bool  # the rendering held more tokens than `max_tokens`


def conversation_text(messages: list[Message]) -> str:
    """A conversation as the JSON text the data stage carries it in (its identity for the split,
    mixing and dedup): roles and contents in order, and an assistant turn's tool calls where it
    has them."""
    return json.dumps([{"role": m["role"], "content": m["content"],
                        **({"tool_calls": m["tool_calls"]} if m.get("tool_calls") else {})}
                       for m in messages], ensure_ascii=False)


def conversation_of(text: str) -> list[Message]:
    return json.loads(text)


@functools.lru_cache(maxsize=4)
def load_chat_tokenizer(directory: str) -> PreTrainedTokenizerBase:
    """The Hugging Face tokenizer of a directory (tokenizer.json and its config: the special tokens
    a template refers to, such as bos_token, and the template itself); one per process."""
    from transformers import AutoTokenizer  # heavy: only conversation sources need it

    return AutoTokenizer.from_pretrained(directory)


def resolve_template(setting: str | None, tokenizer: PreTrainedTokenizerBase, where: str) -> str:
    """The template text `data.chat_template` names: None, the tokenizer's own (found at `where`);
    a `.jinja` file; or the template itself."""
    if setting is None:
        if not tokenizer.chat_template:
            raise ChatTemplateError(f"the tokenizer at {where} has no chat template; set data.chat_template "
                                    "to a .jinja file or to the template text")
        if not isinstance(tokenizer.chat_template, str):
            raise ChatTemplateError(f"the tokenizer at {where} has several named chat templates "
                                    f"({sorted(tokenizer.chat_template)}); set data.chat_template to one")
        return tokenizer.chat_template
    if setting.endswith(".jinja"):
        path = Path(setting)
        if not path.is_file():
            raise ChatTemplateError(f"data.chat_template: no template file at {path}")
        return path.read_text()
    if "{%" not in setting and "{{" not in setting:
        raise ChatTemplateError(f"data.chat_template {setting!r} is neither a .jinja file nor a Jinja "
                                "template")
    return setting


def template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode()).hexdigest()


def render(tokenizer: PreTrainedTokenizerBase, messages: list[Message], max_tokens: int | None = None,
           chat_template: str | None = None) -> Rendered:
    """`messages` as the chat template (`chat_template`, else the tokenizer's) writes them, tokenized
    as transformers' apply_chat_template does (no special tokens added), with the assistant mask;
    cut to the first `max_tokens` tokens when longer (the mask with them)."""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            _check_turn(messages, i)
    renderer = functools.partial(_render_text, tokenizer, chat_template)
    text = renderer(messages)
    all_ids, offsets = _encode(tokenizer, text, messages)
    truncated = max_tokens is not None and len(all_ids) > max_tokens
    kept = max_tokens if truncated else len(all_ids)
    # Turns are located up to the last kept character only: a long conversation cut to a row costs
    # the renderings of the turns in the row, not of all its turns.
    limit = offsets[kept - 1][1] if kept else 0
    spans = []
    for i in (i for i, message in enumerate(messages) if message["role"] == "assistant"):
        prompt = renderer(messages[:i], add_generation_prompt=True)
        if len(prompt) >= limit:
            break
        spans.append(_assistant_span(renderer, messages, i, prompt, text, _special_tokens(tokenizer)))
    ids, mask = np.array(all_ids[:kept], np.int64), _token_mask(offsets[:kept], spans)
    return Rendered(text, ids, mask, truncated)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str, messages: list[Message],
            ) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of `text`, the special tokens the template writes parsed as
    such, but a turn's content always tokenized as text: a reply that spells `<|im_end|>` must not
    train an end of turn in mid-reply, nor a user turn forge a header. Content without a special
    token's text is left to the whole text's tokenization (the same ids as transformers')."""
    special_tokens = _special_tokens(tokenizer)
    pieces, cursor, done = [], 0, 0  # pieces: (start, end, tokenized as text), in order
    for message in messages:
        content = message["content"]
        start = text.find(content, cursor) if content else -1
        forged = any(token in content for token in special_tokens)
        if forged and start < 0:
            raise ChatTemplateError("a turn spells a special token and the chat template rewrites its "
                                    "text, so it cannot be kept from becoming a control token")
        if start >= 0:
            cursor = start + len(content)
        if forged:
            pieces += [(done, start, False), (start, cursor, True)]
            done = cursor
    pieces.append((done, len(text), False))
    ids, offsets = [], []
    for start, end, as_text in pieces:
        # Through the tokenizer's own call, not its backend's encode: a call with truncation (such
        # as apply_chat_template's) leaves the backend set to truncate.
        encoding = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True,
                             split_special_tokens=as_text)
        ids += encoding["input_ids"]
        offsets += [(start + first, start + last) for first, last in encoding["offset_mapping"]]
    return ids, offsets


def _render_text(tokenizer: PreTrainedTokenizerBase, chat_template: str | None, messages: list[Message],
                 add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except TemplateError as err:  # raise_exception() in a template: a role or order it rejects
        roles = [message["role"] for message in messages]
        raise ChatTemplateError(f"the chat template rejects a conversation of roles {roles}: {err}") from None


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    return tuple(token.content for token in tokenizer.added_tokens_decoder.values() if token.special)


def _check_turn(messages: list[Message], i: int) -> None:
    if not messages[i]["content"].strip():
        raise ChatTemplateError(f"assistant turn {i} is empty: there is nothing to learn from it; drop the "
                                "conversation or its empty turns")
    if i == 0:
        raise ChatTemplateError("the conversation starts with an assistant turn, which nothing prompts; "
                                "drop the conversation or give it a user turn first")


def _assistant_span(renderer: functools.partial, messages: list[Message], i: int, prompt: str, text: str,
                    special_tokens: tuple[str, ...]) -> tuple[int, int]:
    """The characters of `text` that assistant turn `i` (prompted by `prompt`) trains: its content
    and end-of-turn token."""
    if prompt == renderer(messages[:i]):
        raise ChatTemplateError("the chat template writes no assistant header for add_generation_prompt, so "
                                "the header cannot be told from the reply; use a template that does")
    upto = renderer(messages[:i + 1])
    if not (upto.startswith(prompt) and text.startswith(upto)):
        raise ChatTemplateError("the chat template does not render a conversation's first turns as the "
                                "beginning of its rendering (it rewrites earlier turns), so the assistant "
                                "turns cannot be located; use a template that renders turns in order")
    end = max((upto.rfind(token, len(prompt)) + len(token) for token in special_tokens
               if upto.find(token, len(prompt)) >= 0), default=None)
    if end is None:
        raise ChatTemplateError("the chat template closes an assistant turn with no special token: nothing "
                                "would teach the model to stop; use a template with an end-of-turn token")
    return len(prompt), end


def _token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters overlap a span (spans and tokens are in order)."""
    mask = np.zeros(len(offsets), np.uint8)
    if not spans or not offsets:
        return mask
    starts, ends = np.array(offsets, np.int64).T
    for first, last in spans:
        mask[(starts < last) & (ends > first)] = 1
    return mask
