"""A small assistant for tests: a byte-level BPE tokenizer with ChatML's special tokens and chat
template (SmolLM2-Instruct's form), and a tiny randomly initialized model over its vocabulary."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from forgeline.configs.schema import ModelConfig
from forgeline.model.inference import save_bundle
from forgeline.model.transformer import Transformer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = ("Write a short poem about the sea. Answer in fewer than fifty words and use no commas. "
        "Respond in all lowercase letters; wrap the whole answer in double quotes. " * 4)


def save_chat_tokenizer(directory: Path, template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text encodes) with <|endoftext|> as EOS and, with a
    `template`, that chat template, saved to `directory`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIAL[0], pad_token=SPECIAL[0],
                                 additional_special_tokens=SPECIAL[1:])
    hf.chat_template = template
    hf.save_pretrained(directory)
    return hf


def random_model(vocab_size: int, max_seq_len: int, seed: int = 0) -> Transformer:
    model = Transformer(ModelConfig(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    ffn_dim=64, max_seq_len=max_seq_len))
    model.init_weights(seed)
    return model


def save_random_bundle(directory: Path, vocab_size: int, max_seq_len: int) -> Transformer:
    model = random_model(vocab_size, max_seq_len)
    save_bundle(model, directory)
    return model


def save_chat_export(root: Path) -> Path:
    """A Hugging Face export (model/hf.py) of a tiny random model with a ChatML tokenizer."""
    from forgeline.model.hf import export_hf

    tokenizer = save_chat_tokenizer(root / "tokenizer")
    return export_hf(random_model(len(tokenizer), max_seq_len=128), root / "tokenizer", root / "hf")


def greedy_reply(export: Path, text: str, max_new_tokens: int) -> str:
    """transformers' own greedy continuation of `text` by the export, stopped at EOS or the
    template's end-of-turn token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forgeline.eval.chat import end_of_turn_id

    model = AutoModelForCausalLM.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    eos = tokenizer.eos_token_id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=[eos, end_of_turn_id(tokenizer)],
                         pad_token_id=eos)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
