"""The `forgeline` model class for lm-evaluation-harness.

    lm_eval.simple_evaluate(model="forgeline",
                            model_args="checkpoint=artifacts/train/checkpoints/step-00000300,"
                                       "tokenizer=artifacts/data/tokenizer", tasks=[...])
    forgeline lm-eval --model forgeline --model_args hf=exported/,tokenizer=exported/ --tasks ...

Loads a checkpoint of any parallel layout, an inference bundle or a Hugging Face
directory into one process. Scoring packs several requests into each row of a batch, kept apart
by the attention mask, so the model computes real tokens instead of padding; a context shared by
several requests (the choices of a multiple-choice item) is computed once, their continuations
branching off its end. Generation is batched with a KV cache, a request that ends giving its row
to the next (continuous batching). On the CPU the linear layers run on weights packed once for
oneDNN (model/inference.py, pack_linears).

Three settings besides the weights decide a score: the tokenizer -- its end-of-text token is the
token a document's first window is predicted from (lm-eval's prefix token) -- `max_length`, the
window a document is scored in (by default the model's context, `max_seq_len`), and `precision`,
the weights' dtype (auto, fp32 or bf16; auto: bf16 on a GPU that supports it, else fp32). Models
compared item by item must be scored with the same three (tasks/evaluate.py, Scoring).

A tokenizer with a chat template makes the model an assistant: lm-eval's
`simple_evaluate(apply_chat_template=True)` renders each request's prompt through that template
(`apply_chat_template`), and generation stops at the template's end-of-turn token (eval/chat.py)
as it does at the end-of-text token, whatever the task's stop sequences.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import lm_eval.models  # noqa: F401  (registers lm-eval's own model names: see @register_model below)
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast

from forgeline.configs.environment import apply_environment_defaults, progress_bars_shown
from forgeline.eval.chat import Messages, end_of_turn_id, render_chat
from forgeline.model.hf import import_hf
from forgeline.model.inference import generate_batch, load_bundle, load_from_checkpoint, pack_linears
from forgeline.model.parallel.mesh import BF16_WHERE_NATIVE, resolve_precision
from forgeline.model.transformer import Transformer

log = logging.getLogger(__name__)

Request = tuple[tuple[str, str] | None, list[int], list[int]]
SCORE_CHUNK = 512  # positions whose logits are computed and reduced together


@dataclass
class Sequence:
    """One sequence of a packed row: a context with the continuations of the requests that
    share it branching off its end (the choices of a multiple-choice item), or one input."""
    tokens: list[int] = field(default_factory=list)
    branches: list[int] = field(default_factory=list)  # per token: 0 the context, k its k-th continuation
    positions: list[int] = field(default_factory=list)  # per token: position within its branch's sequence
    scored: list[tuple[int, list[int]]] = field(default_factory=list)  # (request, tokens predicting it)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int], branch: int, first_position: int) -> list[int]:
        """Append `tokens` to `branch`; returns their offsets in the sequence."""
        start = len(self.tokens)
        self.tokens += tokens
        self.branches += [branch] * len(tokens)
        self.positions += range(first_position, first_position + len(tokens))
        return list(range(start, len(self.tokens)))


def branching_sequences(requests: list[Request], users: list[int], max_length: int) -> list[Sequence]:
    """The requests in `users`, which share one context, as sequences of at most `max_length`
    tokens: the context once, then each continuation but its last token, attending to the
    context and to itself only. A continuation's first token is predicted by the context's last
    position, so one-token answers add no tokens at all."""
    context = requests[users[0]][1]
    sequences: list[Sequence] = []
    for index in users:
        inputs = requests[index][2][:-1]
        if not sequences or len(sequences[-1]) + len(inputs) > max_length:
            sequences.append(Sequence())
            sequences[-1].extend(context, 0, 0)
        sequence = sequences[-1]
        branch = len(sequence.scored) + 1
        sequence.scored.append((index, [len(context) - 1] + sequence.extend(inputs, branch, len(context))))
    return sequences


def pack_rows(sequences: list[Sequence], rows: int) -> Iterator[list[list[Sequence]]]:
    """Batches of at most `rows` rows, each as wide as the longest sequence left, filled
    first-fit, longest first: shorter sequences take the room that would be padding."""
    remaining = sorted(sequences, key=len, reverse=True)
    while remaining:
        width, shortest = len(remaining[0]), len(remaining[-1])
        batch: list[list[Sequence]] = []
        free: list[int] = []
        left: list[Sequence] = []
        for position, sequence in enumerate(remaining):
            if len(batch) == rows and max(free) < shortest:  # full: the rest waits for the next batch
                left += remaining[position:]
                break
            row = next((r for r, room in enumerate(free) if room >= len(sequence)), None)
            if row is None and len(batch) < rows:
                batch.append([])
                free.append(width)
                row = len(batch) - 1
            if row is None:
                left.append(sequence)
            else:
                batch[row].append(sequence)
                free[row] -= len(sequence)
        yield batch
        remaining = left


@dataclass
class PackedRows:
    """A batch of packed rows as model inputs: tokens, and per token its sequence within the
    row, its branch and its position; `placed` lists each sequence with its offset in the
    flattened (B * T) batch."""
    tokens: torch.Tensor  # (B, T)
    segments: torch.Tensor  # (B, T): -1 for padding
    branches: torch.Tensor
    positions: torch.Tensor
    placed: list[tuple[Sequence, int]]

    @classmethod
    def of(cls, batch: list[list[Sequence]]) -> PackedRows:
        width = len(batch[0][0])  # the longest sequence
        shape = (len(batch), width)
        rows = cls(tokens=torch.zeros(shape, dtype=torch.long), segments=torch.full(shape, -1),
                   branches=torch.zeros(shape, dtype=torch.long),
                   positions=torch.zeros(shape, dtype=torch.long), placed=[])
        for row, sequences in enumerate(batch):
            start = 0
            for segment, sequence in enumerate(sequences):
                span = slice(start, start + len(sequence))
                rows.tokens[row, span] = torch.tensor(sequence.tokens)
                rows.segments[row, span] = segment
                rows.branches[row, span] = torch.tensor(sequence.branches)
                rows.positions[row, span] = torch.tensor(sequence.positions)
                rows.placed.append((sequence, row * width + start))
                start += len(sequence)
        return rows

    def mask(self) -> torch.Tensor:
        """(B, 1, T, T) attention mask: a token sees the earlier tokens of its own sequence that
        are in the context or in its own branch, and always itself (padding, in no sequence,
        would otherwise see nothing and turn into NaN)."""
        same_sequence = self.segments[:, :, None] == self.segments[:, None, :]
        earlier = self.positions[:, None, :] <= self.positions[:, :, None]
        keys, queries = self.branches[:, None, :], self.branches[:, :, None]
        context_or_own = (keys == 0) | (keys == queries)
        itself = torch.eye(self.segments.size(1), dtype=torch.bool)
        return (same_sequence & earlier & context_or_own | itself)[:, None]


def score_tokens(logits: torch.Tensor, targets: torch.Tensor,
                 greedy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per position of `logits` (N, V): the log-probability of its target (N,) -- the target
    logit minus the logsumexp, without materializing an (N, V) log-softmax -- and, if `greedy`,
    whether the target is the greedy choice (another pass over the logits)."""
    logprobs = logits.gather(-1, targets[:, None])[:, 0] - logits.logsumexp(-1)
    return logprobs, logits.argmax(-1) == targets if greedy else None


