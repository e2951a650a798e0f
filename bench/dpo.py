"""bench/dpo: preference tuning (DPO) of a real pretrained Llama on real chat pairs -- forgeline's
preference step against TRL's DPOTrainer, full and LoRA, in one run.

    .venv/bin/python bench/dpo.py [--batch 2 --seq-len 512 --warmup 1 --steps 1 --rounds 4 --no-lora]

The model is SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32 (as bench/cpt.py loads it), with
configs/smollm2-sft.yaml's recipe and its `sft` section made a `preference` one (DPO, loss
sigmoid, beta 0.1; LoRA: the same rank, alpha and targets): AdamW's lr, betas, weight decay (not on
norms) and eps, the warmup + cosine schedule, gradient clipping at train.grad_clip; one process,
fp32, the same threads for both sides.

The pairs are real text, not real preferences: the benchmark measures speed, not learning. Each
is a Chit-Chat conversation's first exchange (the shipped `chitchat` source, in its order, cleaned
by the data stage's filters): its user turn the prompt, its reply the chosen one, and the first
reply of the next conversation the rejected one (a pair whose replies are the same is left out,
as the data stage drops it: no gradient). Each reply is rendered with its prompt through the base's
own chat template by tasks/data/chat.py `render` (the trained tokens are the reply and its
end-of-turn token), and the pairs are packed as the data stage packs them: a pair's chosen
sequence then its rejected one, whole, several pairs a row of data.seq_len + 1 tokens, the next
pair starting a row when it does not fit (tasks/data/work.py `pack_rows`), the rest of the row
EOS, masks 1 and 2 on the replies and 0 on each sequence's first token. A step takes `--batch`
rows, in order; both sides step on the same pairs:

    forgeline  build_model_parts with model.init_from + load_hf_weights, then build_train_step's
               TrainStep with the preference objective (a single-process gloo group), on the
               packed rows as DocumentBatches: document masking, positions from each sequence's
               start, only the replies' positions projected to the vocabulary
    TRL        DPOTrainer (loss_type sigmoid, the same beta) on AutoModelForCausalLM.from_pretrained
               of the same directory (a separate copy of the weights), its optimizer and schedule
               given: torch.optim.AdamW with the fused kernel forgeline uses and the same
               hyperparameters; each step's pairs as TRL's tokenized examples (prompt_ids and each
               reply's trained tokens: exactly forgeline's, cf. tests/preference.py trl_example),
               padded by the trainer's own collator, then its training_step (compute_loss and
               backward), its _clip_grad_norm, the optimizer and schedule steps, as Trainer's inner
               loop does; gradient_checkpointing off (TRL's default is on; forgeline recomputes
               nothing here)

Neither side runs a reference forward in a step: precomputed reference log-probabilities, before
any timing. forgeline's by TrainStep.target_log_probs on its model before its first step (as the
trainer does before training, kept per target as the batch's `reference`); TRL's with
`precompute_ref_log_probs=True`, by its own compute_ref_log_probs (what its precompute runs over
a dataset) on each step's padded batch, passed as `ref_chosen_logps`/`ref_rejected_logps`. With
LoRA the reference is the base -- forgeline's adapters at initialization (B = 0), TRL's disabled
-- the same numbers as the full model's on each side: each side's LoRA run takes its full run's,
its own computed on the first batch as a check. TRL's LoRA adapters (a peft_config of the same
rank, alpha and targets) are given forgeline's initial values, so both LoRA runs start from the
same weights.

Throughput counts the pairs' real tokens: each pair's prompt + reply, both sequences, as TRL's
examples hold them -- the same pairs each step on both sides, so the ratio is that of pairs/s.
Also reported: tokens/s with padding (forgeline's rows, batch x seq_len; TRL's padded batch).
Sanity check that both compute the same function: the first step's loss (log 2 on both, the
policy being its reference), the policy's mean summed log-probabilities of the chosen and
rejected replies (TRL's logps/* metrics) and the gradient norm before clipping, and the losses of
the later steps; and the references of the two sides, per reply. The full model's gradients
differ in one row of the tied embedding: transformers builds SmolLM2's embedding with padding_idx
= its pad_token_id, 2, which is <|im_end|> -- the end of every prompt turn --, so TRL's backward
leaves out that row's input-side gradient and forgeline's does not (measured on the first batch:
with padding_idx None the Hugging Face gradient is forgeline's within 1e-5); hence full-model
gradient norms ~1e-4 apart and later losses drifting apart, where LoRA's (the embedding frozen)
stay within ~1e-6.

After `--warmup` untimed steps each, rounds of `--steps` timed steps run each variant, the
order rotated each round to spread machine noise; reported per round and as medians: forgeline ÷
TRL (goal >= 1.1), LoRA ÷ LoRA. Batches are made and collated before the timing on both sides.
Writes bench/results/dpo.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from forgeline.configs.environment import apply_environment_defaults

apply_environment_defaults()  # before transformers is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
from cpt import (  # noqa: E402  (bench/, the script's own directory)
    MODEL_NAME,
    optimizer_like_forgeline,
    single_rank_group,
    smollm2_dir,
)
from datasets import Dataset  # noqa: E402
from results_file import write_results  # noqa: E402
from sft import SOURCE, cleaned_conversations, forgeline_step  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

from forgeline.configs import Config  # noqa: E402
from forgeline.configs.loader import load_config  # noqa: E402
from forgeline.model.lora import peft_config, peft_state_dict  # noqa: E402
from forgeline.model.training.loader import DocumentBatch  # noqa: E402
from forgeline.model.training.preference import (  # noqa: E402
    CHOSEN,
    REFERENCE,
    REJECTED,
    PairSums,
    counted,
    preference_targets,
)
from forgeline.model.training.step import TrainStep  # noqa: E402
from forgeline.tasks.data import work as w  # noqa: E402
from forgeline.tasks.data.build import chat_template_of, save_chat_tokenizer, tokenizer_source  # noqa: E402
from forgeline.tasks.data.chat import conversation_of, render  # noqa: E402
from forgeline.tasks.pretrained import resolve_base, with_base  # noqa: E402

SFT_CONFIG = "smollm2-sft.yaml"
VARIANTS = ("forgeline", "trl", "forgeline_lora", "trl_lora")


def preference_config(base_dir: Path, batch: int, seq_len: int, steps: int, lora: bool) -> Config:
    """smollm2-sft.yaml's recipe from the base, fp32, one process, its `sft` section made a
    `preference` one (DPO; sft.lora's adapters when `lora`). The config asks its sources for
    preference pairs: one placeholder `format: preference` source, never read (no data stage runs
    here; the pairs are made in this process)."""
    raw = load_config(SFT_CONFIG).model_dump(exclude_unset=True)
    sft = raw.pop("sft")
    raw["preference"] = {"loss": "sigmoid", **({"lora": sft["lora"]} if lora else {})}
    raw["data"]["sources"] = [{"kind": "files", "path": "chitchat-pairs.jsonl", "format": "preference"}]
    cfg = Config.model_validate(raw).with_values({
        "model.init_from": str(base_dir), "parallel.dp_shard": 1, "train.precision": "fp32",
        "train.global_batch_size": batch, "train.steps": steps + 10, "data.seq_len": seq_len,
    })
    return with_base(cfg, resolve_base(cfg))


@dataclass(frozen=True)
class RenderedPair:
    """A pair's two sequences, prompt + reply each, as the chat template writes them, with the
    masks of the replies' trained tokens."""

    chosen: np.ndarray  # (n,) token ids
    chosen_mask: np.ndarray  # (n,) uint8, 1 on the reply's trained tokens
    rejected: np.ndarray
    rejected_mask: np.ndarray

    def trl_example(self) -> dict[str, list[int]]:
        """TRL's tokenized example: the prompt (the tokens before the reply) and each reply's
        trained tokens -- the reply and its end-of-turn token, not what the template writes after."""
        start = int(np.argmax(self.chosen_mask))
        return {"prompt_ids": self.chosen[:start].tolist(),
                "chosen_ids": self.chosen[start:start + int(self.chosen_mask.sum())].tolist(),
                "rejected_ids": self.rejected[start:start + int(self.rejected_mask.sum())].tolist()}

    @property
    def tokens(self) -> int:
        """Its real tokens: the prompt and each reply, both sequences, as TRL's example holds them."""
        example = self.trl_example()
        return 2 * len(example["prompt_ids"]) + len(example["chosen_ids"]) + len(example["rejected_ids"])


def first_exchanges(cfg: Config) -> Iterator[tuple[str, str]]:
    """(user turn, reply) of each cleaned Chit-Chat conversation that opens with one, in order."""
    for text in cleaned_conversations(cfg):
        messages = conversation_of(text)
        if len(messages) >= 2 and [m["role"] for m in messages[:2]] == ["user", "assistant"]:
            yield messages[0]["content"], messages[1]["content"]


def chitchat_pairs(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> Iterator[RenderedPair]:
    """Pairs of a conversation's first reply (chosen) and the next conversation's (rejected), each
    rendered with the prompt through the chat template; those whose replies are the same, or
    whose two sequences do not fit in a row, left out."""
    exchanges = first_exchanges(cfg)
    (prompt, chosen), row_tokens = next(exchanges), cfg.data.seq_len + 1
    for next_prompt, rejected in exchanges:
        if chosen.strip() != rejected.strip():
            sides = [render(tokenizer, [{"role": "user", "content": prompt},
                                        {"role": "assistant", "content": reply}], train_on="last_assistant")
                     for reply in (chosen, rejected)]
            pair = RenderedPair(sides[0].ids, sides[0].mask, sides[1].ids, sides[1].mask)
            start = int(np.argmax(pair.chosen_mask))
            shared = start == int(np.argmax(pair.rejected_mask)) and np.array_equal(
                pair.chosen[:start], pair.rejected[:start])
            if shared and len(pair.chosen) + len(pair.rejected) <= row_tokens:
                yield pair
        prompt, chosen = next_prompt, rejected


def packed_rows(pairs: list[RenderedPair], row_tokens: int, pad_id: int,
                ) -> list[tuple[DocumentBatch, int, int]]:
    """The pairs packed as the data stage packs them (`pack_rows` of each pair's two sequences),
    every row but a last, partly filled one: per row its (1, row_tokens) DocumentBatch as the
    trainer's loader gives it (documents numbered from 1 at each sequence's start, the padding the
    last one's), and its first pair and the one after its last."""
    firsts = w.pack_rows(np.array([len(p.chosen) + len(p.rejected) for p in pairs]), row_tokens)
    rows = []
    for first, end in itertools.pairwise(firsts[:-1].tolist()):
        pieces = [(ids, mask * side) for pair in pairs[first:end]
                  for ids, mask, side in ((pair.chosen, pair.chosen_mask, CHOSEN),
                                          (pair.rejected, pair.rejected_mask, REJECTED))]
        tokens = np.full(row_tokens, pad_id, np.int64)
        sides, starts = np.zeros(row_tokens, np.uint8), np.zeros(row_tokens, np.int32)
        at = 0
        for ids, mask in pieces:
            tokens[at:at + len(ids)], sides[at:at + len(ids)] = ids, mask
            sides[at], starts[at] = 0, 1  # nothing in its own sequence predicts a sequence's first token
            at += len(ids)
        side = torch.from_numpy(sides)[None]
        documents = torch.from_numpy(np.cumsum(starts, dtype=np.int32))[None]
        batch = DocumentBatch(torch.from_numpy(tokens)[None], documents, side > 0, side)
        rows.append((batch, first, end))
    return rows


def step_batches(pairs: Iterator[RenderedPair], rows_per_step: int, steps: int, row_tokens: int, pad_id: int,
                 ) -> list[tuple[DocumentBatch, list[RenderedPair]]]:
    """`steps` batches of `rows_per_step` packed rows each, and the pairs each holds, in order."""
    wanted, taken = rows_per_step * steps, []
    while True:  # more pairs until they fill the rows
        taken += list(itertools.islice(pairs, max(len(taken), 64)))
        rows = packed_rows(taken, row_tokens, pad_id)
        if len(rows) >= wanted:
            break
    out = []
    for index in range(steps):
        mine = rows[index * rows_per_step:(index + 1) * rows_per_step]
        batch = DocumentBatch(*(torch.cat([getattr(row, name) for row, _, _ in mine])
                                for name in ("tokens", "documents", "loss_mask", "sides")))
        out.append((batch, taken[mine[0][1]:mine[-1][2]]))
    return out


def reference_sums(batch: DocumentBatch) -> torch.Tensor:
    """(P, 2) float64: each pair's summed reference log-probabilities, chosen then rejected."""
    targets = preference_targets(batch.tokens, batch.documents, batch.sides, batch.reference)
    wanted = targets[counted(targets)]
    return PairSums.of(wanted[:, REFERENCE], wanted).reference


def trainable_model(base_dir: Path) -> torch.nn.Module:
    """The base as transformers loads it for training: the converted directory's config.json
    keeps the GGUF's `quantization_config` (its weights are plain fp32 safetensors), which makes
    Trainer refuse the model as "purely quantized"; without it the same weights load as a plain
    model (bench/cpt.py's `transformers_model` loads them with it, outside a Trainer)."""
    config = AutoConfig.from_pretrained(base_dir)
    del config.quantization_config
    return AutoModelForCausalLM.from_pretrained(str(base_dir), config=config, dtype=torch.float32)


def trl_trainer(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, cfg: Config, out_dir: Path,
                lora: bool) -> DPOTrainer:
    """TRL's DPOTrainer of `model` with cfg's beta, fused AdamW and schedule, reference
    log-probabilities precomputed. Its train_dataset is one pair of text only: its constructor
    tokenizes and precomputes over it; the benchmark gives each step its tokens itself."""
    args = DPOConfig(output_dir=str(out_dir), beta=cfg.preference.beta, loss_type=["sigmoid"],
                     precompute_ref_log_probs=True, gradient_checkpointing=False, report_to=[], use_cpu=True,
                     bf16=False, disable_dropout=True, max_grad_norm=cfg.train.grad_clip,
                     learning_rate=cfg.train.lr, seed=cfg.train.seed)
    texts = Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}],
                                "chosen": [{"role": "assistant", "content": "hello"}],
                                "rejected": [{"role": "assistant", "content": "bye"}]}])
    extra = {}
    if lora:
        adapters = peft_config(cfg.preference.lora, None)
        extra["peft_config"] = dataclasses.replace(adapters, inference_mode=False)
    trainer = DPOTrainer(model=model, args=args, train_dataset=texts, processing_class=tokenizer, **extra)
    trainer.optimizer, trainer.lr_scheduler = optimizer_like_forgeline(trainer.model, cfg)
    trainer.current_gradient_accumulation_steps = 1  # what its inner loop sets before a step
    return trainer


