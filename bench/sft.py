"""bench/sft: supervised fine-tuning of a real pretrained Llama on real conversations -- forgeline's
SFT step against a plain transformers training loop, and LoRA against full fine-tuning, in one run.

    .venv/bin/python bench/sft.py [--batch 2 --seq-len 512 --warmup 1 --steps 2 --rounds 3]

The model is SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32 (as bench/cpt.py loads it), with
configs/smollm2-sft.yaml's recipe: AdamW's lr, betas, weight decay (not on norms) and eps, the
warmup + cosine schedule, gradient clipping at train.grad_clip; one process, fp32, the same threads.

The data is what the sft stage trains on: the Chit-Chat Challenge's conversations (the shipped
`chitchat` source), in its order, cleaned by the data stage's filters (clean_conversation), rendered
through the base's own chat template with their assistant-only loss masks (tasks/data/chat.py, by
work.render_piece), packed several to a row of seq_len + 1 tokens and written to shards by the
data stage's own functions (write_packing, write_shard_group), read back by the trainer's loader
as DocumentBatches (tokens, each token's conversation, the loss mask). Not deduplicated or mixed:
enough conversations from the file's start to fill the rows the run needs. Both sides step on the
same rows:

    forgeline     build_model_parts with model.init_from + load_hf_weights, then build_train_step's
                  TrainStep (a single-process gloo group): document masking, positions counted from
                  each conversation's start, loss on the masked targets (their sum over their count)
    transformers  AutoModelForCausalLM.from_pretrained(dir, dtype=float32) + torch.optim.AdamW (its
                  fused kernel, as forgeline's: bench/cpt.py), on the same packed rows:
                  position_ids reset at each conversation, a (B, 1, T, T) boolean attention
                  mask, causal within each conversation and blocking every other
                  (transformers uses a 4-D mask as given), labels = -100 outside the loss mask and
                  cross-entropy's mean over the rest (their sum over their count)

Packed rather than padded rows: packing is what the sft stage trains on, so the baseline does the
same work on the same tokens, and its masks make every conversation see only itself, as forgeline's
document masking does: the two compute the same function, so their first-step losses must agree
(reported, with LoRA's: its B = 0 starts it at the base too). tokens/s counts every token of a row
for both (B x seq_len per step, padding included): the same work.

After `--warmup` untimed steps each, rounds of `--steps` timed steps run forgeline (full), the
transformers loop and forgeline with LoRA (smollm2-sft.yaml's sft.lora: rank, alpha, targets), the
order rotated each round to spread machine noise; reported: median tokens/s of each, forgeline ÷
transformers (target >= 1.1) and LoRA ÷ full.

Memory, LoRA vs full, each in a fresh process (no memory the other freed to reuse), on the run's
first two batches: the bytes of the optimizer's state tensors after the steps (AdamW's two moments
per trained parameter, and its step counters), the trained parameters, and the peak RSS increase
over the two steps above the RSS before them (VmHWM reset after loading, by /proc/self/clear_refs;
the first step allocates gradients and the optimizer state), and what stays after them. Writes
bench/results/sft.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from forgeline.configs.environment import apply_environment_defaults

apply_environment_defaults()  # before transformers is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from cpt import (  # noqa: E402  (bench/, the script's own directory)
    MB,
    MODEL_NAME,
    PeakSampler,
    forgeline_model,
    optimizer_like_forgeline,
    single_rank_group,
    smollm2_dir,
    transformers_model,
)
from results_file import write_results  # noqa: E402
from torch.optim.lr_scheduler import LambdaLR  # noqa: E402

from forgeline.configs import Config  # noqa: E402
from forgeline.configs.loader import load_config  # noqa: E402
from forgeline.model.parallel.mesh import build_meshes  # noqa: E402
from forgeline.model.training.loader import DocumentBatch, ShardedSampleLoader  # noqa: E402
from forgeline.model.training.shards import ShardInfo  # noqa: E402
from forgeline.model.training.step import IGNORED, TrainStep  # noqa: E402
from forgeline.model.training.worker import build_train_step  # noqa: E402
from forgeline.tasks.data import work as w  # noqa: E402
from forgeline.tasks.data.build import (  # noqa: E402
    build_tokenizer,
    chat_template_of,
    save_chat_tokenizer,
    shard_groups,
    tokenizer_source,
    vocab_dtype,
)
from forgeline.tasks.data.clean import clean_conversation  # noqa: E402
from forgeline.tasks.data.sources import read_chitchat  # noqa: E402
from forgeline.tasks.pretrained import resolve_base, with_base  # noqa: E402

SFT_CONFIG = "smollm2-sft.yaml"
SOURCE = "chitchat"
VARIANTS = ("forgeline", "transformers", "forgeline_lora")


def sft_config(base_dir: Path, batch: int, seq_len: int, steps: int, lora: bool) -> Config:
    """smollm2-sft.yaml's recipe from the base, fp32, one process; without sft.lora unless `lora`."""
    values = {
        "model.init_from": str(base_dir), "parallel.dp_shard": 1, "train.precision": "fp32",
        "train.global_batch_size": batch, "train.steps": steps + 10, "data.seq_len": seq_len,
    }
    if not lora:
        values["sft.lora"] = None
    cfg = load_config(SFT_CONFIG).with_values(values)
    return with_base(cfg, resolve_base(cfg))


