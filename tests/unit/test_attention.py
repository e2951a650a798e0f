"""Attention over packed documents and sliding windows computed document by document
(DocumentSpans, model/transformer.py) gives the outputs and gradients of the dense (B, 1, T, T) mask it
replaces, and never forms scores wider than a document or a window's block."""

from __future__ import annotations

import pytest
import torch

from forgeline.configs.schema import ModelConfig
from forgeline.model.transformer import (
    MIN_WINDOW_BLOCK,
    Attention,
    DocumentSpans,
    dense_document_mask,
    rope_cache,
)

T = 2 * MIN_WINDOW_BLOCK + 88  # long enough for a windowed document to take three blocks
# Per row, the length of each document: several of random lengths; one document as long as the row.
LENGTHS = [[37, 1, 300, 2, 100, 160], [T]]


def document_numbers(lengths: list[list[int]]) -> torch.Tensor:
    """(B, T) document numbers of rows of documents of these lengths; the first row starts at 3 (the
    tail of a document begun in an earlier row)."""
    return torch.stack([
        torch.repeat_interleave(torch.arange(len(row)) + 3 * (index == 0), torch.tensor(row))
        for index, row in enumerate(lengths)
    ])


def dense_mask(documents: torch.Tensor, window: int | None) -> torch.Tensor:
    """The reference: (B, 1, T, T) block-causal mask, narrowed to the window where there is one."""
    mask = dense_document_mask(documents)
    if window is None:
        return mask
    index = torch.arange(documents.size(1))
    return mask & (index[:, None] - index[None, :] < window)


def attention(window: int | None = None, softcap: float | None = None, n_kv_heads: int = 2) -> Attention:
    torch.manual_seed(0)
    shape = ModelConfig(vocab_size=64, dim=48, n_layers=1, n_heads=4, n_kv_heads=n_kv_heads, ffn_dim=64,
                        max_seq_len=T, attn_logit_softcap=softcap)
    layer = Attention(shape, window)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return layer


def forward_backward(layer: Attention, x: torch.Tensor,
                     mask: torch.Tensor | DocumentSpans | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output, and the gradients of the input and of every parameter of a fixed random loss."""
    layer.zero_grad()
    x = x.detach().requires_grad_()
    out = layer(x, rope_cache(layer.head_dim, T, 1e4), mask=mask)  # (B, T, C)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    return out.detach(), [x.grad, *(p.grad for p in layer.parameters())]


def assert_all_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Within fp32 rounding of each tensor's largest element: a parameter's gradient sums over every
    token, in another order in each path."""
    for tensor, reference in zip(actual, expected, strict=True):
        torch.testing.assert_close(tensor, reference, rtol=0, atol=1e-5 * reference.abs().max().item())


@pytest.mark.parametrize(("window", "softcap", "n_kv_heads"), [
    (None, None, 2),  # grouped-query attention
    (None, None, 4),
    (24, None, 2),  # windows shorter than some documents: blocks of MIN_WINDOW_BLOCK queries
    (MIN_WINDOW_BLOCK + 40, None, 2),  # blocks as wide as the window
    (None, 5.0, 2),  # soft-capped scores (Gemma 2)
    (24, 5.0, 2),
])
def test_documents_give_the_outputs_and_gradients_of_the_dense_mask(window: int | None, softcap: float | None,
                                                                     n_kv_heads: int) -> None:
    layer, documents = attention(window, softcap, n_kv_heads), document_numbers(LENGTHS)
    x = torch.randn(len(LENGTHS), T, 48, generator=torch.Generator().manual_seed(2))
    dense_out, dense_grads = forward_backward(layer, x, dense_mask(documents, window))
    out, grads = forward_backward(layer, x, DocumentSpans.of(documents))
    assert_all_close([out, *grads], [dense_out, *dense_grads])


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_a_long_row_in_a_window_gives_the_dense_windows_outputs_and_gradients(softcap: float | None) -> None:
    """Without documents, a row longer than the window: blocks, where the window mask was T x T."""
    layer = attention(window=24, softcap=softcap)
    x = torch.randn(2, T, 48, generator=torch.Generator().manual_seed(2))
    dense_out, dense_grads = forward_backward(layer, x, dense_mask(torch.zeros(2, T), window=24))
    out, grads = forward_backward(layer, x, None)
    assert_all_close([out, *grads], [dense_out, *dense_grads])


def test_the_spans_are_the_documents_of_each_row() -> None:
    spans = DocumentSpans.of(document_numbers([[2, 3, 1], [6]]))
    assert spans.rows == (((0, 2), (2, 5), (5, 6)), ((0, 6),))


@pytest.mark.parametrize(("window", "lengths", "widest"), [
    (None, LENGTHS[0], (300, 300)),  # the longest document, of T = 600
    (24, [T], (MIN_WINDOW_BLOCK, MIN_WINDOW_BLOCK + 24 - 1)),  # a block, and the window before it
])
def test_scores_span_a_document_or_a_windows_block_not_the_row(window: int | None, lengths: list[int],
                                                               widest: tuple[int, int],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The most queries and keys attention takes at once, where the dense mask took T x T."""
    layer, blocks = attention(window), []
    attend = layer.attend

    def recorded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        blocks.append((q.size(2), k.size(2)))
        return attend(q, k, v, mask)

    monkeypatch.setattr(layer, "attend", recorded)
    spans = DocumentSpans.of(document_numbers([lengths]))
    layer(torch.randn(1, T, 48), rope_cache(layer.head_dim, T, 1e4), mask=spans)
    assert (max(q for q, _ in blocks), max(k for _, k in blocks)) == widest
