"""Preference tuning's loss: DPO and SimPO over pairs of completions packed into rows.

A row of preference data (the data stage's `format: preference`, model/training/shards.py) holds
pairs of sequences, each the prompt and one reply; a pair's chosen sequence is one document, its
rejected sequence the next, and the row's loss mask is 1 on the chosen reply's trained tokens, 2
on the rejected one's (the same tokens SFT trains: the reply and its end-of-turn token), 0
elsewhere. The k-th document of a row with 1s pairs with the k-th with 2s.

What the loss needs of a micro-step travels as its targets -- so that a pipeline schedule, which
cuts the targets into microbatches and hands them to the last stage's loss function, gives it
all it needs: a (B, T, 4) float64 tensor of, per target position, the target token id (IGNORED
outside the replies), its side (0 outside the replies, CHOSEN or REJECTED), the number of its
pair within the micro-step, and the reference model's log-probability of the token (token ids
and pair numbers are exact in float64).

The reference log-probabilities are those of the model training starts from (`model.init_from`),
computed once by `reference_log_probs` before the first step -- in the run's own layout, forward
only -- and stored beside the data (`reference_dir`), one float32 per target position of every
sample of a split; a second model is never held during training. With LoRA, that model is the
base with its adapters at their initialization, which adds exactly nothing (B = 0).

The loss of a pair, with pi and ref its replies' summed log-probabilities under the policy and
the reference, and beta, gamma the config's (configs/schema.py PreferenceConfig), as TRL computes
them (DPOTrainer loss_type sigmoid; CPOTrainer loss_type simpo):
  sigmoid (DPO):  -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))
  simpo:          -log sigmoid(beta * (pi_c / n_c - pi_r / n_r) - gamma)   (n: the reply's tokens)
A step's loss is the mean over the pairs of its global batch. The step also reports TRL's
metrics: rewards/chosen and rewards/rejected (beta times the log-ratio; for SimPO beta times the
mean log-probability), rewards/margins, rewards/accuracies (the chosen reward the larger),
logps/chosen and logps/rejected (the policy's summed log-probabilities; SimPO's mean ones), each
a mean over pairs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from forgeline.configs.schema import PreferenceConfig
from forgeline.model.fileio import new_directory
from forgeline.model.training.shards import CHOSEN, REJECTED

if TYPE_CHECKING:
    from forgeline.model.training.loader import ShardedSampleLoader

log = logging.getLogger(__name__)

IGNORED = -100  # a target outside the loss mask -- here, outside the replies (cross_entropy's ignore_index)
TARGET_ID, SIDE, PAIR, REFERENCE = range(4)  # the fields of a preference target
STATS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
         "logps/rejected")


def preference_targets(tokens: torch.Tensor, documents: torch.Tensor, sides: torch.Tensor,
                       reference: torch.Tensor | None) -> torch.Tensor:
    """The (B, T, 4) float64 targets of (B, T + 1) packed pairs: per target position its token id,
    side, pair number in the micro-step and reference log-probability (0 without `reference`,
    (B, T) float32). Fails on a row whose chosen and rejected replies do not pair up."""
    side = sides[:, 1:].long()  # (B, T): the targets' sides
    starts = reply_starts(documents, sides)
    chosen_starts, rejected_starts = (starts & (side == CHOSEN)), (starts & (side == REJECTED))
    per_row = chosen_starts.sum(dim=1)
    if not torch.equal(per_row, rejected_starts.sum(dim=1)):
        raise ValueError(f"rows of preference pairs hold {per_row.tolist()} chosen and "
                         f"{rejected_starts.sum(dim=1).tolist()} rejected replies (per row): they must pair "
                         "up; rebuild the data stage's output")
    # A reply's ordinal among its side's replies in the row, offset by the pairs of the rows before.
    ordinal = torch.where(side == CHOSEN, chosen_starts.cumsum(dim=1), rejected_starts.cumsum(dim=1)) - 1
    pair = ordinal + (per_row.cumsum(dim=0) - per_row)[:, None]
    target = tokens[:, 1:].masked_fill(side == 0, IGNORED)
    ref = reference.double() if reference is not None else torch.zeros(side.shape, dtype=torch.float64,
                                                                       device=side.device)
    return torch.stack([target.double(), side.double(), pair.masked_fill(side == 0, 0).double(),
                        ref.masked_fill(side == 0, 0.0)], dim=-1)


def reply_starts(documents: torch.Tensor, sides: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the first target of each reply of (B, T + 1) packed pairs: its document's first
    masked token. Per document, not per masked stretch: a reply of several assistant turns (or a
    tool call and its answer) has untrained turns between its trained ones. `documents` is
    non-decreasing along T."""
    side, doc = sides[:, 1:].long(), documents[:, 1:].long()
    masked_doc = torch.where(side > 0, doc, torch.full_like(doc, -1))
    last_masked_doc = F.pad(masked_doc[:, :-1], (1, 0), value=-1).cummax(dim=1).values
    return (side > 0) & (doc != last_masked_doc)


