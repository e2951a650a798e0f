"""The `forgeline` model class for lm-evaluation-harness.

    lm_eval.simple_evaluate(model="forgeline",
                            model_args="checkpoint=artifacts/train/checkpoints/step-00000300,"
                                       "tokenizer=artifacts/data/tokenizer", tasks=[...])
    forgeline lm-eval --model forgeline --model_args hf=exported/,tokenizer=exported/ --tasks ...

Loads a checkpoint of any parallel layout, an inference bundle or a Hugging Face Llama
directory into one process. Scoring is batched longest-first; a context shared by several
requests (the choices of a multiple-choice item) is computed once, the continuations on top of
its KV cache. Generation is batched with a KV cache.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast

from forgeline.model.hf import import_hf
from forgeline.model.inference import generate_batch, load_bundle, load_from_checkpoint
from forgeline.model.llama import KVCache

log = logging.getLogger(__name__)

Request = tuple[tuple[str, str] | None, list[int], list[int]]


def score_continuation(logits: torch.Tensor, target: torch.Tensor) -> tuple[float, bool]:
    """Log-probability of `target` (C,) under `logits` (C, V), and whether it is the greedy
    choice at every position: the target logits minus their logsumexp, without materializing a
    (C, V) log-softmax."""
    logprob = logits.gather(-1, target[:, None])[:, 0] - logits.logsumexp(-1)
    return float(logprob.sum()), bool((logits.argmax(-1) == target).all())


def usable_device(requested: str) -> str:
    """lm-eval's command line asks for cuda:0 unless told otherwise; like its `hf` backend, fall
    back to the CPU where there is no GPU."""
    if torch.device(requested).type == "cuda" and not torch.cuda.is_available():
        log.warning("device %s requested but CUDA is not available; running on the CPU", requested)
        return "cpu"
    return requested


@register_model("forgeline")
class ForgelineLM(TemplateLM):
    def __init__(self, tokenizer: str, checkpoint: str | None = None, bundle: str | None = None,
                 hf: str | None = None, batch_size: int | str = 16, max_length: int | None = None,
                 device: str = "cpu", **_ignored) -> None:
        device = usable_device(device)
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
        self.model = model
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(Path(tokenizer)))
        self._device = torch.device(device)
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or model.args.max_seq_len)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=False)

    def tok_decode(self, tokens: Iterable[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """Sum of log-probabilities of each continuation given its context, and whether greedy
        decoding would produce it. A context shared by several requests -- the choices of a
        multiple-choice item -- runs once, and only the continuations are computed on top of its
        KV cache; the rest (document windows, over-long requests) run whole, each distinct input
        once. Both go longest first, in batches."""
        by_context: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for index, (_, context, continuation) in enumerate(requests):
            if context and len(context) + len(continuation) <= self.max_length + 1:
                by_context[tuple(context)].append(index)
        shared = {context: users for context, users in by_context.items() if len(users) > 1}
        whole = [i for i in range(len(requests)) if tuple(requests[i][1]) not in shared]
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood")
        for batch in self._batches(sorted(shared, key=len, reverse=True), lambda c: len(shared[c])):
            for index, score in self._score_on_shared_contexts(requests, batch, shared):
                results[index] = score
            progress.update(sum(len(shared[c]) for c in batch))
        for index, score in self._score_whole(requests, whole, progress):
            results[index] = score
        progress.close()
        for index, score in enumerate(results):
            if requests[index][0] is not None:
                self.cache_hook.add_partial("loglikelihood", requests[index][0], score)
        return results

    def _batches(self, items: list, rows: Callable[[object], int]) -> Iterator[list]:
        """Consecutive items adding up to about batch_size rows (at least one item)."""
        batch, size = [], 0
        for item in items:
            batch.append(item)
            size += rows(item)
            if size >= self.batch_size:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch

    def _score_on_shared_contexts(self, requests: list[Request], contexts: list[tuple[int, ...]],
                                  users: dict[tuple[int, ...], list[int]]) -> Iterator[tuple[int, tuple]]:
        """One forward of the (left-padded) contexts into a KV cache, then one of every
        continuation but its last token on top of its context's cache."""
        width = len(contexts[0])  # longest first
        rows = [(group, index) for group, context in enumerate(contexts) for index in users[context]]
        longest = max(len(requests[index][2]) for _, index in rows)
        cache = KVCache(self.model.args, len(contexts), width + longest, self.device,
                        next(self.model.parameters()).dtype)
        prompts = torch.full((len(contexts), width), self.eot_token_id, dtype=torch.long)
        for group, context in enumerate(contexts):
            prompts[group, width - len(context):] = torch.tensor(context)
            cache.valid[group, width - len(context):width] = True
        first = self._logits(self.model.hidden_states(prompts.to(self.device), cache)[:, -1])  # (G, V)
        cache.select(torch.tensor([group for group, _ in rows], device=self.device))
        cache.valid[:, width:] = True  # padding at the end of a continuation only follows it
        rest = None
        if longest > 1:
            inputs = torch.full((len(rows), longest - 1), self.eot_token_id, dtype=torch.long)
            for row, (_, index) in enumerate(rows):
                continuation = requests[index][2]
                inputs[row, : len(continuation) - 1] = torch.tensor(continuation[:-1])
            rest = self._logits(self.model.hidden_states(inputs.to(self.device), cache))  # (R, C-1, V)
        for row, (group, index) in enumerate(rows):
            continuation = requests[index][2]
            predicted = first[group][None]  # (1, V): the context's last position predicts token 0
            if len(continuation) > 1:
                predicted = torch.cat([predicted, rest[row, : len(continuation) - 1]])  # (C, V)
            yield index, score_continuation(predicted, torch.tensor(continuation, device=self.device))

    def _score_whole(self, requests: list[Request], indices: list[int],
                     progress: tqdm) -> Iterator[tuple[int, tuple]]:
        windows = {i: self._window(requests[i][1], requests[i][2]) for i in indices}
        users: dict[tuple[int, ...], list[int]] = defaultdict(list)  # input -> requests scoring it
        for index, (inputs, _) in windows.items():
            users[tuple(inputs)].append(index)
        distinct = sorted(users, key=len, reverse=True)
        for start in range(0, len(distinct), self.batch_size):
            batch = distinct[start:start + self.batch_size]
            padded = torch.full((len(batch), len(batch[0])), self.eot_token_id, dtype=torch.long)
            for row, inputs in enumerate(batch):
                padded[row, : len(inputs)] = torch.tensor(inputs)
            hidden = self.model.hidden_states(padded.to(self.device))  # (B, T, C)
            # Only the positions that predict a continuation token get logits.
            spans = [max(len(windows[index][1]) for index in users[inputs]) for inputs in batch]
            needed = [hidden[row, len(inputs) - span: len(inputs)]
                      for row, (inputs, span) in enumerate(zip(batch, spans, strict=True))]
            logits = self._logits(torch.cat(needed))  # (sum of spans, V)
            for inputs, row_logits in zip(batch, logits.split(spans), strict=True):
                for index in users[inputs]:
                    continuation = windows[index][1]
                    yield index, score_continuation(row_logits[len(row_logits) - len(continuation):],
                                                    torch.tensor(continuation, device=self.device))
                progress.update(len(users[inputs]))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.output(hidden).float()

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
        for owner, (score, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm), strict=True):
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
        together, longest prompt first."""
        groups: dict[str, list[int]] = defaultdict(list)
        for index, request in enumerate(requests):
            groups[json.dumps(request.args[1], sort_keys=True, default=str)].append(index)
        outputs: list[str | None] = [None] * len(requests)
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
        for indices in groups.values():
            gen_kwargs = requests[indices[0]].args[1]
            until = gen_kwargs.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample") else 0.0
            max_new = self._generation_budget(int(gen_kwargs.get("max_gen_toks", 256)))
            prompts = {i: self.tok_encode(requests[i].args[0]) for i in indices}
            ordered = sorted(indices, key=lambda i: -len(prompts[i]))
            for start in range(0, len(ordered), self.batch_size):
                batch = ordered[start:start + self.batch_size]
                new_tokens = generate_batch(
                    self.model, [prompts[i] for i in batch], max_new, temperature=temperature,
                    stop_token=self.eot_token_id,
                    stop=lambda row, new, until=until: any(s in self.tok_decode(new) for s in until),
                )
                for index, tokens in zip(batch, new_tokens, strict=True):
                    text = self.tok_decode(tokens)
                    for stop in until:
                        text = text.split(stop)[0]
                    outputs[index] = text
                    self.cache_hook.add_partial("generate_until", requests[index].args, text)
                progress.update(len(batch))
        progress.close()
        return outputs