def cleaned_conversations(cfg: Config) -> Iterator[str]:
    """The shipped source's conversations the data stage's filters keep, in the file's order."""
    for raw in read_chitchat(SOURCE):
        cleaned = clean_conversation(raw.data, cfg.data.cleaning, with_signature=False)
        if cleaned.removed_by is None:
            yield cleaned.text


def packed_shards(cfg: Config, rows: int, directory: Path) -> tuple[list[ShardInfo], int]:
    """Shards of at least `rows` rows of conversations, rendered and packed by the data stage's
    functions in `directory`; and the conversations they hold."""
    work_dir = directory / ".work"
    (work_dir / "tokens").mkdir(parents=True)
    source = tokenizer_source(cfg)
    save_chat_tokenizer(source, chat_template_of(cfg), directory / "tokenizer")
    tokenizer, eos_id = build_tokenizer(cfg.data, source, iter(()))
    plan = w.Plan(work_dir=str(work_dir), raw_dir="", cleaning=cfg.data.cleaning, labels=(SOURCE,),
                  weights=(1.0,), val_fraction=cfg.data.val_fraction, buckets=1, partition_firsts=(0,),
                  conversations=True)
    row_tokens = cfg.data.seq_len + 1
    piece = w.PieceWork(0, "train", 1, "", eos_id, np.dtype(vocab_dtype(tokenizer)).str, plan,
                        w.ChatWork(str(directory / "tokenizer"), row_tokens))
    packing = work_dir / "packing-train"
    wanted = 4 * rows
    while True:  # twice the conversations until they fill the rows
        texts = list(itertools.islice(cleaned_conversations(cfg), wanted))
        names = [f"{SOURCE} conversation {n}" for n in range(len(texts))]
        w.render_piece(piece, [(text, 0) for text in texts], names)
        samples = w.write_packing(packing, (str(piece.stem),), row_tokens)
        if samples >= rows:
            break
        if len(texts) < wanted:
            sys.exit(f"the {SOURCE} source fills {samples} rows of {row_tokens} tokens, fewer than the "
                     f"{rows} asked for; lower --batch or the steps")
        wanted *= 2
    groups = shard_groups("train", (str(piece.stem),), samples, cfg.data, directory, 1, str(packing), eos_id)
    entries = [entry for group in groups for entry in w.write_shard_group(group)[0]]
    shards = [ShardInfo(directory / e["path"], e["samples"], e["sha256"], loss_masks=True) for e in entries]
    return shards, len(texts)


def sft_batches(cfg: Config, count: int, directory: Path) -> tuple[list[DocumentBatch], int]:
    """`count` distinct batches as the trainer's loader reads them, and the conversations rendered."""
    batch = cfg.train.global_batch_size
    shards, conversations = packed_shards(cfg, count * batch, directory)
    loader = ShardedSampleLoader(shards, batch, dp_rank=0, dp_size=1, seed=cfg.train.seed,
                                 document_starts=cfg.masks_documents)
    return [loader.next_batch() for _ in range(count)], conversations