def pair_count(documents: torch.Tensor, sides: torch.Tensor) -> int:
    """The pairs of (B, T + 1) packed pairs: their chosen replies."""
    return int((reply_starts(documents, sides) & (sides[:, 1:] == CHOSEN)).sum())


def counted(targets: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the positions whose targets are a reply's tokens."""
    return targets[..., SIDE] > 0


class TokenLogProbs(torch.autograd.Function):
    """Each target's log-probability under (N, V) logits, whose backward turns the saved
    log-probabilities into the logits' gradient in place, as TokenCrossEntropy (step.py) does:
    d log p(t) / d logits = onehot(t) - softmax, times each token's gradient."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        log_probs = torch.log_softmax(logits, dim=-1)  # (N, V)
        ctx.used = False
        ctx.save_for_backward(log_probs, targets[:, None])
        return log_probs.gather(1, targets[:, None]).squeeze(1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        if ctx.used:
            raise RuntimeError("TokenLogProbs' backward consumes its saved log-probabilities: once only")
        ctx.used = True
        log_probs, targets = ctx.saved_tensors
        grad_logits = log_probs.exp_().mul_(-grad[:, None])
        return grad_logits.scatter_add_(1, targets, grad[:, None]), None


def token_log_probs(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """(N,) log-probabilities of (N,) targets under (N, V) logits (reduced in fp32); a
    vocabulary-sharded DTensor inside a loss_parallel() context too."""
    logits = logits.float()
    if isinstance(logits, DTensor):
        per_token = -F.cross_entropy(logits, target_ids, reduction="none")
        return per_token.full_tensor() if isinstance(per_token, DTensor) else per_token
    if logits.requires_grad:
        return TokenLogProbs.apply(logits, target_ids)
    return torch.log_softmax(logits, dim=-1).gather(1, target_ids[:, None]).squeeze(1)


@dataclass
class PairSums:
    """Per pair of a chunk (in the order of their numbers), each reply's summed log-probability
    under the policy and the reference, and its number of tokens; (P, 2) each, column 0 the chosen."""

    policy: torch.Tensor
    reference: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def of(cls, log_probs: torch.Tensor, targets: torch.Tensor) -> PairSums:
        """From the (N,) policy log-probabilities of a chunk's (N, 4) reply targets."""
        pairs, number = torch.unique(targets[:, PAIR].long(), return_inverse=True)
        slot = number * 2 + (targets[:, SIDE].long() - CHOSEN)  # (N,): the pair's chosen or rejected column
        size = 2 * len(pairs)

        def summed(values: torch.Tensor) -> torch.Tensor:
            zeros = torch.zeros(size, dtype=values.dtype, device=values.device)
            return zeros.index_add(0, slot, values).view(-1, 2)

        tokens = summed(torch.ones_like(targets[:, SIDE]))
        if not bool((tokens > 0).all()):
            raise ValueError("a pair's chosen or rejected reply is missing from its rows: the pairs of a row "
                             "must not be cut apart; rebuild the data stage's output")
        return cls(summed(log_probs.double()), summed(targets[:, REFERENCE]), tokens)


@dataclass
class PreferenceObjective:
    """The preference loss of `cfg` and the step's running sums of TRL's metrics. The loss of a
    chunk is the sum of its pairs' losses (times each pair's weight, done by the caller).

    What a call computes besides its loss -- its metrics, or its recorded log-probabilities --
    counts only once the caller `keep`s the loss it became: a pipeline schedule also calls the
    loss function on placeholder activations to infer shapes before its first step, and drops
    that loss (it is in no microbatch's place)."""

    cfg: PreferenceConfig
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # per metric: its sum over the kept pairs
    recording: list[torch.Tensor] | None = None
    """While set (reference_log_probs), a chunk's per-target log-probabilities are recorded here,
    (b, T) each, instead of a loss."""
    _unclaimed: dict[str, torch.Tensor] | torch.Tensor | None = None  # the last call's, until `claim`
    _pending: list[tuple[torch.Tensor, dict[str, torch.Tensor] | torch.Tensor]] = field(default_factory=list)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed loss of the pairs of a chunk: (b, T, V) logits and (b, T, 4) targets, or only
        the counted positions' (1, N, V) and (1, N, 4)."""
        if self.recording is not None:
            return self._record(logits, targets)
        wanted = counted(targets)
        if isinstance(logits, DTensor):  # vocabulary-sharded: every position, then the counted ones
            ids = targets[..., TARGET_ID].long().clamp(min=0)
            log_probs = token_log_probs(logits.flatten(0, 1), ids.flatten())[wanted.flatten()]
        else:
            log_probs = token_log_probs(logits[wanted], targets[wanted][:, TARGET_ID].long())
        sums = PairSums.of(log_probs, targets[wanted])
        chosen, rejected = self._rewards(sums)
        margin = chosen - rejected
        losses = -F.logsigmoid(margin - (self.cfg.simpo_gamma if self.cfg.loss == "simpo" else 0.0))
        self._unclaimed = self._metric_sums(sums, chosen.detach(), rejected.detach())
        return losses.sum().float()

    def _rewards(self, sums: PairSums) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's (P,) rewards of its chosen and rejected reply: beta times the log-ratio to the
        reference (DPO), or times the mean log-probability (SimPO)."""
        if self.cfg.loss == "simpo":
            scores = sums.policy / sums.tokens
        else:
            scores = sums.policy - sums.reference
        return self.cfg.beta * scores[:, 0], self.cfg.beta * scores[:, 1]

    def _metric_sums(self, sums: PairSums, chosen: torch.Tensor, rejected: torch.Tensor,
                     ) -> dict[str, torch.Tensor]:
        # SimPO's log-probabilities are the length-averaged ones it scores (TRL's CPOTrainer logs those).
        policy = (sums.policy / sums.tokens if self.cfg.loss == "simpo" else sums.policy).detach()
        values = {"rewards/chosen": chosen, "rewards/rejected": rejected,
                  "rewards/margins": chosen - rejected, "rewards/accuracies": (chosen > rejected).double(),
                  "logps/chosen": policy[:, 0], "logps/rejected": policy[:, 1]}
        return {name: value.sum() for name, value in values.items()}

    def _record(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        wanted = counted(targets)
        ids = targets[..., TARGET_ID].long().clamp(min=0)
        log_probs = token_log_probs(logits.flatten(0, 1), ids.flatten()).view(ids.shape)
        self._unclaimed = log_probs.masked_fill(~wanted, 0.0).float().detach()
        return torch.zeros((), device=targets.device)

    def claim(self, loss: torch.Tensor) -> None:
        """The last call's metrics or recording belong to `loss`, what the loss function returned."""
        if self._unclaimed is not None:
            self._pending.append((loss, self._unclaimed))
            self._unclaimed = None

    def keep(self, losses: list[torch.Tensor]) -> None:
        """Count the calls whose losses are `losses` (those of the chunks the step computed, in
        order); forget the others."""
        for loss, what in self._pending:
            if any(loss is kept for kept in losses):
                if isinstance(what, torch.Tensor):
                    self.recording.append(what)
                else:
                    for name, value in what.items():
                        self.sums[name] = self.sums.get(name, 0.0) + value
        self._pending.clear()

    def reset(self) -> None:
        self.sums = {}
        self._pending.clear()

    def metrics(self, pairs: int, device: torch.device, groups: list[dist.ProcessGroup]) -> dict[str, float]:
        """TRL's metrics, means over the `pairs` of the global batch: the sums so far added over
        `groups` (the pipeline stages, of which only the last holds them, then the data-parallel
        ranks)."""
        totals = torch.stack([torch.as_tensor(self.sums.get(name, 0.0), dtype=torch.float64, device=device)
                              for name in STATS])
        for group in groups:
            dist.all_reduce(totals, group=group)
        self.reset()
        return {name: value / pairs if pairs else 0.0
                for name, value in zip(STATS, totals.tolist(), strict=True)}


# -- the reference's log-probabilities ------------------------------------------------------------

REFERENCE_FORMAT = "forgeline-reference/1"
REFERENCE_RECORD = "reference.json"
ALL_REDUCE_ROWS = 4096  # samples of a split's array summed over the ranks at a time


def reference_dir(data_dir: Path, identity: dict) -> Path:
    """Where the reference log-probabilities of the data in `data_dir` are kept for the model and
    precision `identity` names (the data's manifest, the base's weights, the shape, the dtype):
    beside the data, `<data_dir>.reference/<hash of the identity>/`, a split's array in
    `<split>.npy`. Outside the data stage's output, which DVC and the stage cache verify whole;
    any run from the same base on the same data, in any layout, reads the same arrays."""
    key = hashlib.sha256(json.dumps({"format": REFERENCE_FORMAT, **identity}, sort_keys=True).encode())
    return Path(f"{data_dir}.reference") / key.hexdigest()[:16]


def load_reference(directory: Path, split: str) -> np.ndarray:
    """A split's (samples, T) float32 reference log-probabilities, memory-mapped."""
    return np.load(directory / f"{split}.npy", mmap_mode="r")


def reference_written(directory: Path, device: torch.device) -> bool:
    """Collective: whether a run wrote the reference log-probabilities in `directory` before --
    as global rank 0 sees it, so that every rank takes the same way."""
    found = torch.tensor([int((directory / REFERENCE_RECORD).is_file())], device=device)
    dist.broadcast(found, src=0)
    if found.item():
        log.info("reference log-probabilities from %s", directory)
    return bool(found.item())


def reference_log_probs(log_probs_of: Callable[[torch.Tensor | object], torch.Tensor | None],
                        loaders: dict[str, ShardedSampleLoader], directory: Path, identity: dict,
                        contributes: bool, device: torch.device) -> None:
    """Collective: every split's reference log-probabilities into `directory`. `log_probs_of(batch)`
    is the step's forward-only (B, T) log-probabilities of a batch's reply tokens
    (TrainStep.target_log_probs: the model as it is now, the reference);
    each rank computes its slices of the split's global batches, one rank of each slice's model
    parts (`contributes`: the last pipeline stage, tensor-parallel rank 0) adds them to an array
    of the split summed over all ranks, and global rank 0 writes the arrays, whole or not at
    all."""
    started = time.perf_counter()
    arrays = {split: reference_of_split(log_probs_of, loader, contributes, device)
              for split, loader in loaders.items()}
    if dist.get_rank() == 0:
        directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            with new_directory(directory) as tmp:
                for split, array in arrays.items():
                    np.save(tmp / f"{split}.npy", array)
                record = {"format": REFERENCE_FORMAT, "identity": identity,
                          "samples": {split: len(array) for split, array in arrays.items()}}
                (tmp / REFERENCE_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        except OSError:  # another run on the same base and data wrote them meanwhile (refused, or
            if not (directory / REFERENCE_RECORD).is_file():  # its rename came between ours)
                raise
        log.info("reference log-probabilities of %s samples in %.1f s, in %s",
                 " + ".join(f"{len(array)} {split}" for split, array in arrays.items()),
                 time.perf_counter() - started, directory)
    dist.barrier()


def reference_of_split(log_probs_of: Callable[[object], torch.Tensor | None], loader: ShardedSampleLoader,
                       contributes: bool, device: torch.device) -> np.ndarray:
    """Collective: the (samples, T) reference log-probabilities of the split `loader` reads, on
    every rank."""
    samples = sum(shard.samples for shard in loader.shards)
    array: np.ndarray | None = None
    for ids, batch in loader.every_sample():
        log_probs = log_probs_of(batch.to(device))
        if log_probs is None or not contributes:
            continue
        if array is None:
            array = np.zeros((samples, log_probs.shape[1]), np.float32)
        first = ids >= 0  # a sample met again in the last, filled-up batch is summed once
        array[ids[first]] = log_probs.cpu().numpy()[first]
    width = torch.tensor([0 if array is None else array.shape[1]], device=device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    total = np.zeros((samples, int(width.item())), np.float32) if array is None else array
    for start in range(0, samples, ALL_REDUCE_ROWS):
        chunk = torch.from_numpy(total[start:start + ALL_REDUCE_ROWS]).to(device)
        dist.all_reduce(chunk)
        total[start:start + ALL_REDUCE_ROWS] = chunk.cpu().numpy()
    return total
