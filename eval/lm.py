"""The `forgeline` model class for lm-evaluation-harness.

    lm_eval.simple_evaluate(model="forgeline",
                            model_args="checkpoint=artifacts/train/checkpoints/step-00000300,"
                                       "tokenizer=artifacts/data/tokenizer", tasks=[...])

Loads a checkpoint of any parallel layout (or an inference bundle) into one process.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast

from forgeline.model.inference import generate, load_bundle, load_from_checkpoint
from forgeline.model.llama import Transformer

Request = tuple[tuple[str, str] | None, list[int], list[int]]


@register_model("forgeline")
class ForgelineLM(TemplateLM):
    def __init__(self, tokenizer: str, checkpoint: str | None = None, bundle: str | None = None,
                 batch_size: int | str = 16, max_length: int | None = None,
                 device: str = "cpu", **_ignored) -> None:
        super().__init__()
        if (checkpoint is None) == (bundle is None):
            raise ValueError("forgeline model_args need exactly one of checkpoint=... or bundle=...")
        self.model: Transformer = (load_from_checkpoint(checkpoint, device) if checkpoint
                                   else load_bundle(bundle, device))
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(Path(tokenizer)))
        self._device = torch.device(device)
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or self.model.args.max_seq_len)

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
        """Sum of log-probabilities of each continuation given its context, and whether
        greedy decoding would produce it. Longest first, so padding per batch is small."""
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(range(len(requests)),
                       key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        for start in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm,
                          desc="loglikelihood"):
            batch = order[start:start + self.batch_size]
            windows = [self._window(requests[i][1], requests[i][2]) for i in batch]
            width = max(len(inputs) for inputs, _ in windows)
            padded = torch.full((len(batch), width), self.eot_token_id, dtype=torch.long)
            for row, (inputs, _) in enumerate(windows):
                padded[row, : len(inputs)] = torch.tensor(inputs)
            logprobs = F.log_softmax(self.model(padded.to(self.device)).float(), dim=-1)  # (B, T, V)
            for row, (index, (inputs, continuation)) in enumerate(zip(batch, windows, strict=True)):
                span = logprobs[row, len(inputs) - len(continuation): len(inputs)]  # (C, V)
                target = torch.tensor(continuation, device=self.device)
                score = float(span.gather(-1, target[:, None]).sum())
                greedy = bool((span.argmax(-1) == target).all())
                results[index] = (score, greedy)
                if requests[index][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[index][0], (score, greedy))
        return results

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
        for owner, (score, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm),
                                     strict=True):
            totals[owner] += score
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample/temperature) generation up to max_gen_toks or
        the first stop sequence, which is cut off."""
        outputs = []
        for request in tqdm(requests, disable=disable_tqdm, desc="generate_until"):
            context, gen_kwargs = request.args
            until = gen_kwargs.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample") else 0.0
            new_tokens = generate(
                self.model, self.tok_encode(context)[-self.max_length:],
                max_new_tokens=int(gen_kwargs.get("max_gen_toks", 256)),
                temperature=temperature, stop_token=self.eot_token_id,
                stop=lambda new, until=until: any(s in self.tok_decode(new) for s in until),
            )
            text = self.tok_decode(new_tokens)
            for stop in until:
                text = text.split(stop)[0]
            outputs.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return outputs
