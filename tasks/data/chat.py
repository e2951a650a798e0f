"""Conversations rendered through a chat template to token ids and an exact loss mask.

A conversation is a list of {role, content} messages; the data stage stores it as JSON text
(`conversation_text`) from the source to the tokenizing step. `render` turns it into the token
ids the model reads and a mask of the tokens it learns to produce: 1 on each assistant turn's
content and the end-of-turn token that closes it, 0 on everything else -- system, user and tool
turns, the assistant header (`<|im_start|>assistant\\n`), what a template writes after the
end-of-turn token.

Which characters an assistant turn trains is found in the rendering of the whole conversation
(`assistant_spans`): from the end of the generation prompt of the turns before it (the header,
`<|im_start|>assistant\\n`, or Mistral's `[/INST]`) through the template's end-of-turn token after
the turn's content (eval/chat.py's `end_of_turn`, the token generation stops at), the content
located by a marker appended to it. A template with `{% generation %}` markers says itself what
is trained, as transformers' return_assistant_tokens_mask reads them. The characters are then
mapped to tokens by their offsets: a token is trained when it covers a trained character
(transformers' own rule; tests/unit/test_chat_masks.py compares the two, and
tests/unit/test_chat_families.py checks each template family's trained tokens by hand).

`render_pieces` splits a conversation longer than a row at turn boundaries instead of cutting it
(the data stage's way); `sft.train_on` picks every assistant turn or the last one, and a message's
own `train` (true or false) overrides it for that turn (`trained_turns`).

A preference pair (`pair_text`: a prompt and two replies to it, each a list of messages) is
rendered as two conversations, prompt + chosen and prompt + rejected (`render_pair`), each by
`render` with the prompt's assistant turns marked `"train": false` and the reply's `"train":
true`: each mask is SFT's mask of that conversation on the reply and 0 on the prompt. Both must
hold the same tokens before their first trained token -- the replies are compared given one
context -- or the pair is refused (`PromptNotShared`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from jinja2 import TemplateError

from forgeline.eval.chat import end_of_turn, special_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]  # role and content (str); an assistant's tool_calls; train (bool), where given
TrainOn = Literal["all_assistant", "last_assistant"]  # sft.train_on
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # as transformers finds the markers
# Llama 3.1+ templates write today's date into the system header (strftime_now) unless given
# `date_string`: a fixed one keeps the rendering the same whatever the day of the build.
TEMPLATE_VALUES = {"date_string": "26 Jul 2024"}


class ChatTemplateError(ValueError):
    """A conversation cannot be rendered with the chat template, or there is no template."""

    reason = "template_rejects"  # what the data stage's manifest counts a dropped record as


class ToolCallsNotRendered(ChatTemplateError):
    """The chat template writes no tool call of an assistant turn that makes one."""

    reason = "tool_calls_not_rendered"


class PromptNotShared(ChatTemplateError):
    """The two renderings of a preference pair differ before their replies."""

    reason = "prompt_not_shared"


@dataclass(frozen=True)
class Rendered:
    text: str  # the whole conversation as the template writes it
    ids: np.ndarray  # (n,) int64 token ids, at most the `max_tokens` asked for
    mask: np.ndarray  # (n,) uint8: 1 on the assistant tokens the model learns to produce
    truncated: bool  # the rendering held more tokens than `max_tokens`


@dataclass(frozen=True)
class Pieces:
    """A conversation as the data stage trains on it: whole, or split at turn boundaries."""

    rendered: list[tuple[list[Message], Rendered]]  # each piece's messages and rendering, in order
    dropped_turns: int  # exchanges with a reply left out: alone (with the system turn) longer than a row


@dataclass(frozen=True)
class RenderedPair:
    """A preference pair as the data stage trains on it: two conversations sharing a prompt."""

    chosen: Rendered  # prompt + the preferred reply; its mask on the reply alone
    rejected: Rendered  # prompt + the other reply
    prompt_tokens: int  # the tokens both hold before their first trained one: the prompt, as read


# A preference pair: its `prompt` and its two replies, `chosen` (preferred) and `rejected`, each a
# list of messages; a reply opens with an assistant turn.
Pair = dict[str, list[Message]]
PAIR_SIDES = ("prompt", "chosen", "rejected")


def _turn(message: Message) -> Message:
    """A message's role and content, and an assistant turn's tool calls where it has them."""
    return {"role": message["role"], "content": message["content"],
            **({"tool_calls": message["tool_calls"]} if message.get("tool_calls") else {})}


def conversation_text(messages: list[Message]) -> str:
    """A conversation as the JSON text the data stage carries it in (its identity for the split,
    mixing and dedup): roles and contents in order, an assistant turn's tool calls where it has
    them, and a message's `train` where it is given."""
    return json.dumps([{**_turn(m), **({"train": m["train"]} if "train" in m else {})} for m in messages],
                      ensure_ascii=False)


