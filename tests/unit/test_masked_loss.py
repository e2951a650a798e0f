"""The loss of masked targets (supervised fine-tuning: assistant tokens only), in one process:
only masked targets count, each the same wherever it sits -- in a short answer or a long one,
in any micro-step -- so accumulation over micro-steps changes neither the loss nor the update.
Across data-parallel ranks and pipeline stages: tests/integration/test_sft.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from forgeline.configs.schema import ModelConfig
from forgeline.model.training.loader import DocumentBatch
from forgeline.model.training.step import TrainStep
from forgeline.model.transformer import Transformer

VOCAB, SEQ_LEN, ROWS = 64, 16, 4


def tiny_step(grad_accum_steps: int) -> TrainStep:
    model = Transformer(ModelConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                    max_seq_len=32))
    model.init_weights(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainStep(parts=[model], optimizers=[optimizer], schedulers=[], grad_accum_steps=grad_accum_steps,
                     grad_clip=0.0, device=torch.device("cpu"), dp_group=dist.group.WORLD)


def uneven_batch() -> DocumentBatch:
    """Rows whose loss tokens differ in number: the first row's answer is long, the others' short."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ_LEN + 1), generator=generator)
    mask = torch.zeros(ROWS, SEQ_LEN + 1, dtype=torch.bool)
    mask[0, 3:] = True  # 14 loss tokens
    mask[1:, -2:] = True  # 2 each
    documents = torch.zeros(ROWS, SEQ_LEN + 1, dtype=torch.int32)
    return DocumentBatch(tokens, documents, mask)


def masked_mean(model: torch.nn.Module, batch: DocumentBatch) -> torch.Tensor:
    """The reference: cross-entropy of the masked targets, every one weighing the same."""
    logits = model(batch.tokens[:, :-1], documents=batch.documents[:, :-1])
    losses = F.cross_entropy(logits.flatten(0, 1), batch.tokens[:, 1:].flatten(), reduction="none")
    keep = batch.loss_mask[:, 1:].flatten()
    return losses[keep].mean()


def test_only_masked_targets_count_each_the_same(process_group: None) -> None:
    step = tiny_step(grad_accum_steps=1)
    batch = uneven_batch()
    expected = masked_mean(step.parts[0], batch).item()
    assert step.validation_loss([batch]) == pytest.approx(expected, rel=1e-6)
    assert step(batch).loss == pytest.approx(expected, rel=1e-6)


def test_accumulating_over_micro_steps_changes_neither_loss_nor_update(process_group: None) -> None:
    """Two micro-steps of 2 rows: one holds 16 loss tokens, the other 4. A mean of per-micro-step
    means would weigh a token of the second 4 times one of the first (loss and gradient)."""
    whole, accumulated = tiny_step(grad_accum_steps=1), tiny_step(grad_accum_steps=2)
    batch = uneven_batch()
    first, second = whole(batch), accumulated(batch)
    assert second.loss == pytest.approx(first.loss, rel=1e-6)
    assert second.grad_norm == pytest.approx(first.grad_norm, rel=1e-5)
    for a, b in zip(whole.parts[0].parameters(), accumulated.parts[0].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_mask_of_every_target_is_the_unmasked_loss(process_group: None) -> None:
    step = tiny_step(grad_accum_steps=2)
    batch = uneven_batch()
    everything = DocumentBatch(batch.tokens, batch.documents, torch.ones_like(batch.loss_mask))
    unmasked = DocumentBatch(batch.tokens, batch.documents)
    assert step.validation_loss([everything]) == pytest.approx(step.validation_loss([unmasked]), rel=1e-6)


def test_a_batch_without_a_loss_token_adds_nothing(process_group: None) -> None:
    step = tiny_step(grad_accum_steps=1)
    batch = uneven_batch()
    result = step(DocumentBatch(batch.tokens, batch.documents, torch.zeros_like(batch.loss_mask)))
    assert result.loss == 0.0 and result.grad_norm == 0.0 and not result.nonfinite


def test_packed_conversations_train_as_the_conversations_alone(process_group: None) -> None:
    """Conversations packed into rows (document masking), answers masked: the step's loss and
    update equal those of every conversation run alone, its answer tokens averaged."""
    from tests.unit.test_document_masking import packed_batch, separate_logits, tiny_model, token_losses

    packed = packed_batch()
    mask = torch.rand(packed.tokens.shape, generator=torch.Generator().manual_seed(1)) < 0.4
    batch = DocumentBatch(packed.tokens, packed.documents, mask)
    reference = tiny_model()
    separate = separate_logits(reference, batch.tokens[:, :-1], batch.documents[:, :-1])
    loss = token_losses(separate, batch.tokens[:, 1:])[mask[:, 1:].flatten()].mean()
    loss.backward()
    model = tiny_model()
    step = TrainStep(parts=[model], optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)], schedulers=[],
                     grad_accum_steps=2, grad_clip=1e6, device=torch.device("cpu"), dp_group=dist.group.WORLD)
    assert step(batch).loss == pytest.approx(loss.item(), rel=1e-5)
    for after, before in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(after, before - 0.1 * before.grad, rtol=1e-5, atol=1e-6)