def packed_inputs(batch: DocumentBatch) -> dict[str, torch.Tensor]:
    """transformers' inputs for packed rows: (B, T) input ids, positions from each conversation's
    first token, and the (B, 1, T, T) mask letting a token see the earlier tokens of its own
    conversation only."""
    documents = batch.documents[:, :-1]  # (B, T)
    index = torch.arange(documents.size(1))
    begins = torch.ones_like(documents, dtype=torch.bool)
    begins[:, 1:] = documents[:, 1:] != documents[:, :-1]
    positions = index - torch.where(begins, index, 0).cummax(dim=1).values  # (B, T)
    causal = torch.ones(documents.size(1), documents.size(1), dtype=torch.bool).tril()  # (T, T)
    mask = (documents[:, :, None] == documents[:, None, :]) & causal  # (B, T, T)
    return {"input_ids": batch.tokens[:, :-1], "position_ids": positions, "attention_mask": mask[:, None]}


def plain_sft_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: LambdaLR,
                   batch: DocumentBatch, grad_clip: float) -> float:
    """The textbook transformers SFT step on a packed (B, T + 1) batch: labels -100 outside the mask."""
    labels = batch.tokens[:, 1:].masked_fill(~batch.loss_mask[:, 1:], IGNORED)  # (B, T)
    logits = model(**packed_inputs(batch), use_cache=False).logits  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORED)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    schedule.step()
    return loss.item()


def forgeline_step(cfg: Config, device: torch.device) -> TrainStep:
    """The sft stage's step for `cfg` on the one rank of this process, from the base's weights."""
    mesh, dp_mesh = build_meshes(cfg.parallel, 1, device.type)
    parts = forgeline_model(cfg, mesh, device)
    return build_train_step(cfg, mesh, dp_mesh, parts, device, torch.float32)


def optimizer_state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    return sum(value.numel() * value.element_size() for optimizer in optimizers
               for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value))


def measure_memory(variant: str, base_dir: Path, batches_file: Path, seq_len: int) -> None:
    """The child process of the memory figures: a step of `variant` built, then its steps on the
    saved batches under the peak sampler; the figures as a JSON line."""
    batches = [DocumentBatch(*tensors) for tensors in torch.load(batches_file)]
    cfg = sft_config(base_dir, batches[0].tokens.size(0), seq_len, len(batches), lora=variant == "lora")
    device, _, _ = single_rank_group()
    train_step = forgeline_step(cfg, device)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to VmRSS: the peak of the steps alone
    with PeakSampler() as stepping:
        for batch in batches:
            train_step(batch)
    params = [p for part in train_step.parts for p in part.parameters()]
    trained = [p for p in params if p.requires_grad]
    print(json.dumps({
        "params": sum(p.numel() for p in params), "trained_params": sum(p.numel() for p in trained),
        "optimizer_state_mb": round(optimizer_state_bytes(train_step.optimizers) / MB, 3),
        "trained_param_mb": round(sum(p.numel() * p.element_size() for p in trained) / MB, 3),
        "steps": len(batches), "memory": stepping.increases(),
    }))