def trl_inputs(trainer: DPOTrainer, pairs: list[RenderedPair]) -> dict[str, torch.Tensor]:
    """A step's pairs padded by the trainer's collator, with their reference log-probabilities
    (its compute_ref_log_probs, what precompute_ref_log_probs runs: the model as it is now)."""
    examples = [pair.trl_example() for pair in pairs]
    padded = trainer.data_collator(examples)
    chosen, rejected = trainer.compute_ref_log_probs(trainer.model, padded)
    for example, ref_chosen, ref_rejected in zip(examples, chosen.tolist(), rejected.tolist(), strict=True):
        example["ref_chosen_logps"], example["ref_rejected_logps"] = ref_chosen, ref_rejected
    return trainer.data_collator(examples)


def trl_step(trainer: DPOTrainer, inputs: dict[str, torch.Tensor]) -> dict[str, float]:
    """One update as Trainer's inner loop makes it (one micro-batch): training_step (the DPO loss and
    its backward), the gradient clipped to args.max_grad_norm (its _clip_grad_norm), the optimizer
    and schedule steps, the gradients dropped. Its loss, norm before clipping and TRL's metrics."""
    loss = trainer.training_step(trainer.model, inputs)
    norm = trainer._clip_grad_norm(trainer.model)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.model.zero_grad()
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    trainer._metrics["train"].clear()
    return {"loss": loss.item(), "grad_norm": norm.item(), **metrics}