def pair_text(pair: Pair) -> str:
    """A preference pair as the JSON text the data stage carries it in (its identity for the
    split, mixing and dedup): {prompt, chosen, rejected}, each a list of messages as
    `conversation_text` writes them, less any `train` (a pair's shape says what it trains)."""
    return json.dumps({side: [_turn(m) for m in pair[side]] for side in PAIR_SIDES}, ensure_ascii=False)


def pair_of(text: str) -> Pair:
    return json.loads(text)


def trained_turns(messages: list[Message], train_on: TrainOn = "all_assistant") -> list[int]:
    """The indices of the assistant turns a conversation trains, in order: those `train_on` names
    (every one, or the last), less those whose message says `"train": false`, plus those whose
    message says `"train": true`. Only an assistant turn is ever trained."""
    assistants = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    return [i for i in assistants
            if messages[i].get("train", train_on == "all_assistant" or i == assistants[-1])]


def _explicit(messages: list[Message]) -> bool:
    return any("train" in message for message in messages)


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
           chat_template: str | None = None, train_on: TrainOn = "all_assistant") -> Rendered:
    """`messages` as the chat template (`chat_template`, else the tokenizer's) writes them, tokenized
    as transformers' apply_chat_template does (no special tokens added), with the mask of the
    assistant turns `train_on` names; cut to the first `max_tokens` tokens when longer (the mask
    with them). The data stage never cuts: it splits a long conversation (`render_pieces`)."""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            _check_turn(messages, i)
    template = _template_text(tokenizer, chat_template)
    text, spans = assistant_spans(tokenizer, template, messages, train_on)
    all_ids, offsets = _encode(tokenizer, text, messages)
    truncated = max_tokens is not None and len(all_ids) > max_tokens
    kept = max_tokens if truncated else len(all_ids)
    ids, mask = np.array(all_ids[:kept], np.int64), _token_mask(offsets[:kept], spans)
    return Rendered(text, ids, mask, truncated)


def render_pieces(tokenizer: PreTrainedTokenizerBase, messages: list[Message], max_tokens: int,
                  chat_template: str | None = None, train_on: TrainOn = "all_assistant") -> Pieces:
    """`messages` rendered whole when they fit in `max_tokens`; else split at turn boundaries into
    pieces that do, each the system turn (if any) and consecutive exchanges -- an exchange runs
    from a user turn to the next user turn that follows another role --, as many as fit, in order;
    with `last_assistant`, the one piece of the most exchanges that fit and end with the last reply
    (as many pieces as with `all_assistant` where a message's `train` trains an earlier turn too).
    A piece that trains no turn is left out (so none where no turn is trained); an exchange with
    a trained turn that does not fit alone (with the system turn) is dropped and counted."""
    template = _template_text(tokenizer, chat_template)
    trained = set(trained_turns(messages, train_on))
    if not trained:
        return Pieces([], 0)
    if _length(tokenizer, template, messages) <= max_tokens:
        return Pieces([(messages, render(tokenizer, messages, None, template, train_on))], 0)
    system = messages[:1] if messages[0]["role"] == "system" else []
    exchanges = _exchanges(messages[len(system):])
    starts = np.cumsum([len(system)] + [len(exchange) for exchange in exchanges])  # each one's first message
    has_trained = [any(starts[n] <= i < starts[n + 1] for i in trained) for n in range(len(exchanges))]

    def fits(first: int, end: int) -> bool:
        return _length(tokenizer, template, system + _joined(exchanges[first:end])) <= max_tokens

    spans, dropped = [], 0  # spans: (first, end) exchanges of each piece
    if train_on == "last_assistant" and sum(has_trained) == 1:
        last = has_trained.index(True) + 1
        if fits(last - 1, last):
            spans.append((last - _furthest(lambda count: fits(last - count, last), last), last))
        else:
            dropped = 1
    else:
        first = 0
        while first < len(exchanges):
            if fits(first, first + 1):
                end = first + _furthest(lambda count, first=first: fits(first, first + count),
                                        len(exchanges) - first)
                spans.append((first, end))
                first = end
            else:
                dropped += has_trained[first]
                first += 1
    # A piece is rendered with each of its turns trained as in the whole conversation (a piece's
    # last reply is not the conversation's), and returned as the conversation's own messages.
    resolved = ([{**message, "train": i in trained} if message["role"] == "assistant" else message
                 for i, message in enumerate(messages)] if _explicit(messages) else messages)
    pieces = [[*range(len(system)), *range(starts[a], starts[b])] for a, b in spans if any(has_trained[a:b])]
    return Pieces([([messages[i] for i in piece],
                    render(tokenizer, [resolved[i] for i in piece], None, template, train_on))
                   for piece in pieces], dropped)


