"""Conversations through a tokenizer's chat template, for a model that is an assistant: the
prompt a list of messages renders to, and the token the template closes an assistant's turn with
(generation stops there). Used by the lm-eval model class (eval/lm.py) and the registered pyfunc
model (tasks/register.py). A tokenizer carries its template in `chat_template.jinja` (or
`tokenizer_config.json`) beside `tokenizer.json`.
"""

from __future__ import annotations

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


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template closes an assistant's turn with (ChatML's <|im_end|>,
    Llama 3's <|eot_id|>): the first token after an assistant message's content. None without a
    template, or where a turn ends in plain text (a stop there would cut ordinary text)."""
    if not tokenizer.chat_template:
        return None
    conversation = [{"role": "user", "content": "How are you?"}, {"role": "assistant", "content": REPLY}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    after = tokenizer.encode(rendered[rendered.rindex(REPLY) + len(REPLY):], add_special_tokens=False)
    if after and (token := tokenizer.added_tokens_decoder.get(after[0])) is not None and token.special:
        return after[0]
    return None
