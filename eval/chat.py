"""Conversations through a tokenizer's chat template, for a model that is an assistant: the
prompt a list of messages renders to, and the token the template closes an assistant's turn with
-- the one definition of it: generation stops there (the lm-eval model class, eval/lm.py; the
registered pyfunc model, tasks/register.py; `forgeline chat`, flows/chat.py) and the fine-tuning
loss mask ends there (tasks/data/chat.py). A tokenizer carries its template in
`chat_template.jinja` (or `tokenizer_config.json`) beside `tokenizer.json`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, str]]
REPLY = "Fine."  # an assistant message whose end shows how the template closes a turn


class ChatTemplateError(ValueError):
    """Messages for a tokenizer that has no chat template."""


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Messages, add_generation_prompt: bool = True,
                where: str = "the tokenizer") -> str:
    """`messages` ({role, content} dicts) as the prompt text the template makes of them, opening
    the assistant's turn (add_generation_prompt) or continuing the last message (without)."""
    if not tokenizer.chat_template:
        raise ChatTemplateError(f"{where} has no chat template, so it cannot render messages: send a "
                                "plain prompt, or evaluate and serve a model whose tokenizer has one (an sft "
                                "run's: data.chat_template)")
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=not add_generation_prompt)


def special_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The text of the tokenizer's special tokens (control tokens: a template's headers and ends)."""
    return tuple(token.content for token in tokenizer.added_tokens_decoder.values() if token.special)


def end_of_turn(tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None) -> str | None:
    """The special token the chat template (`chat_template`, else the tokenizer's) closes an
    assistant's turn with: the first one after an assistant message's content, past the
    whitespace some templates write before it (Llama 2's ' </s>') -- ChatML's <|im_end|>, Llama
    3's <|eot_id|>, Mistral's </s>, Phi-3's <|end|>, Gemma's <end_of_turn>. None without a
    template, or where a turn ends in plain text (a stop there would cut ordinary text)."""
    if not (chat_template or tokenizer.chat_template):
        return None
    conversation = [{"role": "user", "content": "How are you?"}, {"role": "assistant", "content": REPLY}]
    rendered = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False)
    after = rendered[rendered.rindex(REPLY) + len(REPLY):].lstrip()
    found = [token for token in special_tokens(tokenizer) if after.startswith(token)]
    return max(found, key=len) if found else None


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The id of the tokenizer's template's `end_of_turn` token: where generation stops, beside EOS."""
    token = end_of_turn(tokenizer)
    return None if token is None else tokenizer.convert_tokens_to_ids(token)