def pair_conversations(pair: Pair) -> tuple[list[Message], list[Message]]:
    """prompt + chosen and prompt + rejected, the prompt's assistant turns marked `"train": false`
    and each reply's `"train": true`: what `render` trains of them is the reply alone."""
    prompt = [{**m, "train": False} if m["role"] == "assistant" else m for m in pair["prompt"]]
    return tuple([*prompt, *({**m, "train": True} if m["role"] == "assistant" else m for m in pair[side])]
                 for side in ("chosen", "rejected"))


def render_pair(tokenizer: PreTrainedTokenizerBase, pair: Pair,
                chat_template: str | None = None) -> RenderedPair:
    """Both conversations of a preference pair rendered whole (`pair_conversations`), each with
    the mask `render` gives it. Raises PromptNotShared when they differ before their first trained
    token: a template that writes the prompt according to what follows it (Mistral v3 puts the
    system turn in the last user turn, which a reply of several exchanges moves), or a reply whose
    first characters join the prompt's last token -- the replies would be scored given different
    contexts."""
    template = _template_text(tokenizer, chat_template)
    chosen, rejected = (render(tokenizer, messages, None, template) for messages in pair_conversations(pair))
    first = int(np.argmax(chosen.mask))
    if int(np.argmax(rejected.mask)) != first or not np.array_equal(chosen.ids[:first], rejected.ids[:first]):
        raise PromptNotShared("prompt + chosen and prompt + rejected differ before their replies as the chat "
                              "template writes and the tokenizer splits them, so the replies would be scored "
                              "given different contexts")
    return RenderedPair(chosen, rejected, first)


def _furthest(fits: Callable[[int], bool], most: int) -> int:
    """The largest count in [1, most] that `fits` (true of 1, and of every count below a true
    one): counts grow by doubling, then bisect, so no rendering tried is much longer than a row."""
    good, step = 1, 1
    while good < most and fits(min(good + step, most)):
        good, step = min(good + step, most), step * 2
    bad = min(good + step, most) if good < most else most + 1  # a count that does not fit (most + 1: none)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def _exchanges(turns: list[Message]) -> list[list[Message]]:
    """The turns after the system turn, cut before each user turn that follows another role."""
    out: list[list[Message]] = []
    for n, turn in enumerate(turns):
        if not out or (turn["role"] == "user" and turns[n - 1]["role"] != "user"):
            out.append([])
        out[-1].append(turn)
    return out


def _joined(exchanges: list[list[Message]]) -> list[Message]:
    return [turn for exchange in exchanges for turn in exchange]


def _length(tokenizer: PreTrainedTokenizerBase, template: str, messages: list[Message]) -> int:
    return len(_encode(tokenizer, _render_text(tokenizer, template, messages), messages)[0])


