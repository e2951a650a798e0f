"""The pairs stage's function and record: prompts made (prompts.py), replies sampled from the
policy, checked and paired (checks.py), written with a manifest.

The policy is the base of `model.init_from` (the model preference tuning starts from), loaded as
the eval stage loads a model (eval/lm.py ForgelineLM: weights in `pairs.precision`, fp32 linear
layers packed for oneDNN). Each prompt goes through the base's chat template as a user turn, and
`samples_per_prompt` replies are sampled from it at `temperature`/`top_p` with one seeded
torch.Generator, `batch_size` rows decoding together (continuous batching, model/inference.py); a
reply ends at the template's end-of-turn token or EOS, or is cut off at `max_new_tokens`.

Output (`pairs.out_dir`), swapped in whole: `pairs.jsonl`, one pair a line (checks.py
pair_record: the `preference` format the data stage reads as a `kind: pairs` source), and
`manifest.json`: what was made of what -- the prompts, those left out for overlapping IFEval, the
instruction types trained and held out, the replies, each type's pass rate, the pairs, the
prompts dropped by reason, the generation's time and tokens, the base.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from forgeline.configs import Config, ConfigError
from forgeline.configs.schema import PairsConfig
from forgeline.eval.chat import end_of_turn_id, render_chat
from forgeline.eval.lm import eval_precision, in_precision, say_precision
from forgeline.model.hf import import_hf
from forgeline.model.inference import load_from_checkpoint, pack_linears, stream_batch
from forgeline.model.transformer import Transformer
from forgeline.tasks.atomic import replace_dir, staging_dir
from forgeline.tasks.pairs.checks import DROP_REASONS, Prompt, Reply, checked, pairs_of
from forgeline.tasks.pairs.prompts import candidate_tasks, prompts_apart_from_ifeval
from forgeline.tasks.pretrained import Base, resolve_base
from forgeline.tasks.tracking import RunTracker

log = logging.getLogger(__name__)

PAIRS_NAME = "pairs.jsonl"
MANIFEST_NAME = "manifest.json"  # written last: the stage's done marker
PROGRESS_STEPS = 10  # progress lines logged while sampling


@dataclass(frozen=True)
class PairsResult:
    out_dir: str
    prompts: int
    pairs: int
    metrics: dict[str, float]
    """What the run records (record_pairs): counts, pass rates, the generation's time and tokens."""


def sampling_precision(pcfg: PairsConfig) -> str:
    """fp32 or bf16: pairs.precision on the CPU, where the stage samples (as the eval stage scores)."""
    return eval_precision(pcfg.precision, "cpu", "pairs.precision")


def preflight_pairs(cfg: Config) -> None:
    """The precision suits this machine, and the base resolves, has a chat template to ask it
    through, and a context with room for a prompt beside a reply's budget."""
    say_precision("pairs.precision", cfg.pairs.precision, sampling_precision(cfg.pairs))
    base = resolve_base(cfg)
    if not PreTrainedTokenizerFast.from_pretrained(str(base.tokenizer)).chat_template:
        raise ConfigError(f"the pairs stage asks the base {base.uri} its prompts through its chat template, "
                          f"but its tokenizer ({base.tokenizer}) has none: start from an instruct model")
    if cfg.pairs.max_new_tokens >= base.shape.max_seq_len:
        raise ConfigError(f"pairs.max_new_tokens={cfg.pairs.max_new_tokens} leaves no room for a prompt in "
                          f"the base's {base.shape.max_seq_len}-token context: set it lower")
    if 2 * cfg.pairs.max_new_tokens > cfg.data.seq_len:
        # Not refused: replies are mostly shorter than the budget. But a pair (its prompt twice and
        # both replies) is one row, and the data stage's too_long drops count against its limit.
        log.warning("pairs: two replies of pairs.max_new_tokens=%d do not fit one row of data.seq_len=%d "
                    "+ 1 tokens: the data stage drops such pairs as too_long, and fails past "
                    "data.max_dropped_fraction=%s; raise data.seq_len to hold them", cfg.pairs.max_new_tokens,
                    cfg.data.seq_len, cfg.data.max_dropped_fraction)


