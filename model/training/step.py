"""What one optimizer step computes, apart from the loop around it: forward and backward over
`grad_accum_steps` micro-steps -- through the pipeline schedule when pp > 1 -- then (fp16)
unscaling, clipping by the global gradient norm over every rank, and the optimizer and LR
steps. An update whose gradient is not finite is skipped (the LR schedule still advances, so
step and learning rate stay in lockstep). `validation_loss` runs the same micro-steps forward
only: through the pipeline schedule's eval, or for the V schedules, whose eval fails in torch
2.13, stage after stage outside the schedule.

A batch is token ids, or a DocumentBatch (document masking): then the model parts -- every
pipeline stage -- also take the document of each input position. A DocumentBatch with a loss
mask (supervised fine-tuning: assistant tokens only) trains on the masked targets alone, each
weighing the same across the global batch: a step's loss is the sum of their token losses over
their count in the whole global batch (every rank, micro-step and microbatch), not a mean of
per-chunk means, which would weigh a token of a short answer more than one of a long answer.
A DocumentBatch of preference pairs (its `sides`) trains on the preference objective
(preference.py) instead, each pair weighing the same across the global batch."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import _PipelineSchedule, get_schedule_class
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from forgeline.configs.schema import V_SCHEDULES
from forgeline.model.parallel.pipelining import stage_ids_of_rank
from forgeline.model.parallel.tied import TiedEmbeddingCopies
from forgeline.model.training.amp import DynamicLossScaler
from forgeline.model.training.loader import DocumentBatch
from forgeline.model.training.optim import clip_coefficient, clip_grad_norm_
from forgeline.model.training.preference import (
    IGNORED,
    PreferenceObjective,
    counted,
    pair_count,
    preference_targets,
)

V_SCHEDULE_CLASSES = tuple(get_schedule_class(name) for name in sorted(V_SCHEDULES))
ACTIVATION_DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # what stages pass on
Batch = torch.Tensor | DocumentBatch  # (B, T + 1) token ids, with their documents or without


@dataclass
class StepResult:
    loss: float  # mean cross-entropy over the global batch (the preference loss over its pairs)
    grad_norm: float
    skipped: bool  # no update was applied (fp16 overflow, or non-finite)
    nonfinite: bool  # the loss or the gradient was inf/NaN -- not an fp16 overflow
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's own (preference: TRL's)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Token cross-entropy of (B, T, V) logits, targets IGNORED left out; vocabulary-sharded
    DTensor logits work inside a loss_parallel() context. Logits that need a gradient, plain, go
    through TokenCrossEntropy: the same loss and gradient, in fewer passes over the logits."""
    logits, targets = logits.flatten(0, 1).float(), targets.flatten()
    if logits.requires_grad and not isinstance(logits, DTensor):
        return TokenCrossEntropy.apply(logits, targets, reduction == "sum")
    return F.cross_entropy(logits, targets, ignore_index=IGNORED, reduction=reduction)


class TokenCrossEntropy(torch.autograd.Function):
    """F.cross_entropy's mean (or sum) over the targets not IGNORED, whose backward turns the
    saved log-probabilities into the logits' gradient in place: softmax times each token's weight,
    less that weight at its target. Autograd's way fills a zero (N, V) gradient for nll_loss and
    makes a new one from it in log_softmax's backward: two more passes over the largest
    activation of a small model's step (vocabulary 49152: 50 MB at 2 x 128 tokens)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, total: bool) -> torch.Tensor:  # noqa: ANN001
        log_probs = torch.log_softmax(logits, dim=-1)  # (N, V)
        counted = targets != IGNORED
        ctx.total, ctx.used = total, False
        ctx.save_for_backward(log_probs, targets.masked_fill(~counted, 0)[:, None], counted, counted.sum())
        return F.nll_loss(log_probs, targets, ignore_index=IGNORED, reduction="sum" if total else "mean")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        if ctx.used:
            raise RuntimeError("TokenCrossEntropy's backward consumes its saved log-probabilities: once only")
        ctx.used = True
        log_probs, known, counted, count = ctx.saved_tensors
        weights = (counted * (grad if ctx.total else grad / count))[:, None]  # (N, 1)
        grad_logits = log_probs.exp_().mul_(weights)
        return grad_logits.scatter_add_(1, known, -weights), None, None


@dataclass
class TokenWeight:
    """The weight of one target token in a step's loss when targets are masked -- of one pair,
    for preference pairs: the data-parallel degree over the loss tokens (pairs) of the global
    batch (FSDP averages gradients over the data-parallel ranks, so each rank's sum is scaled up
    by their number). None: unmasked, each chunk's mean counts."""

    per_token: float | None = None
    units: int = 0  # the loss tokens (pairs) of the global batch it was set for