def memory_figures(base_dir: Path, batches_file: Path, seq_len: int, threads: int) -> dict[str, dict]:
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    out = {}
    for variant in ("full", "lora"):
        command = [sys.executable, __file__, "--measure-memory", variant, "--base", str(base_dir),
                   "--batches-file", str(batches_file), "--seq-len", str(seq_len), "--threads", str(threads)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
        out[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def rotated(round_index: int) -> list[str]:
    shift = round_index % len(VARIANTS)
    return [*VARIANTS[shift:], *VARIANTS[:shift]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each before the rounds")
    parser.add_argument("--steps", type=int, default=2, help="timed steps of each per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--measure-memory", choices=["full", "lora"], help=argparse.SUPPRESS)
    parser.add_argument("--base", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--batches-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.measure_memory:
        measure_memory(args.measure_memory, args.base, args.batches_file, args.seq_len)
        return

    base_dir = smollm2_dir()
    total_steps = args.warmup + args.rounds * args.steps
    cfg = sft_config(base_dir, args.batch, args.seq_len, total_steps, lora=False)
    lora_cfg = sft_config(base_dir, args.batch, args.seq_len, total_steps, lora=True)
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        started = time.perf_counter()
        batches, conversations = sft_batches(cfg, total_steps, Path(tmp))
        data_s = time.perf_counter() - started
        batches_file = Path(tmp) / "batches.pt"
        torch.save([(b.tokens, b.documents, b.loss_mask) for b in batches[:2]], batches_file)
        memory = memory_figures(base_dir, batches_file, args.seq_len, args.threads)

    device, _, _ = single_rank_group()
    steps = {"forgeline": forgeline_step(cfg, device), "forgeline_lora": forgeline_step(lora_cfg, device)}
    hf_model = transformers_model(base_dir).train()
    optimizer, schedule = optimizer_like_forgeline(hf_model, cfg)

    def run(which: str, indexes: range) -> tuple[list[float], list[float]]:
        times, losses = [], []
        for index in indexes:
            started = time.perf_counter()
            batch = batches[index]
            if which == "transformers":
                losses.append(plain_sft_step(hf_model, optimizer, schedule, batch, cfg.train.grad_clip))
            else:
                losses.append(steps[which](batch).loss)
            times.append(time.perf_counter() - started)
        return times, losses

    losses = {which: run(which, range(args.warmup))[1] for which in VARIANTS}
    tokens_per_step = args.batch * args.seq_len
    tps: dict[str, list[float]] = {which: [] for which in VARIANTS}
    for round_index in range(args.rounds):
        first = args.warmup + round_index * args.steps
        for which in rotated(round_index):
            times, round_losses = run(which, range(first, first + args.steps))
            tps[which].append(tokens_per_step / statistics.median(times))
            losses[which] += round_losses

    median = {which: statistics.median(values) for which, values in tps.items()}
    first_loss = {which: values[0] for which, values in losses.items()}
    results = {
        "model": MODEL_NAME, "params": cfg.model.num_params(), "threads": args.threads,
        "batch": args.batch, "seq_len": args.seq_len, "warmup_steps": args.warmup, "steps": args.steps,
        "rounds": args.rounds,
        "data": {
            "source": SOURCE, "conversations_rendered": conversations, "rows": args.batch * total_steps,
            "conversations_per_row": round(
                float(torch.cat([batch.documents[:, -1] for batch in batches]).float().mean()), 2),
            "loss_token_share": round(
                float(torch.cat([batch.loss_mask[:, 1:] for batch in batches]).float().mean()), 4),
            "prepare_s": round(data_s, 1),
        },
        "baseline": "the same packed rows: position_ids reset per conversation, a (B, 1, T, T) "
                    "block-diagonal causal mask",
        "forgeline_tokens_per_s": round(median["forgeline"], 1),
        "transformers_tokens_per_s": round(median["transformers"], 1),
        "forgeline_over_transformers": round(median["forgeline"] / median["transformers"], 4),
        "per_round_ratios": [round(a / b, 4)
                             for a, b in zip(tps["forgeline"], tps["transformers"], strict=True)],
        "lora_tokens_per_s": round(median["forgeline_lora"], 1),
        "lora_over_full_tokens_per_s": round(median["forgeline_lora"] / median["forgeline"], 4),
        "lora_per_round_ratios": [round(a / b, 4)
                                  for a, b in zip(tps["forgeline_lora"], tps["forgeline"], strict=True)],
        "lora": lora_cfg.sft.lora.model_dump(mode="json"),
        "first_loss": {which: round(value, 5) for which, value in first_loss.items()},
        "first_loss_relative_gap": {
            which: round(abs(first_loss[which] - first_loss["transformers"]) / first_loss["transformers"], 8)
            for which in ("forgeline", "forgeline_lora")},
        "losses": {which: [round(value, 5) for value in values] for which, values in losses.items()},
        "optimizer_state_mb": {variant: figures["optimizer_state_mb"] for variant, figures in memory.items()},
        "lora_over_full_optimizer_state": round(
            memory["lora"]["optimizer_state_mb"] / memory["full"]["optimizer_state_mb"], 5),
        "step_peak_rss_increase_mb": {variant: figures["memory"]["peak_rss_increase_mb"]
                                      for variant, figures in memory.items()},
        "memory": memory,
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    write_results("sft", results)


if __name__ == "__main__":
    main()
