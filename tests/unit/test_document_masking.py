"""Document masking (train.document_masking) in one process: every token of a packed row gets the
logits and loss of its document run alone -- in the model, in the loader's document numbers, and
through a training step with gradient accumulation. Tensor, sequence and pipeline parallelism:
tests/integration/test_document_masking.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from forgeline.configs import load_config
from forgeline.configs.schema import ModelConfig
from forgeline.model.training.loader import DocumentBatch, ShardedSampleLoader
from forgeline.model.training.shards import ShardInfo, write_shard
from forgeline.model.training.step import TrainStep
from forgeline.model.transformer import (
    DENSE_MASK_MAX_LEN,
    Transformer,
    dense_document_mask,
    document_positions,
)

T, VOCAB = 16, 64
# Per row, the document number of each of its T + 1 tokens (the last one is only a target):
# three whole documents; the tail of an earlier document, then two; one document only.
DOCUMENTS = torch.tensor([
    [1] * 5 + [2] * 7 + [3] * 5,
    [0] * 3 + [1] * 9 + [2] * 5,
    [0] * 17,
    [1] * 2 + [2] * 2 + [3] * 13,
], dtype=torch.int32)


def tiny_model(max_seq_len: int = 32, **shape: int) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                        ffn_dim=64, max_seq_len=max_seq_len, **shape))
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model


def packed_batch() -> DocumentBatch:
    tokens = torch.randint(0, VOCAB, (len(DOCUMENTS), T + 1), generator=torch.Generator().manual_seed(0))
    return DocumentBatch(tokens, DOCUMENTS)


def segments(documents: torch.Tensor) -> list[slice]:
    """The positions of each document of one row of (T,) document numbers."""
    _, counts = torch.unique_consecutive(documents, return_counts=True)
    ends = counts.cumsum(0).tolist()
    return [slice(begin, end) for begin, end in zip([0, *ends[:-1]], ends, strict=True)]


def separate_logits(model: Transformer, inputs: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits with every document of every row run alone, as a batch of one."""
    return torch.stack([
        torch.cat([model(row[None, part])[0] for part in segments(row_documents)])
        for row, row_documents in zip(inputs, documents, strict=True)
    ])


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")


@torch.no_grad()
def test_packed_rows_give_the_losses_of_their_documents_run_separately() -> None:
    model, batch = tiny_model(), packed_batch()
    inputs, targets, documents = batch.tokens[:, :-1], batch.tokens[:, 1:], batch.documents[:, :-1]
    packed = model(inputs, documents=documents)
    separate = separate_logits(model, inputs, documents)
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(token_losses(packed, targets), token_losses(separate, targets), rtol=1e-5,
                               atol=1e-5)
    # One document is plain causal attention; across documents, the mask is what changes the logits.
    plain = model(inputs)
    torch.testing.assert_close(packed[2], plain[2], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(packed[0, 5:], plain[0, 5:], atol=1e-3)


@torch.no_grad()
@pytest.mark.parametrize("shape", [{}, {"sliding_window": 40}])
def test_long_packed_rows_attend_document_by_document_to_the_same_logits(shape: dict) -> None:
    """Rows longer than DENSE_MASK_MAX_LEN take DocumentSpans instead of the dense mask: still the
    logits of the dense mask and of each document run alone, with a sliding window too."""
    length = DENSE_MASK_MAX_LEN + 44
    model = tiny_model(max_seq_len=length, **shape)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, VOCAB, (2, length), generator=generator)
    documents = (torch.rand(2, length, generator=generator) < 0.02).cumsum(dim=1)
    documents[1] = 0  # a row of one document, longer than the window
    packed = model(inputs, documents=documents)
    dense = model.logits(model.hidden_states(inputs, positions=document_positions(documents),
                                             mask=dense_document_mask(documents)))
    torch.testing.assert_close(packed, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed, separate_logits(model, inputs, documents), rtol=1e-5, atol=1e-5)


def test_the_loader_numbers_the_documents_from_their_starts(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    samples = [rng.integers(1, VOCAB, T + 1).astype(np.uint16) for _ in DOCUMENTS]
    # The data stage's starts: the offsets where a document begins (none inside a long document).
    starts = [np.flatnonzero(np.diff(row.numpy(), prepend=0)).astype(np.int32) for row in DOCUMENTS]
    entry = write_shard(tmp_path, "train", 0, samples, starts, 0)
    shard = ShardInfo(tmp_path / entry["path"], entry["samples"], entry["sha256"])
    batch = ShardedSampleLoader([shard], len(samples), 0, 1, seed=3, document_starts=True).next_batch()
    assert isinstance(batch, DocumentBatch) and batch.tokens.dtype == torch.int64
    expected = {tuple(sample.tolist()): row for sample, row in zip(samples, DOCUMENTS, strict=True)}
    assert len(batch.tokens) == len(samples)
    for tokens, documents in zip(batch.tokens, batch.documents, strict=True):
        assert torch.equal(documents, expected[tuple(tokens.tolist())])
    plain = ShardedSampleLoader([shard], len(samples), 0, 1, seed=3).next_batch()
    assert torch.equal(plain, batch.tokens)


def test_a_train_step_over_micro_steps_follows_the_separate_documents(process_group: None) -> None:
    """Loss, gradient norm and (plain SGD) update of a step with 2 micro-steps equal those of the
    whole batch's documents run one by one."""
    batch = packed_batch()
    reference = tiny_model()
    separate = separate_logits(reference, batch.tokens[:, :-1], batch.documents[:, :-1])
    loss = token_losses(separate, batch.tokens[:, 1:]).mean()
    loss.backward()
    grads = [p.grad for p in reference.parameters()]
    model = tiny_model()
    step = TrainStep(parts=[model], optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)], schedulers=[],
                     grad_accum_steps=2, grad_clip=1e6, device=torch.device("cpu"), dp_group=dist.group.WORLD)
    result = step(batch)
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    assert result.grad_norm == pytest.approx(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g) for g in grads])).item(), rel=1e-5)
    for after, before, grad in zip(model.parameters(), reference.parameters(), grads, strict=True):
        torch.testing.assert_close(after, before - 0.1 * grad, rtol=1e-5, atol=1e-6)
    assert step.validation_loss([batch]) == pytest.approx(
        token_losses(separate_logits(model, batch.tokens[:, :-1], batch.documents[:, :-1]),
                     batch.tokens[:, 1:]).mean().item(), rel=1e-5)


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], False),  # auto, from scratch
    (["model.init_from=base"], True),  # auto, from a pretrained base
    (["model.init_from=base", "train.document_masking=false"], False),
    (["train.document_masking=true"], True),
])
def test_auto_is_on_for_runs_from_a_base(overrides: list[str], expected: bool) -> None:
    assert load_config("debug.yaml", overrides).masks_documents is expected