def micro_steps(batch: Batch, n: int) -> list[Batch]:
    """The batch cut into `n` micro-steps along the batch dimension."""
    size = -(-len(batch.tokens if isinstance(batch, DocumentBatch) else batch) // n)  # as Tensor.chunk cuts
    if isinstance(batch, DocumentBatch):
        return [batch.rows(slice(start, start + size)) for start in range(0, len(batch.tokens), size)]
    return list(batch.chunk(n))


def model_inputs(micro: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The (B, T) inputs and targets of a micro-step, and the keyword arguments every model part
    takes with them: the (B, T) documents of the input positions under document masking.
    Targets outside a loss mask are IGNORED; those of preference pairs are (B, T, 4)
    (preference.py preference_targets)."""
    if isinstance(micro, DocumentBatch):
        kwargs = {"documents": micro.documents[:, :-1]}
        if micro.sides is not None:
            return micro.tokens[:, :-1], preference_targets(micro.tokens, micro.documents, micro.sides,
                                                            micro.reference), kwargs
        targets = micro.tokens[:, 1:]
        if micro.loss_mask is not None:
            targets = targets.masked_fill(~micro.loss_mask[:, 1:], IGNORED)
        return micro.tokens[:, :-1], targets, kwargs
    return micro[:, :-1], micro[:, 1:], {}


def counted_positions(targets: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the positions whose targets count (not IGNORED; a reply's, of pairs)."""
    return counted(targets) if targets.dim() == 3 else targets != IGNORED


def loss_token_count(batches: list[Batch]) -> int:
    """The masked targets of `batches` -- their pairs, of preference pairs -- (0 when they carry no
    loss mask)."""
    return sum(pair_count(batch.documents, batch.sides) if batch.sides is not None
               else int(batch.loss_mask[:, 1:].sum()) for batch in batches
               if isinstance(batch, DocumentBatch) and batch.loss_mask is not None)


def scaled_loss(logits: torch.Tensor, targets: torch.Tensor, parts_per_step: int,
                scaler: DynamicLossScaler | None, weight: TokenWeight | None = None,
                objective: PreferenceObjective | None = None) -> torch.Tensor:
    """The loss whose backward adds this chunk's share to the step's gradients: the chunk's
    mean divided by the number of chunks in the step (gradients sum over them) -- or, with
    masked targets, its token losses summed times their `weight`; of preference pairs, the
    `objective`'s pair losses summed times theirs -- times the fp16 loss scale. A chunk is a
    micro-step, or a pipeline microbatch of one (then parts_per_step = grad_accum_steps *
    pp_microbatches; this is the schedule's loss_fn)."""
    if objective is not None and targets.dim() == 3:
        loss = objective(logits, targets) * weight.per_token
    elif weight is not None and weight.per_token is not None:
        loss = cross_entropy(logits, targets, reduction="sum") * weight.per_token
    else:
        loss = cross_entropy(logits, targets) / parts_per_step
    scaled = loss * scaler.scale if scaler is not None else loss
    if objective is not None:
        objective.claim(scaled)
    return scaled


@dataclass
class TrainStep:
    """One optimizer step over this rank's model parts (one, or this rank's pipeline stages)."""

    parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler]
    grad_accum_steps: int
    grad_clip: float
    device: torch.device
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup | None = None  # set when pipeline parallel
    schedule: _PipelineSchedule | None = None
    is_first_stage: bool = True
    is_last_stage: bool = True
    loss_parallel: bool = False
    autocast_dtype: torch.dtype | None = None  # low precision without FSDP's MixedPrecisionPolicy
    scaler: DynamicLossScaler | None = None  # fp16
    tied: TiedEmbeddingCopies | None = None  # tied embeddings split over pipeline stages
    weight: TokenWeight = field(default_factory=TokenWeight)  # shared with the schedule's loss_fn
    objective: PreferenceObjective | None = None  # preference tuning's loss, shared with it too

    def __call__(self, batch: Batch) -> StepResult:
        """`batch`: this rank's (B, T + 1) token ids for the whole step (with their documents)."""
        params = [p for part in self.parts for p in part.parameters() if p.requires_grad]
        self._weigh_loss_tokens([batch])
        loss_sum = torch.zeros((), device=self.device)
        for index, micro in enumerate(micro_steps(batch, self.grad_accum_steps)):
            self._set_gradient_sync(index == self.grad_accum_steps - 1)
            loss_sum += self._forward_backward(micro)
        if self.tied is not None:
            self.tied.sum_gradients()
        overflow = self.scaler is not None and self.scaler.unscale_(params, self.device)
        # The norm is global (reduced over every rank), so every rank takes the same decision.
        duplicates = self.tied.duplicates if self.tied is not None else ()
        clip_in_step = self._clips_in_optimizer_step(params)
        norm = clip_grad_norm_(params, 0.0 if clip_in_step else self.grad_clip, self.pp_group, duplicates)
        grad_norm = norm.item()
        apply = math.isfinite(grad_norm) and not overflow
        if apply:
            for optimizer in self.optimizers:
                if clip_in_step:  # the fused kernel divides each gradient by it as it reads it
                    optimizer.grad_scale = 1 / clip_coefficient(norm, self.grad_clip)
                optimizer.step()
        if self.scaler is not None:
            self.scaler.update(overflow)
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        for scheduler in self.schedulers:
            scheduler.step()
        loss = self._global_mean(loss_sum)
        nonfinite = not overflow and not (math.isfinite(grad_norm) and math.isfinite(loss))
        return StepResult(loss, grad_norm, skipped=not apply, nonfinite=nonfinite,
                          metrics=self.objective_metrics())

    def objective_metrics(self) -> dict[str, float]:
        """The objective's metrics over the batches of the last step or validation (none but
        the loss for next-token prediction)."""
        if self.objective is None:
            return {}
        groups = [self.pp_group] if self.pp_group is not None else []
        return self.objective.metrics(self.weight.units, self.device, [*groups, self.dp_group])

    def _clips_in_optimizer_step(self, params: list[nn.Parameter]) -> bool:
        """Whether clipping rides on the optimizer step: fused AdamW takes a divisor of every
        gradient (`grad_scale`, which GradScaler sets), where clipping on its own rewrites every
        gradient first, a pass over all of them (~2% of bench/cpt.py's step). Plain tensors only:
        the divisor is one, not a DTensor."""
        return (self.grad_clip > 0 and all(optimizer.defaults.get("fused") for optimizer in self.optimizers)
                and not any(isinstance(param, DTensor) for param in params))

    @torch.no_grad()
    def validation_loss(self, batches: list[Batch]) -> float:
        """Mean token cross-entropy of `batches` -- this rank's (B, T + 1) slices of global
        batches -- over all ranks: forward only, in the micro-steps (and pipeline microbatches)
        of a training step, so that it fits wherever training does. Every target token weighs
        the same (the batches and their chunks are of equal size; masked targets weigh the same
        across all the batches)."""
        self._weigh_loss_tokens(batches)
        loss_sum = torch.zeros((), device=self.device)
        for batch in batches:
            for micro in micro_steps(batch.to(self.device), self.grad_accum_steps):
                loss_sum += self._forward_backward(micro, backward=False)
        # A forward without backward leaves FSDP units gathered (the root always; under pipeline
        # parallelism all): shard them again, as a training step leaves them, so that the next
        # step sees (and clips) the sharded parameters that hold the gradients.
        for part in self.parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        per_batch = 1 if self.weight.per_token is not None else len(batches)
        return self._global_mean(loss_sum / per_batch)

    @torch.no_grad()
    def target_log_probs(self, batch: DocumentBatch) -> torch.Tensor | None:
        """(B, T) log-probabilities of this rank's batch's counted targets (0 elsewhere): the
        forward of a validation, recorded by the objective (preference.py reference_log_probs). On
        the last pipeline stage; None on the others."""
        self.objective.recording = recorded = []
        try:
            self.validation_loss([batch])
        finally:
            self.objective.recording = None
            self.objective.reset()
        return torch.cat(recorded) if self.is_last_stage else None

    def _weigh_loss_tokens(self, batches: list[Batch]) -> None:
        """Sets the weight of a masked target for these batches: their loss tokens are counted
        over the data-parallel ranks (every rank holds its batch whole, pipeline stages too)."""
        if not any(isinstance(batch, DocumentBatch) and batch.loss_mask is not None for batch in batches):
            self.weight.per_token = None
            return
        count = torch.tensor(float(loss_token_count(batches)), dtype=torch.float64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self.dp_group)
        # A batch without one loss token (every answer truncated away) adds nothing, not NaN.
        self.weight.per_token = self.dp_group.size() / count.item() if count.item() else 0.0
        self.weight.units = int(count.item())

    def _forward_backward(self, micro: Batch, backward: bool = True) -> torch.Tensor:
        """The micro-step's share of the step's loss (unscaled) -- its mean over the number of
        micro-steps, or its masked token losses' sum times their weight --, after its backward
        (unless not `backward`)."""
        inputs, targets, model_kwargs = model_inputs(micro)
        with self._compute_context():
            if self.schedule is not None:
                scaled = self._pipelined(inputs, targets, model_kwargs, backward)
            else:
                if self._counted_logits_only():
                    wanted = counted_positions(targets)  # (B, T)
                    logits = self.parts[0](inputs, **model_kwargs, outputs=wanted)[None]  # (1, N, V)
                    targets = targets[wanted][None]  # (1, N), or (1, N, 4) of preference pairs
                else:
                    logits = self.parts[0](inputs, **model_kwargs)  # (B, T, V)
                scaled = scaled_loss(logits, targets, self.grad_accum_steps, self.scaler, self.weight,
                                     self.objective)
                self._keep([scaled])
                if backward:
                    scaled.backward()
        if isinstance(scaled, DTensor):  # replicated loss of loss_parallel
            scaled = scaled.full_tensor()
        unscale = self.scaler.scale if self.scaler is not None else 1.0
        return scaled.detach() / unscale

    def _keep(self, losses: list[torch.Tensor]) -> None:
        """The objective counts what the chunks of `losses` computed beside them (PreferenceObjective)."""
        if self.objective is not None:
            self.objective.keep(losses)

    def _counted_logits_only(self) -> bool:
        """Whether the model projects only the positions whose targets count: targets are masked
        (their token losses summed, so the others add nothing) and the output layer is not
        tensor-parallel (its input may be a share of the sequence)."""
        recording = self.objective is not None and self.objective.recording is not None
        if self.weight.per_token is None or recording:  # a recording keeps the (B, T) positions
            return False
        weight = self.parts[0].output.weight
        return not (isinstance(weight, DTensor) and "tp" in (weight.device_mesh.mesh_dim_names or ()))

    def _pipelined(self, inputs: torch.Tensor, targets: torch.Tensor, model_kwargs: dict[str, torch.Tensor],
                   backward: bool = True) -> torch.Tensor:
        """The schedule runs forward and backward of all microbatches (forward only unless
        `backward`); only the last stage sees their losses (scaled_loss of each, so their sum
        is the micro-step's scaled loss), other stages return 0. The schedule cuts
        `model_kwargs` into microbatches too and passes each to the stages of the rank that
        gives them -- activations are all a stage receives -- so every rank gives them."""
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets, "losses": losses} if self.is_last_stage else {}
        args = (inputs,) if self.is_first_stage else ()
        if backward:
            self.schedule.step(*args, **kwargs, **model_kwargs)
        elif isinstance(self.schedule, V_SCHEDULE_CLASSES):
            return self._staged_forward(inputs, targets, model_kwargs)
        else:
            self.schedule.eval(*args, **kwargs, **model_kwargs)
        self._keep(losses)
        return torch.stack(losses).sum() if self.is_last_stage else torch.zeros((), device=self.device)

    def _staged_forward(self, inputs: torch.Tensor, targets: torch.Tensor,
                        model_kwargs: dict[str, torch.Tensor]) -> torch.Tensor:
        """What `_pipelined` returns, forward only and without the schedule: the whole micro-step
        goes through the stages in order, each pipeline rank running the ones it holds (in V
        placement, pipelining.py) and passing activations on to the next stage's rank. torch
        2.13's V schedules fail in eval(): they take local gradients between their two stages
        even without a backward."""
        pp, pp_rank = self.pp_group.size(), self.pp_group.rank()
        stages_of = {rank: stage_ids_of_rank(rank, pp, len(self.parts), v_style=True) for rank in range(pp)}
        owner = {stage: rank for rank, stages in stages_of.items() for stage in stages}
        mine = dict(zip(stages_of[pp_rank], self.parts, strict=True))  # parts come in that order
        last = len(owner) - 1
        h = inputs  # (B, T) tokens, then (B, T, C) activations (T / tp of them with sequence parallel)
        for stage, part in sorted(mine.items()):
            if stage > 0 and owner[stage - 1] != pp_rank:
                h = self._receive_activations(owner[stage - 1])
            h = part(h, **model_kwargs)
            if stage < last and owner[stage + 1] != pp_rank:
                self._send_activations(h, owner[stage + 1])
        if last not in mine:
            return torch.zeros((), device=self.device)
        scaled = scaled_loss(h, targets, self.grad_accum_steps, self.scaler, self.weight, self.objective)
        self._keep([scaled])
        return scaled

    def _send_activations(self, h: torch.Tensor, pp_rank: int) -> None:
        header = torch.tensor([*h.shape, ACTIVATION_DTYPES.index(h.dtype)], device=self.device)
        dist.send(header, group=self.pp_group, group_dst=pp_rank)
        dist.send(h.contiguous(), group=self.pp_group, group_dst=pp_rank)

    def _receive_activations(self, pp_rank: int) -> torch.Tensor:
        header = torch.empty(4, dtype=torch.int64, device=self.device)  # (B, T, C) and the dtype
        dist.recv(header, group=self.pp_group, group_src=pp_rank)
        *shape, dtype = header.tolist()
        h = torch.empty(shape, dtype=ACTIVATION_DTYPES[dtype], device=self.device)
        dist.recv(h, group=self.pp_group, group_src=pp_rank)
        return h

    def _compute_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if self.loss_parallel:
            stack.enter_context(loss_parallel())
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype))
        return stack

    def _set_gradient_sync(self, last_micro_step: bool) -> None:
        """FSDP reduces gradients only on the last micro-step of an accumulation (pipeline
        stages manage this themselves per microbatch)."""
        if self.schedule is None:
            for part in self.parts:
                if isinstance(part, FSDPModule):
                    part.set_requires_gradient_sync(last_micro_step)

    def _global_mean(self, loss: torch.Tensor) -> float:
        """Average over data-parallel ranks (of masked targets: their sum over all, as each
        rank's share is scaled up by the data-parallel degree); with pipeline parallelism only
        the last stage holds the loss, so it is summed over the pipeline (the other stages add 0)."""
        if self.pp_group is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.pp_group)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dp_group)
        return loss.item()