def usable_device(requested: str) -> str:
    """lm-eval's command line asks for cuda:0 unless told otherwise; like its `hf` backend, fall
    back to the CPU where there is no GPU."""
    if torch.device(requested).type == "cuda" and not torch.cuda.is_available():
        log.warning("device %s requested but CUDA is not available; running on the CPU", requested)
        return "cpu"
    return requested


def scoring_window(context: int, max_length: int | str | None) -> int:
    """The window documents and inputs are scored in: `max_length` when given (as lm-eval's
    model_args give it, perhaps a string), else the model's `context`. A window beyond the
    context is refused: the model has no rotary positions past it."""
    if max_length is None:
        return context
    window = int(max_length)
    if not 0 < window <= context:
        raise ValueError(f"max_length={window} does not fit the model's context of {context} tokens "
                         f"(max_seq_len): score in windows of 1 to {context} tokens")
    return window


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def eval_precision(requested: str, device_type: str, setting: str = "precision") -> str:
    """fp32 or bf16: what `requested` (auto, bf16_where_native, fp32 or bf16; `setting` names it
    in errors) runs the weights in on `device_type`. bf16 is refused on a CPU without native
    support."""
    if requested not in ("auto", BF16_WHERE_NATIVE) and requested not in PRECISIONS:
        raise ValueError(f"{setting}={requested}: evaluation runs in auto, {BF16_WHERE_NATIVE}, fp32 or "
                         "bf16")
    return "bf16" if resolve_precision(requested, device_type, setting) == torch.bfloat16 else "fp32"