def _template_text(tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> str:
    template = chat_template or tokenizer.chat_template
    if not isinstance(template, str):
        raise ChatTemplateError("no chat template to render conversations with: set data.chat_template")
    return template


def assistant_spans(tokenizer: PreTrainedTokenizerBase, template: str, messages: list[Message],
                    train_on: TrainOn = "all_assistant") -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and, in order, the character spans of it that the assistant turns
    `train_on` (and each message's `train`: `trained_turns`) names train: each turn's content and
    the end-of-turn token that closes it.

    A template with `{% generation %}` markers says it itself (transformers' renderer, as
    apply_chat_template(..., return_assistant_tokens_mask=True) reads them). Otherwise a turn's
    span is found in the rendering of the whole conversation -- never in a rendering of a prefix
    of it, which a template may write differently (Qwen3 writes an empty <think> block in the last
    turn only; Mistral v3 folds the system turn into the last user turn):

    - its content ends where a marker character appended to the content lands (one rendering with
      every reply marked; the markers removed, it must be the conversation's own text);
    - it starts where the generation prompt of the turns before it ends, when the text begins with
      that prompt: what the model writes after the prompt is trained, a template's own <think>
      block or leading space too; else at the content (found by another marker);
    - it ends after the template's end-of-turn token (eval/chat.py's `end_of_turn`: one definition
      for masks and for generation's stop), the first after the content, with no other special
      token between them.
    """
    assistants = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if GENERATION_TAG.search(template):
        from transformers.utils.chat_template_utils import render_jinja_template

        [text], [spans] = render_jinja_template(conversations=[messages], chat_template=template,
                                                return_assistant_tokens_mask=True,
                                                **tokenizer.special_tokens_map, **TEMPLATE_VALUES)
        if _explicit(messages):  # the generation blocks are the assistant turns', one each
            if len(spans) != len(assistants):
                raise ChatTemplateError(
                    f"the chat template's {{% generation %}} blocks ({len(spans)}) are not one per assistant "
                    f"turn ({len(assistants)}), so a message's `train` cannot be applied")
            keep = set(trained_turns(messages, train_on))
            spans = [span for i, span in zip(assistants, spans, strict=True) if i in keep]
        elif train_on == "last_assistant":  # the spans after the turns before the last reply
            before = _render_text(tokenizer, template, messages[:assistants[-1]])
            spans = ([span for span in spans if span[0] >= len(before)] if text.startswith(before)
                     else spans[-1:])
        return text, [tuple(span) for span in spans]
    text = _render_text(tokenizer, template, messages)
    token = _end_of_turn(tokenizer, template)
    specials = special_tokens(tokenizer)
    ends = _marked(tokenizer, template, messages, text,
                   lambda lead, core, trail, mark: lead + core + mark + trail)
    turns = trained_turns(messages, train_on)
    spans, starts = [], None
    for i in turns:
        end = ends[assistants.index(i)]
        prompt = _render_text(tokenizer, template, messages[:i], add_generation_prompt=True)
        if text.startswith(prompt) and len(prompt) <= (len(prompt) if end is None else end):
            start = len(prompt)
        elif end is None:
            raise ChatTemplateError(f"assistant turn {i} only calls tools, and the chat template writes the "
                                    "turns before it otherwise than its generation prompt: its start "
                                    "cannot be told")
        else:
            if starts is None:
                starts = _marked(tokenizer, template, messages, text,
                                 lambda lead, core, trail, mark: lead + mark + core + trail)
            start = starts[assistants.index(i)]
        end = start if end is None else end
        close = text.find(token, end)
        if close < 0 or any(other in text[end:close] for other in specials):
            raise ChatTemplateError(f"the chat template does not close assistant turn {i} with its "
                                    f"end-of-turn token {token!r}, so the turn's end cannot be told")
        _check_tool_calls(messages[i], i, text[start:close])
        spans.append((start, close + len(token)))
    return text, spans


def _check_tool_calls(message: Message, i: int, written: str) -> None:
    """A template that ignores `tool_calls` writes a tool-calling turn as its text alone, often
    empty: trained, the model would learn to answer nothing where it should call a tool."""
    for call in message.get("tool_calls") or []:
        name = call.get("function", call).get("name", "")
        if not name or name not in written:
            raise ToolCallsNotRendered(f"the chat template writes no call of tool {name!r} in assistant turn "
                                       f"{i} (it ignores `tool_calls`), so the turn would train a reply "
                                       "without it; use a template that renders tool calls (ChatML with "
                                       "tools, Qwen, Llama 3.1+)")


def _marked(tokenizer: PreTrainedTokenizerBase, template: str, messages: list[Message], text: str,
            mark_content: Callable[[str, str, str, str], str]) -> list[int | None]:
    """Where in `text` a mark placed in each assistant turn's content (`mark_content(leading
    whitespace, stripped content, trailing whitespace, mark)`) lands, in turn order: the
    conversation is rendered once with the marks, which must be the text itself once they are
    removed (a template that rewrites a reply otherwise cannot be followed). None for a turn that
    only calls tools: no text to mark (a mark would be content, which some templates write
    otherwise than none)."""
    contents = "".join(_content(message) for message in messages)
    mark = next(chr(code) for code in range(0xE000, 0xF900) if chr(code) not in contents)  # private use
    marked, unmarked = [], []  # unmarked: the assistant turns that only call tools, by their order
    for message in messages:
        if message["role"] == "assistant" and not _content(message).strip():
            unmarked.append(sum(m["role"] == "assistant" for m in marked))
        elif message["role"] == "assistant":
            content = message["content"]
            core = content.strip()
            lead = content[:len(content) - len(content.lstrip())]
            message = {**message, "content": mark_content(lead, core, content[len(lead) + len(core):], mark)}
        marked.append(message)
    out = _render_text(tokenizer, template, marked)
    places: list[int | None] = [n - k for k, n in enumerate(n for n, char in enumerate(out) if char == mark)]
    if (out.replace(mark, "") != text
            or len(places) + len(unmarked) != sum(m["role"] == "assistant" for m in messages)):
        raise ChatTemplateError("the chat template rewrites an assistant turn's text (or leaves one out), so "
                                "its trained tokens cannot be located; use a template that writes each reply "
                                "as it is, or one with {% generation %} markers")
    for position in unmarked:  # a turn with no text to mark: its span starts at its generation prompt
        places.insert(position, None)
    return places


def _content(message: Message) -> str:
    """A message's text; "" for an assistant turn that only calls tools (content None or absent)."""
    return message.get("content") or ""


@functools.lru_cache(maxsize=8)
def _end_of_turn_cached(tokenizer: PreTrainedTokenizerBase, template: str) -> str | None:
    return end_of_turn(tokenizer, template)


def _end_of_turn(tokenizer: PreTrainedTokenizerBase, template: str) -> str:
    try:
        token = _end_of_turn_cached(tokenizer, template)
    except TemplateError as err:
        raise ChatTemplateError(f"the chat template rejects a user turn and a reply: {err}") from None
    if token is None:
        raise ChatTemplateError("the chat template closes an assistant turn with no special token: nothing "
                                "would teach the model to stop; use a template with an end-of-turn token")
    return token


def _encode(tokenizer: PreTrainedTokenizerBase, text: str, messages: list[Message],
            ) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of `text`, the special tokens the template writes parsed as
    such, but a turn's content always tokenized as text: a reply that spells `<|im_end|>` must not
    train an end of turn in mid-reply, nor a user turn forge a header. Content without a special
    token's text is left to the whole text's tokenization (the same ids as transformers')."""
    specials = special_tokens(tokenizer)
    pieces, cursor, done = [], 0, 0  # pieces: (start, end, tokenized as text), in order
    for message in messages:
        content = _content(message)
        start = text.find(content, cursor) if content else -1
        forged = any(token in content for token in specials)
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


def _render_text(tokenizer: PreTrainedTokenizerBase, chat_template: str, messages: list[Message],
                 add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **TEMPLATE_VALUES)
    except TemplateError as err:  # raise_exception() in a template: a role or order it rejects
        roles = [message["role"] for message in messages]
        raise ChatTemplateError(f"the chat template rejects a conversation of roles {roles}: {err}") from None


def _check_turn(messages: list[Message], i: int) -> None:
    if not _content(messages[i]).strip() and not messages[i].get("tool_calls"):
        raise ChatTemplateError(f"assistant turn {i} is empty: there is nothing to learn from it; drop the "
                                "conversation or its empty turns")
    if i == 0:
        raise ChatTemplateError("the conversation starts with an assistant turn, which nothing prompts; "
                                "drop the conversation or give it a user turn first")


def _token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters overlap a span (spans and tokens are in order)."""
    mask = np.zeros(len(offsets), np.uint8)
    if not spans or not offsets:
        return mask
    starts, ends = np.array(offsets, np.int64).T
    for first, last in spans:
        mask[(starts < last) & (ends > first)] = 1
    return mask