def pairs_stage(cfg: Config, run: RunTracker, parent: RunTracker | None) -> PairsResult:
    """The pairs stage's function (tasks/stage.py)."""
    return make_pairs(cfg)


def record_pairs(cfg: Config, run: RunTracker, parent: RunTracker | None, result: PairsResult) -> None:
    """Its counts, pass rates and generation figures, and the manifest; the counts on the parent
    too, under `pairs/`."""
    run.log_metrics(result.metrics)
    run.log_artifact(Path(result.out_dir) / MANIFEST_NAME, "pairs")
    if parent:
        parent.log_metrics({f"pairs/{key}": value for key, value in result.metrics.items()})


@dataclass(frozen=True)
class Policy:
    """The model that replies, its tokenizer, and the tokens that end a reply."""

    model: Transformer
    tokenizer: PreTrainedTokenizerFast
    stop_tokens: tuple[int, ...]

    @classmethod
    def load(cls, base: Base, precision: str) -> Policy:
        model = load_from_checkpoint(base.weights) if base.is_checkpoint else import_hf(str(base.weights))[0]
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(base.tokenizer))
        ends = (tokenizer.eos_token_id, end_of_turn_id(tokenizer))
        stops = tuple(token for token in ends if token is not None)
        # pack_linears packs fp32 linears only: bf16 ones stay plain nn.Linear.
        return cls(pack_linears(in_precision(model, precision)), tokenizer, stops)

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt as a user turn through the chat template, the assistant's turn opened."""
        text = render_chat(self.tokenizer, [{"role": "user", "content": prompt.text}])
        return self.tokenizer.encode(text, add_special_tokens=False)


class Progress:
    """Logs how many replies are done, PROGRESS_STEPS times over the sampling."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.started = total, 0, time.perf_counter()
        self.every = max(1, total // PROGRESS_STEPS)

    def ended(self, row: int) -> None:
        self.done += 1
        if self.done % self.every == 0 or self.done == self.total:
            log.info("pairs: %d of %d replies sampled (%.0f s)", self.done, self.total,
                     time.perf_counter() - self.started)


def sample_replies(policy: Policy, prompts: list[Prompt], pcfg: PairsConfig) -> list[list[int]]:
    """The new tokens of `samples_per_prompt` replies to each prompt, a prompt's next to each other."""
    encoded = [policy.encode(prompt) for prompt in prompts]
    rows = [tokens for tokens in encoded for _ in range(pcfg.samples_per_prompt)]
    generator = torch.Generator().manual_seed(pcfg.seed)
    new: list[list[int]] = [[] for _ in rows]
    for row, token in stream_batch(policy.model, rows, pcfg.max_new_tokens, pcfg.temperature, pcfg.top_p,
                                   policy.stop_tokens, generator=generator, batch_size=pcfg.batch_size,
                                   ended=Progress(len(rows)).ended):
        new[row].append(token)
    return new