def say_precision(setting: str, requested: str, resolved: str) -> None:
    """One line where this machine chose the precision (bf16_where_native), as a stage starts."""
    if requested == BF16_WHERE_NATIVE:
        native = resolved == "bf16"
        why = f"this CPU {'has' if native else 'has no'} native bf16 (AVX-512 BF16/AMX)"
        log.info("%s=%s: %s, as %s", setting, requested, resolved, why)


def in_precision(model: Transformer, precision: str) -> Transformer:
    """`model` with its parameters in `precision` -- not its buffers: the rotary tables stay fp32,
    as apply_rope rotates in complex fp32."""
    for parameter in model.parameters():
        parameter.data = parameter.data.to(PRECISIONS[precision])
    return model


# lm-eval fills its model registry with its own names (hf, vllm, ...) only when the registry is
# empty; lm_eval.models, imported above, fills it first, so ours joins them rather than hiding them.
@register_model("forgeline")
class ForgelineLM(TemplateLM):
    def __init__(self, tokenizer: str, checkpoint: str | None = None, bundle: str | None = None,
                 hf: str | None = None, batch_size: int | str = 16, max_length: int | str | None = None,
                 device: str = "cpu", precision: str = "auto", **_ignored) -> None:
        apply_environment_defaults()  # lm-eval may construct this class from its own command line
        device = usable_device(device)
        self.precision = eval_precision(precision, torch.device(device).type)
        sources = {"checkpoint": checkpoint, "bundle": bundle, "hf": hf}
        if sum(v is not None for v in sources.values()) != 1:
            raise ValueError("forgeline model_args need exactly one of checkpoint=..., bundle=... or hf=...")
        if checkpoint:
            model = load_from_checkpoint(checkpoint, device)
        elif bundle:
            model = load_bundle(bundle, device)
        else:
            model, _ = import_hf(hf, device=device)
        super().__init__()
        # pack_linears packs fp32 linears only: bf16 ones stay plain nn.Linear.
        self.model = pack_linears(in_precision(model, self.precision))
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(Path(tokenizer)))
        self._tokenizer_dir = str(Path(tokenizer).resolve())
        self.end_of_turn = end_of_turn_id(self.tokenizer)
        self._device = torch.device(device)
        self.batch_size = int(batch_size)
        self.max_length = scoring_window(model.shape.max_seq_len, max_length)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        """What lm-eval's request cache keys chat-rendered prompts by."""
        return self._tokenizer_dir

    def apply_chat_template(self, chat_history: Messages, add_generation_prompt: bool = True) -> str:
        """A request's messages as the prompt text of the tokenizer's chat template (lm-eval calls
        this with simple_evaluate(apply_chat_template=True))."""
        return render_chat(self.tokenizer, chat_history, add_generation_prompt,
                           where=f"the tokenizer at {self._tokenizer_dir}")

    def stop_sequences(self, until: str | list[str] | None) -> list[str]:
        """A request's stop sequences (lm-eval's `until`; none given: the end-of-text token's
        text), with the end-of-turn token's text added: an assistant that closes its turn has
        answered."""
        stops = [until] if isinstance(until, str) else list(until or [self.tok_decode([self.eot_token_id])])
        if self.end_of_turn is not None:
            stops.append(self.tok_decode([self.end_of_turn]))
        return stops

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=False)

    def tok_decode(self, tokens: Iterable[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # lm-eval's own, whose "Tokenizing inputs" bar would show whatever tqdm's environment says
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not progress_bars_shown())

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              greedy: bool = True, **kwargs) -> list[tuple[float, bool]]:
        """Sum of log-probabilities of each continuation given its context, and whether greedy
        decoding would produce it (with greedy=False: not checked, reported False). Requests
        become sequences packed several to a row with a mask that keeps them apart, so the model
        computes real tokens rather than padding: requests sharing a context (the choices of a
        multiple-choice item) share one copy of it, with their continuations branching off its
        end; the others (document windows, inputs cut to max_length) each compute their input
        once."""
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        progress = tqdm(total=len(requests), disable=disable_tqdm or not progress_bars_shown(),
                        desc="loglikelihood")
        for batch in pack_rows(self._sequences(requests), self.batch_size):
            for index, score in self._score_packed(requests, batch, greedy):
                results[index] = score
            progress.update(sum(len(sequence.scored) for row in batch for sequence in row))
        progress.close()
        for index, score in enumerate(results):
            if requests[index][0] is not None:
                self.cache_hook.add_partial("loglikelihood", requests[index][0], score)
        return results

    def _sequences(self, requests: list[Request]) -> list[Sequence]:
        by_context: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for index, (_, context, _continuation) in enumerate(requests):
            by_context[tuple(context)].append(index)
        sequences = []
        single: dict[tuple[int, ...], Sequence] = {}  # input -> the sequence of the requests scoring it
        for context, users in by_context.items():
            longest = max(len(requests[index][2]) for index in users)
            if context and len(users) > 1 and len(context) + longest - 1 <= self.max_length:
                sequences += branching_sequences(requests, users, self.max_length)
                continue
            for index in users:
                inputs, continuation = self._window(requests[index][1], requests[index][2])
                if (sequence := single.get(tuple(inputs))) is None:
                    sequence = single[tuple(inputs)] = Sequence()
                    sequence.extend(inputs, 0, 0)
                    sequences.append(sequence)
                sequence.scored.append((index, list(range(len(inputs) - len(continuation), len(inputs)))))
        return sequences

    def _score_packed(self, requests: list[Request], batch: list[list[Sequence]],
                      greedy: bool) -> Iterator[tuple[int, tuple[float, bool]]]:
        """One forward of the packed rows; logits only where a continuation token is predicted."""
        rows = PackedRows.of(batch)
        # Rows of one plain sequence each are ordinary causal inputs (padding only at their ends).
        plain = all(len(sequences) == 1 and not any(sequences[0].branches) for sequences in batch)
        hidden = self.model.hidden_states(
            rows.tokens.to(self.device), positions=None if plain else rows.positions.to(self.device),
            mask=None if plain else rows.mask().to(self.device))
        picked, targets, lengths, indices = [], [], [], []
        for sequence, offset in rows.placed:
            for index, predicting in sequence.scored:
                picked += [offset + position for position in predicting]
                targets += requests[index][2]
                lengths.append(len(predicting))
                indices.append(index)
        states = hidden.flatten(0, 1)[torch.tensor(picked, device=self.device)]  # (N, C)
        # Projected and scored a slice at a time: the logits held at once stay small whatever the
        # vocabulary (16 rows of 512 tokens with a 128k vocabulary would be 4 GB in fp32), and a
        # slice's logits are still in the CPU's caches when the reductions read them.
        target_ids = torch.tensor(targets, device=self.device)
        scored = [score_tokens(self._logits(chunk), chunk_targets, greedy) for chunk, chunk_targets in zip(
            states.split(SCORE_CHUNK), target_ids.split(SCORE_CHUNK), strict=True)]
        logprobs = torch.cat([s[0] for s in scored])
        chosen_tokens = (torch.cat([s[1] for s in scored]) if greedy
                         else torch.zeros_like(logprobs, dtype=torch.bool))
        for index, logprob, chosen in zip(indices, logprobs.split(lengths), chosen_tokens.split(lengths),
                                          strict=True):
            yield index, (float(logprob.sum()), bool(chosen.all()))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden).float()

    def _window(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """Model inputs (the last max_length tokens of context + continuation, minus the final
        one) and the continuation they predict."""
        if len(continuation) > self.max_length:
            raise ValueError(f"continuation of {len(continuation)} tokens exceeds max_length "
                             f"{self.max_length}")
        whole = (context + continuation)[-(self.max_length + 1):]
        return whole[:-1], continuation

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents in disjoint windows of max_length tokens."""
        windows: list[Request] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            (text,) = request.args
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        # Only the sums count here: no greedy check (an argmax over the vocabulary per token).
        scores = self._loglikelihood_tokens(windows, disable_tqdm, greedy=False)
        for owner, (score, _) in zip(owners, scores, strict=True):
            totals[owner] += score
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def _generation_budget(self, requested: int) -> int:
        """At most half the context: the prompt keeps the other half (a small model may have a
        shorter context than a task's budget assumes)."""
        budget = min(requested, self.max_length // 2)
        if budget < requested:
            log.warning("max_gen_toks=%d does not fit this model's %d-token context; generating at most %d",
                        requested, self.max_length, budget)
        return budget

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample/temperature) generation up to max_gen_toks or the
        first stop sequence, which is cut off. Requests with the same settings are decoded
        together, `batch_size` rows at a time, longest prompt first; a request that ends gives
        its row to the next (model/inference.py stream_batch)."""
        groups: dict[str, list[int]] = defaultdict(list)
        for index, request in enumerate(requests):
            groups[json.dumps(request.args[1], sort_keys=True, default=str)].append(index)
        outputs: list[str | None] = [None] * len(requests)
        progress = tqdm(total=len(requests), disable=disable_tqdm or not progress_bars_shown(),
                        desc="generate_until")
        for indices in groups.values():
            gen_kwargs = requests[indices[0]].args[1]
            until = self.stop_sequences(gen_kwargs.get("until"))
            temperature = float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample") else 0.0
            max_new = self._generation_budget(int(gen_kwargs.get("max_gen_toks", 256)))
            # Checked after every token, a stop sequence first shows up ending in the newest
            # token: it lies in the last tokens that hold its bytes (a token has at least one),
            # plus a UTF-8 character's worth that may have begun before. Decoding only those
            # keeps the check constant per step instead of growing with the output.
            tail = max(len(s.encode()) for s in until) + 4
            prompts = {i: self.tok_encode(requests[i].args[0]) for i in indices}
            ordered = sorted(indices, key=lambda i: -len(prompts[i]))
            new_tokens = generate_batch(
                self.model, [prompts[i] for i in ordered], max_new, temperature=temperature,
                stop_token=self.eot_token_id, batch_size=self.batch_size,
                stop=lambda row, new, until=until, tail=tail: any(s in self.tok_decode(new[-tail:])
                                                                  for s in until),
                ended=lambda row: progress.update(1),
            )
            for index, tokens in zip(ordered, new_tokens, strict=True):
                text = self.tok_decode(tokens)
                for stop in until:
                    text = text.split(stop)[0]
                outputs[index] = text
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
        progress.close()
        return outputs