def lora_like_forgeline(trainer: DPOTrainer, forgeline_model: torch.nn.Module) -> None:
    """TRL's adapters given the values of forgeline's (at their initialization), by peft's names."""
    adapters = {name.replace(".default", ""): param for name, param in trainer.model.named_parameters()
                if param.requires_grad}
    ours = peft_state_dict(forgeline_model)
    if set(ours) != set(adapters):
        raise ValueError(f"adapters differ: {sorted(set(ours) ^ set(adapters))[:4]}")
    with torch.no_grad():
        for name, value in ours.items():
            adapters[name].copy_(value)


def relative_gap(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def rotated(round_index: int, variants: tuple[str, ...]) -> list[str]:
    shift = round_index % len(variants)
    return [*variants[shift:], *variants[:shift]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2, help="packed rows a step (forgeline's global batch)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each before the rounds")
    parser.add_argument("--steps", type=int, default=1, help="timed steps of each per round")
    parser.add_argument("--rounds", type=int, default=4, help="each variant first, second, ... once in 4")
    parser.add_argument("--no-lora", action="store_true", help="full fine-tuning only")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    variants = VARIANTS[:2] if args.no_lora else VARIANTS

    base_dir = smollm2_dir()
    total_steps = args.warmup + args.rounds * args.steps
    cfg = preference_config(base_dir, args.batch, args.seq_len, total_steps, lora=False)
    lora_cfg = preference_config(base_dir, args.batch, args.seq_len, total_steps, lora=True)
    tmp = tempfile.TemporaryDirectory(prefix="bench-dpo-")
    started = time.perf_counter()
    out = Path(tmp.name)
    tokenizer = save_chat_tokenizer(tokenizer_source(cfg), chat_template_of(cfg), out / "tokenizer")
    batches = step_batches(chitchat_pairs(cfg, tokenizer), args.batch, total_steps, args.seq_len + 1,
                           tokenizer.eos_token_id)
    data_s = time.perf_counter() - started

    device, _, _ = single_rank_group()
    steps: dict[str, TrainStep] = {"forgeline": forgeline_step(cfg, device)}
    trainers = {"trl": trl_trainer(trainable_model(base_dir), tokenizer, cfg, out / "trl", lora=False)}
    if not args.no_lora:
        steps["forgeline_lora"] = forgeline_step(lora_cfg, device)
        trainers["trl_lora"] = trl_trainer(trainable_model(base_dir), tokenizer, lora_cfg, out / "trl_lora",
                                           lora=True)
        lora_like_forgeline(trainers["trl_lora"], steps["forgeline_lora"].parts[0])

    # The references, before any step and any timing.
    started = time.perf_counter()
    for batch, _ in batches:
        batch.reference = steps["forgeline"].target_log_probs(batch)
    reference_checks = {}
    if not args.no_lora:  # the base plus adapters at B = 0: the same log-probabilities
        lora_reference = steps["forgeline_lora"].target_log_probs(batches[0][0])
        reference_checks["forgeline_lora_vs_full_max_abs"] = float((lora_reference - batches[0][0].reference)
                                                                   .abs().max())
    inputs = {"trl": [trl_inputs(trainers["trl"], pairs) for _, pairs in batches]}
    references = {"trl": inputs["trl"][0]}
    if not args.no_lora:  # the base, its adapters disabled: the same inputs, checked on the first batch
        inputs["trl_lora"] = inputs["trl"]
        references["trl_lora"] = trl_inputs(trainers["trl_lora"], batches[0][1])
    reference_s = time.perf_counter() - started
    ours = reference_sums(batches[0][0])
    for which, first_inputs in references.items():
        theirs = torch.stack([first_inputs["ref_chosen_logps"], first_inputs["ref_rejected_logps"]], dim=1)
        reference_checks[f"forgeline_vs_{which}_max_abs"] = float((ours - theirs.double()).abs().max())
    reference_checks["first_batch_mean_chosen"] = float(ours[:, 0].mean())

    def run(which: str, indexes: range) -> tuple[list[float], list[dict[str, float]]]:
        times, results = [], []
        for index in indexes:
            started = time.perf_counter()
            if which.startswith("trl"):
                results.append(trl_step(trainers[which], inputs[which][index]))
            else:
                result = steps[which](batches[index][0])
                results.append({"loss": result.loss, "grad_norm": result.grad_norm, **result.metrics})
            times.append(time.perf_counter() - started)
        return times, results

    records = {which: run(which, range(args.warmup))[1] for which in variants}
    real = [sum(pair.tokens for pair in pairs) for _, pairs in batches]
    padded = {"forgeline": args.batch * args.seq_len,
              "trl": [int(step["input_ids"].numel()) for step in inputs["trl"]]}
    tps: dict[str, list[float]] = {which: [] for which in variants}
    padded_tps: dict[str, list[float]] = {"forgeline": [], "trl": []}
    rounds = []
    for round_index in range(args.rounds):
        first = args.warmup + round_index * args.steps
        indexes = range(first, first + args.steps)
        round_load = os.getloadavg()[0]
        for which in rotated(round_index, variants):
            times, results = run(which, indexes)
            records[which] += results
            seconds = sum(times)
            tps[which].append(sum(real[i] for i in indexes) / seconds)
            if which == "forgeline":
                padded_tps[which].append(padded[which] * len(indexes) / seconds)
            elif which == "trl":
                padded_tps[which].append(sum(padded[which][i] for i in indexes) / seconds)
        rounds.append({"order": rotated(round_index, variants),
                       "load_avg_1min_at_start": round(round_load, 2),
                       **{f"{which}_tokens_per_s": round(tps[which][-1], 1) for which in variants},
                       "forgeline_over_trl": round(tps["forgeline"][-1] / tps["trl"][-1], 4)})

    def ratios(a: str, b: str) -> list[float]:
        return [round(x / y, 4) for x, y in zip(tps[a], tps[b], strict=True)]

    median = {which: statistics.median(values) for which, values in tps.items()}
    first = {which: values[0] for which, values in records.items()}
    checked = ("loss", "grad_norm", "logps/chosen", "logps/rejected")
    pairs_per_step = [len(pairs) for _, pairs in batches]
    results = {
        "model": MODEL_NAME, "params": cfg.model.num_params(), "threads": args.threads,
        "batch_rows": args.batch, "seq_len": args.seq_len, "warmup_steps": args.warmup, "steps": args.steps,
        "rounds": args.rounds, "beta": cfg.preference.beta, "lr": cfg.train.lr,
        "grad_clip": cfg.train.grad_clip,
        "data": {
            "source": SOURCE, "pairs": sum(pairs_per_step), "pairs_per_step": pairs_per_step,
            "pairs_per_row": round(sum(pairs_per_step) / (args.batch * total_steps), 2),
            "real_tokens_per_step": real,
            "forgeline_row_fill": round(statistics.mean(real) / padded["forgeline"], 4),
            "trl_padded_tokens_per_step": padded["trl"],
            "trl_padding_fill": round(
                statistics.mean(r / p for r, p in zip(real, padded["trl"], strict=True)), 4),
            "trained_token_share_of_forgeline_positions": round(float(torch.cat(
                [batch.sides[:, 1:] > 0 for batch, _ in batches]).float().mean()), 4),
            "prepare_s": round(data_s, 1), "references_s": round(reference_s, 1),
        },
        "unit": "real tokens/s: each pair's prompt + reply, both sequences, as TRL's examples hold them",
        "forgeline_tokens_per_s": round(median["forgeline"], 1),
        "trl_tokens_per_s": round(median["trl"], 1),
        "forgeline_over_trl": round(median["forgeline"] / median["trl"], 4),
        "per_round_ratios": ratios("forgeline", "trl"),
        "forgeline_padded_tokens_per_s": round(statistics.median(padded_tps["forgeline"]), 1),
        "trl_padded_tokens_per_s": round(statistics.median(padded_tps["trl"]), 1),
        "rounds_detail": rounds,
        "first_step": {which: {name: round(value[name], 6) for name in checked}
                       for which, value in first.items()},
        "first_step_relative_gap": {
            f"{a}_vs_{b}": {name: relative_gap(first[a][name], first[b][name]) for name in checked}
            for a, b in (("forgeline", "trl"), ("forgeline_lora", "trl_lora")) if a in first},
        "reference_checks": reference_checks,
        "losses": {which: [round(r["loss"], 6) for r in values] for which, values in records.items()},
        "grad_norms": {which: [round(r["grad_norm"], 6) for r in values]
                       for which, values in records.items()},
        "load_avg_start": [round(x, 2) for x in load_start],
    }
    if not args.no_lora:
        results |= {
            "lora": lora_cfg.preference.lora.model_dump(mode="json"),
            "forgeline_lora_tokens_per_s": round(median["forgeline_lora"], 1),
            "trl_lora_tokens_per_s": round(median["trl_lora"], 1),
            "forgeline_lora_over_trl_lora": round(median["forgeline_lora"] / median["trl_lora"], 4),
            "lora_per_round_ratios": ratios("forgeline_lora", "trl_lora"),
            "trained_params": {which: sum(p.numel() for p in (steps[which].parts[0] if which in steps
                                                               else trainers[which].model).parameters()
                                          if p.requires_grad) for which in variants},
        }
    results["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    tmp.cleanup()
    write_results("dpo", results)


if __name__ == "__main__":
    main()