def make_pairs(cfg: Config) -> PairsResult:
    """The pairs stage without tracking: prompts, replies, pairs, manifest, in `pairs.out_dir`."""
    pcfg = cfg.pairs
    base = resolve_base(cfg)
    prompts, made = prompts_apart_from_ifeval(candidate_tasks(), pcfg)
    precision = sampling_precision(pcfg)
    policy = Policy.load(base, precision)
    started = time.perf_counter()
    tokens = sample_replies(policy, prompts, pcfg)
    seconds = time.perf_counter() - started
    k = pcfg.samples_per_prompt
    replies = [[checked(prompt, policy.tokenizer.decode(reply), len(reply) == pcfg.max_new_tokens)
                for reply in tokens[i * k:(i + 1) * k]] for i, prompt in enumerate(prompts)]
    records, dropped = paired(prompts, replies, pcfg.pairs_per_prompt)
    new_tokens = sum(map(len, tokens))
    manifest = {
        "prompts": made,
        "instruction_types": {"trained": pcfg.instruction_types, "held_out": pcfg.held_out_types},
        "samples_per_prompt": k,
        "replies": reply_counts(replies),
        "pass_rate": pass_rates(prompts, replies),
        "pairs": len(records),
        "dropped": dropped,
        "generation": {"seconds": round(seconds, 1), "new_tokens": new_tokens,
                       "tokens_per_s": round(new_tokens / seconds, 1),
                       "replies_per_s": round(len(tokens) / seconds, 3), "precision": precision,
                       "batch_size": pcfg.batch_size, "max_new_tokens": pcfg.max_new_tokens,
                       "temperature": pcfg.temperature, "top_p": pcfg.top_p,
                       "threads": torch.get_num_threads()},
        "base": base.lineage(),
        "seed": pcfg.seed,
    }
    write_pairs(Path(pcfg.out_dir), records, manifest)
    log.info("pairs: %d pairs of %d prompts (dropped: %s) in %s", len(records), len(prompts),
             ", ".join(f"{reason} {n}" for reason, n in dropped.items()), pcfg.out_dir)
    return PairsResult(str(pcfg.out_dir), len(prompts), len(records), metrics_of(manifest))


def paired(prompts: list[Prompt], replies: list[list[Reply]], most: int) -> tuple[list[dict[str, Any]],
                                                                                   dict[str, int]]:
    """The pair records of every prompt, and how many prompts gave none, by reason."""
    records: list[dict[str, Any]] = []
    dropped = dict.fromkeys(DROP_REASONS, 0)
    for prompt, its in zip(prompts, replies, strict=True):
        pairs, reason = pairs_of(prompt, its, most)
        records += pairs
        if reason:
            dropped[reason] += 1
    return records, dropped


def reply_counts(replies: list[list[Reply]]) -> dict[str, int]:
    flat = [reply for its in replies for reply in its]
    return {"sampled": len(flat), "truncated": sum(reply.truncated for reply in flat),
            "following": sum(reply.follows_all for reply in flat)}


def pass_rates(prompts: list[Prompt], replies: list[list[Reply]]) -> dict[str, dict[str, float]]:
    """Per instruction type: the share of the replies to a prompt with a constraint of it that
    follow that constraint (cut-off replies too, checked as they stand), and how many there were."""
    checks: dict[str, list[bool]] = defaultdict(list)
    for prompt, its in zip(prompts, replies, strict=True):
        for reply in its:
            for name, ok in zip(prompt.instruction_ids, reply.followed, strict=True):
                checks[name].append(ok)
    return {name: {"rate": round(sum(oks) / len(oks), 4), "checks": len(oks)}
            for name, oks in sorted(checks.items())}


def metrics_of(manifest: dict[str, Any]) -> dict[str, float]:
    """The manifest's figures as flat MLflow metrics."""
    generation = manifest["generation"]
    return {"prompts": manifest["prompts"]["made"],
            "excluded_ifeval_overlap": manifest["prompts"]["excluded_ifeval_overlap"],
            **{f"replies_{key}": value for key, value in manifest["replies"].items()},
            "pairs": manifest["pairs"],
            **{f"dropped/{reason}": n for reason, n in manifest["dropped"].items()},
            **{f"pass_rate/{name}": entry["rate"] for name, entry in manifest["pass_rate"].items()},
            **{f"generation/{key}": generation[key]
               for key in ("seconds", "new_tokens", "tokens_per_s", "replies_per_s")}}


def write_pairs(out_dir: Path, records: list[dict[str, Any]], manifest: dict[str, Any]) -> None:
    """pairs.jsonl and the manifest (with the pairs' sha256), swapped in as `out_dir` whole."""
    lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    manifest = manifest | {"pairs_sha256": hashlib.sha256(lines.encode()).hexdigest()}
    with staging_dir(out_dir) as tmp:
        (tmp / PAIRS_NAME).write_text(lines, encoding="utf-8")
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        replace_dir(tmp, out_dir)
