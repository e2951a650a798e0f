"""The decoder of every family forgeline trains: RMSNorm, rotary embeddings, a gated feed-forward
block, grouped-query attention -- and the variations of it the families of model/families/ need,
each a key of its `ModelConfig` (configs/schema.py): q/k/v biases, q/k norms, a head width of its
own, sliding-window layers, rescaled or per-layer rotary frequencies, GeGLU, 1 + w norm gains,
sandwich norms, scaled embeddings, soft-capped scores and logits.

Architecture only. Parallelism is applied from outside (model/parallel/). The model is meant to
be built on the meta device, parallelized, then materialized with `to_empty()` and initialized
with `init_weights()`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from forgeline.configs.schema import ModelConfig, RopeScaling
from forgeline.model.init import InitFn, canonical_name, init_param_


class RMSNorm(nn.Module):
    """x / rms(x), computed in fp32, times the gain: w, or 1 + w with `offset` (Gemma, which also
    applies the gain before casting back)."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return normed.type_as(x) * self.weight


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                     device=None) -> torch.Tensor:
    """(head_dim // 2,) rotary frequencies, rescaled as `scaling` says (Hugging Face's
    rope_type `linear` or `llama3`)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths slowed down by `factor`, short ones kept, a blend between.
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > context / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    blend = (context / wavelength - low) / (high - low)
    blended = (1 - blend) * slowed / scaling.factor + blend * slowed
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, blended, slowed)


def rope_cache(head_dim: int, max_seq_len: int, theta: float, device=None,
               scaling: RopeScaling | None = None) -> torch.Tensor:
    """(max_seq_len, head_dim // 2, 2) table of cos and sin for rotary embeddings."""
    inv_freq = rope_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(max_seq_len, device=device).float(), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap): x squashed smoothly into (-cap, cap) (Gemma 2)."""
    return x if cap is None else torch.tanh(x / cap) * cap


def sliding_window_mask(mask: torch.Tensor | None, T: int, window: int) -> torch.Tensor | None:
    """`mask` (True: may attend; None: causal) narrowed to keys less than `window` positions
    before their query, for T queries at positions 0.. over the keys up to them; None where the
    window covers the causal mask anyway."""
    keys = mask.size(-1) if mask is not None else T
    if keys <= window:
        return mask
    device = mask.device if mask is not None else None
    queries, key_positions = torch.arange(T, device=device), torch.arange(keys, device=device)
    near = key_positions[None, :] > queries[:, None] - window  # (T, S)
    if mask is None:
        return near & (key_positions[None, :] <= queries[:, None])
    return mask & near


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document numbers -> (B, T) each token's position counted from its document's first token."""
    index = torch.arange(documents.size(1), device=documents.device)  # (T,)
    begins = torch.ones_like(documents, dtype=torch.bool)  # (B, T): a document's first token
    begins[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(begins, index, 0).cummax(dim=1).values  # (B, T)


def dense_document_mask(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document numbers -> (B, 1, T, T) block-causal mask, True where a query may attend to a
    key: the T x T form of DocumentSpans, for compiled blocks (and the reference its tests and
    bench/attention.py compare against)."""
    index = torch.arange(documents.size(1), device=documents.device)  # (T,)
    same_document = documents[:, :, None] == documents[:, None, :]  # (B, T, T)
    return (same_document & (index[:, None] >= index[None, :]))[:, None]  # (B, 1, T, T)


@dataclass(frozen=True)
class DocumentSpans:
    """The documents of packed rows as (begin, end) token offsets: attention is computed document by
    document, in memory linear in T, where a (B, 1, T, T) mask grows with T squared."""

    rows: tuple[tuple[tuple[int, int], ...], ...]  # per row, its documents' (begin, end), in order
    documents: torch.Tensor  # (B, T) the document numbers they were read from

    @classmethod
    def of(cls, documents: torch.Tensor) -> DocumentSpans:
        """From (B, T) document numbers, equal within a document and changing at its first token."""
        T = documents.size(1)
        # One transfer for the whole batch (a device sync per forward, not per row or layer).
        changes = (documents[:, 1:] != documents[:, :-1]).nonzero().tolist()  # [[row, first token - 1]]
        starts: list[list[int]] = [[0] for _ in range(documents.size(0))]
        for row, before in changes:
            starts[row].append(before + 1)
        rows = tuple(tuple(zip(begins, [*begins[1:], T], strict=True)) for begins in starts)
        return cls(rows, documents)

    @classmethod
    def whole(cls, batch: int, T: int, device: torch.device) -> DocumentSpans:
        """Rows of one document each: plain causal rows, for the blocks of a sliding window."""
        return cls((((0, T),),) * batch, torch.zeros(batch, T, dtype=torch.int32, device=device))


# Rows up to this long keep the dense mask: its T x T is at most 64 KiB a row, and one kernel call for
# the batch beats one per document there (documents by document took 1.04-1.15x the time at T = 128,
# 1.07x at 256, 0.93x at 512: bench/attention.py --batch 8 --lengths 128 256 384 512
# --longest-document 128).
DENSE_MASK_MAX_LEN = 256

# A sliding-window layer computes a long document in blocks of queries as wide as the window, and at
# least this wide: blocks of a few queries would take as many kernel calls as tokens.
MIN_WINDOW_BLOCK = 256


def attention_blocks(begin: int, end: int, window: int | None) -> Iterator[tuple[int, int, int]]:
    """(first query, end, first key) of the blocks one document's attention is computed in: the
    whole document, or where a window is shorter than the document, blocks of queries each over the
    keys in their windows."""
    if window is None or end - begin <= window:
        yield begin, end, begin
        return
    size = max(window, MIN_WINDOW_BLOCK)
    for first in range(begin, end, size):
        yield first, min(first + size, end), max(begin, first - window + 1)


def band_mask(first_query: int, end: int, first_key: int, window: int, device: torch.device) -> torch.Tensor:
    """(L, S) True where the queries first_query..end may attend to the keys first_key..end: causal,
    less than `window` positions back."""
    queries = torch.arange(first_query, end, device=device)[:, None]  # (L, 1)
    keys = torch.arange(first_key, end, device=device)[None, :]  # (1, S)
    return (keys <= queries) & (keys > queries - window)


def apply_rope(x: torch.Tensor, rope: torch.Tensor, layout: str = "interleaved") -> torch.Tensor:
    """Rotate pairs of channels of x (B, T, H, D) by position-dependent angles: each pair and
    its (cos, sin) viewed as complex numbers, one multiplication (a single kernel, where
    rotating with real arithmetic takes a dozen passes over x). `layout` says which channels
    pair up (ModelConfig.rope_layout): (2k, 2k+1), or (k, k + D/2)."""
    # rope: (T', D/2, 2), the table from position 0; or (B, T, D/2, 2), a position per token.
    rotation = torch.view_as_complex(rope[..., : x.size(1), :, :]).unsqueeze(-2)  # ([B,] T, 1, D/2)
    if layout == "half":
        first, second = x.float().chunk(2, dim=-1)
        rotated = torch.complex(first, second) * rotation
        return torch.cat([rotated.real, rotated.imag], dim=-1).type_as(x)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # (B, T, H, D/2)
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


class KVCache:
    """Keys and values of the tokens decoded so far, for incremental decoding (inference only).
    Each row holds its own sequence from column 0, `lengths[row]` columns of it filled, and its
    tokens sit at their own positions: rows of different lengths decode together without
    padding between them, and a row whose sequence ended can take a new one (`place`) while
    the others go on (continuous batching, model/inference.py stream_batch). Columns past a
    row's length may hold stale keys: no query ever sees them."""

    def __init__(self, shape: ModelConfig, batch: int, max_len: int, device: torch.device,
                 dtype: torch.dtype, reserve: int | None = None):
        """`max_len` columns at most; `reserve` of them allocated at first (all by default),
        more as rows reach them."""
        self.max_len = max_len
        size = (batch, shape.n_kv_heads, min(max_len, reserve or max_len), shape.head_dim)
        self.keys = {str(i): torch.zeros(size, device=device, dtype=dtype) for i in range(shape.n_layers)}
        self.values = {str(i): torch.zeros(size, device=device, dtype=dtype) for i in range(shape.n_layers)}
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions: torch.Tensor | None = None  # (B, T) of the forward in progress
        self.mask: torch.Tensor | None = None  # (B, 1, T, S): True where a query sees a key

    def _reach(self, end: int) -> None:
        """Have at least `end` columns: grown by doubling, up to max_len."""
        if end > self.max_len:
            raise ValueError(f"a row would reach position {end}, past the cache's {self.max_len}")
        columns = next(iter(self.keys.values())).size(2)
        if end > columns:
            grown = min(self.max_len, max(end, 2 * columns))
            self.keys = {layer: _widened(t, grown) for layer, t in self.keys.items()}
            self.values = {layer: _widened(t, grown) for layer, t in self.values.items()}

    def begin(self, new: int) -> None:
        """Before a forward of `new` tokens a row, each row's appended after its filled columns:
        a token sees its own row's columns up to itself. The columns grow (doubling, up to
        max_len) only as far as the rows reach."""
        self.positions = self.lengths[:, None] + torch.arange(new, device=self.lengths.device)  # (B, T)
        end = int(self.lengths.max()) + new
        self._reach(end)
        keys = torch.arange(end, device=self.lengths.device)
        self.mask = (keys <= self.positions[:, :, None])[:, None]  # (B, 1, T, end)

    def windowed(self, window: int) -> torch.Tensor:
        """The forward's mask narrowed to keys less than `window` positions before their query."""
        keys = torch.arange(self.mask.size(-1), device=self.mask.device)
        return self.mask & (keys > self.positions[:, :, None] - window)[:, None]

    def append(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's (B, H_kv, T, D) keys and values at their rows' positions; return
        every row's columns up to the farthest position of the forward."""
        rows = torch.arange(k.size(0), device=k.device)[:, None]  # (B, 1), against positions (B, T)
        self.keys[layer][rows, :, self.positions] = k.transpose(1, 2)  # indexed: (B, T, H_kv, D)
        self.values[layer][rows, :, self.positions] = v.transpose(1, 2)
        end = self.mask.size(-1)
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def end(self, new: int) -> None:
        self.lengths += new
        self.positions = self.mask = None

    def select(self, rows: torch.Tensor) -> None:
        """Keep these batch rows, in this order: e.g. drop the rows that finished decoding."""
        self.keys = {k: v.index_select(0, rows) for k, v in self.keys.items()}
        self.values = {k: v.index_select(0, rows) for k, v in self.values.items()}
        self.lengths = self.lengths.index_select(0, rows)

    def place(self, rows: torch.Tensor, other: KVCache) -> None:
        """Make these rows hold `other`'s sequences (one each, in order), whatever they held."""
        width = int(other.lengths.max())
        self._reach(width)
        for layer in self.keys:
            self.keys[layer][rows, :, :width] = other.keys[layer][:, :, :width]
            self.values[layer][rows, :, :width] = other.values[layer][:, :, :width]
        self.lengths[rows] = other.lengths


def _widened(t: torch.Tensor, columns: int) -> torch.Tensor:
    """(B, H, S, D) -> (B, H, columns, D), the first S columns carried over."""
    wide = t.new_zeros(t.size(0), t.size(1), columns, t.size(3))
    wide[:, :, :t.size(2)] = t
    return wide


class Attention(nn.Module):
    def __init__(self, shape: ModelConfig, window: int | None = None):
        super().__init__()
        self.n_heads = shape.n_heads
        self.n_kv_heads = shape.n_kv_heads
        self.head_dim = shape.head_dim
        self.rope_layout = shape.rope_layout
        self.window = window
        self.scale = (shape.query_pre_attn_scalar or shape.head_dim) ** -0.5
        self.score_cap = shape.attn_logit_softcap
        self.wq = nn.Linear(shape.dim, shape.n_heads * self.head_dim, bias=shape.qkv_bias)
        self.wk = nn.Linear(shape.dim, shape.n_kv_heads * self.head_dim, bias=shape.qkv_bias)
        self.wv = nn.Linear(shape.dim, shape.n_kv_heads * self.head_dim, bias=shape.qkv_bias)
        self.wo = nn.Linear(shape.n_heads * self.head_dim, shape.dim, bias=False)
        if shape.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, shape.norm_eps, shape.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, shape.norm_eps, shape.norm_offset)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None,
                layer: str = "", mask: torch.Tensor | DocumentSpans | None = None) -> torch.Tensor:
        """`mask` (B or 1, 1, T, S): True where a query may attend to a key; DocumentSpans: within
        each document, causal; None: causal."""
        B, T, _ = x.shape
        # -1 instead of the head counts: under tensor parallelism each rank holds a slice.
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope, self.rope_layout), apply_rope(k, rope, self.rope_layout)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        given = mask
        spans = self.document_spans(mask, cache, B, T, x.device)
        if spans is not None:
            return self.wo(self.attend_documents(q, k, v, spans).transpose(1, 2).reshape(B, T, -1))
        if isinstance(mask, DocumentSpans):
            # A compiled block would be recompiled for every new set of spans: it takes the dense mask.
            mask = dense_document_mask(mask.documents)
        # A mask the caller built is narrowed to the window by the Transformer, by token position
        # (packed sequences that share a context are not contiguous); the causal rows, a cache's
        # grid and the documents' spans by index, here.
        if self.window is not None and cache is not None:
            mask = cache.windowed(self.window)
        elif self.window is not None and not isinstance(given, torch.Tensor):
            mask = sliding_window_mask(mask, q.size(2), self.window)
        if cache is not None:
            k, v = cache.append(layer, k, v)  # (B, H_kv, S, D): the past and these positions
        out = self.attend(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def document_spans(self, mask: torch.Tensor | DocumentSpans | None, cache: KVCache | None, B: int, T: int,
                       device: torch.device) -> DocumentSpans | None:
        """The spans to attend over document by document, or None: causal rows that a window does
        not narrow (the fused causal kernel), a cache or a dense mask (inference), a compiled block."""
        if torch.compiler.is_compiling() or cache is not None:
            return None
        if isinstance(mask, DocumentSpans):
            return mask
        if mask is None and self.window is not None and T > max(self.window, DENSE_MASK_MAX_LEN):
            return DocumentSpans.whole(B, T, device)  # a long row: its windows in blocks
        return None

    def attend_documents(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         spans: DocumentSpans) -> torch.Tensor:
        """(B, H, T, D) attention of each document's queries over its own keys, block by block."""
        rows = []
        for query_row, key_row, value_row, documents in zip(q.split(1), k.split(1), v.split(1), spans.rows,
                                                             strict=True):  # (1, H or H_kv, T, D) each
            blocks = [block for span in documents for block in attention_blocks(*span, self.window)]
            sizes = [end - first for first, end, _ in blocks]
            queries = query_row.split(sizes, dim=2)  # (1, H, L, D) each
            if all(first_key == first for first, _, first_key in blocks):
                # Blocks over their own keys only: split, whose backward is one concatenation (a slice's
                # fills a gradient as long as the row, per block).
                keys, values = key_row.split(sizes, dim=2), value_row.split(sizes, dim=2)  # (1, H_kv, L, D)
            else:
                keys = [key_row[:, :, first_key:end] for _, end, first_key in blocks]  # (1, H_kv, S, D)
                values = [value_row[:, :, first_key:end] for _, end, first_key in blocks]
            rows.append(torch.cat([
                self.attend(*block, self.block_mask(first, end, first_key, q.device))
                for *block, (first, end, first_key) in zip(queries, keys, values, blocks, strict=True)
            ], dim=2))  # (1, H, T, D)
        return torch.cat(rows)

    def block_mask(self, first: int, end: int, first_key: int, device: torch.device) -> torch.Tensor | None:
        """(L, S) mask of the block of queries first..end over the keys first_key..end; None where it
        is causal (the fused causal kernel): a whole document within the window."""
        if first_key == first and (self.window is None or end - first <= self.window):
            return None
        return band_mask(first, end, first_key, self.window, device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        gqa = self.n_heads != self.n_kv_heads
        if self.score_cap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                  scale=self.scale, enable_gqa=gqa)
        # Soft-capped scores: no fused kernel applies them, so the scores are formed here.
        if gqa:
            k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
        scores = softcap(q @ k.transpose(-2, -1) * self.scale, self.score_cap)  # (B, H, T, S)
        if mask is None:
            mask = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).type_as(q) @ v


class FeedForward(nn.Module):
    """Gated: w2(act(w1 x) * w3 x), SwiGLU with silu, GeGLU with tanh-approximated gelu."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)
        gate = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.w2(gate * self.w3(x))


def add_rows_to_grad(weight: nn.Parameter, tokens: torch.Tensor, grad: torch.Tensor) -> None:
    """Add the gradient of the embedding rows of `tokens` to `weight.grad` in place (what the
    embedding's backward computes, without a (V, C) matrix of its own)."""
    if weight.grad is None:  # the output projection's gradient may come after (then added to this)
        weight.grad = torch.zeros_like(weight)
    weight.grad.index_add_(0, tokens.flatten(), grad.flatten(0, 1).to(weight.grad.dtype))


class TransformerBlock(nn.Module):
    def __init__(self, shape: ModelConfig, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(shape.dim, shape.norm_eps, shape.norm_offset)
        self.attention = Attention(shape, shape.window_of(layer))
        self.ffn_norm = RMSNorm(shape.dim, shape.norm_eps, shape.norm_offset)
        self.feed_forward = FeedForward(shape.dim, shape.ffn_dim, shape.activation)
        if shape.sandwich_norms:
            self.attention_out_norm = RMSNorm(shape.dim, shape.norm_eps, shape.norm_offset)
            self.ffn_out_norm = RMSNorm(shape.dim, shape.norm_eps, shape.norm_offset)
        else:
            self.attention_out_norm = self.ffn_out_norm = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None,
                layer: str = "", mask: torch.Tensor | DocumentSpans | None = None) -> torch.Tensor:
        # cache, layer and mask by keyword: tensor parallelism's PrepareModuleInput lays out the
        # positional inputs (x, rope) only.
        h = self.attention(self.attention_norm(x), rope, cache=cache, layer=layer, mask=mask)
        x = x + (h if self.attention_out_norm is None else self.attention_out_norm(h))
        h = self.feed_forward(self.ffn_norm(x))
        return x + (h if self.ffn_out_norm is None else self.ffn_out_norm(h))


class Transformer(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab_size).

    A pipeline stage is a Transformer with some parts removed: without `tok_embeddings` it
    takes hidden states (B, T, C) instead of tokens, without `output` (and `norm`) it returns
    hidden states.
    """

    def __init__(self, shape: ModelConfig):
        super().__init__()
        if shape.vocab_size is None:
            raise ValueError("a Transformer needs the vocabulary size: ModelConfig.for_vocabulary()")
        self.shape = shape
        self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.dim)
        # A dict keyed by layer index, so pipeline stages can drop layers and keep the names
        # that checkpoints and initialization are keyed by.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(shape, i) for i in range(shape.n_layers)})
        self.norm = RMSNorm(shape.dim, shape.norm_eps, shape.norm_offset)
        self.output = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.tie_embeddings()
        self.register_buffer("rope", self.rope_table(), persistent=False)
        # Sliding-window layers with rotary frequencies of their own (Gemma 3) read this one.
        self.register_buffer("rope_local", self.rope_table(local=True), persistent=False)

    def rope_table(self, local: bool = False) -> torch.Tensor | None:
        shape = self.shape
        if local:
            if shape.local_rope_theta is None:
                return None
            return rope_cache(shape.head_dim, shape.max_seq_len, shape.local_rope_theta)
        return rope_cache(shape.head_dim, shape.max_seq_len, shape.rope_theta, scaling=shape.rope_scaling)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                documents: torch.Tensor | None = None, outputs: torch.Tensor | None = None) -> torch.Tensor:
        """With `cache`, `tokens` continue the positions it holds (incremental decoding).

        With `documents` (B, T) -- a number per token, equal within each document of a packed
        row and increasing along it -- a token attends only to its own document, and its rotary
        position counts from its document's first token: every document as if run alone. A
        pipeline stage takes them too (its `tokens` are then hidden states).

        `outputs` (B, T) bool: the logits of those positions only, (N, V) in row order -- a
        step whose loss counts some targets only (supervised fine-tuning's answers) skips the
        vocabulary projection, a large share of a small model's step, for the rest. Not under
        tensor parallelism (its states may be a share of the sequence)."""
        positions = mask = None
        if documents is not None:
            positions = document_positions(documents)
            short = documents.size(1) <= DENSE_MASK_MAX_LEN
            mask = dense_document_mask(documents) if short else DocumentSpans.of(documents)
        h = self.hidden_states(tokens, cache, positions, mask)
        if self.output is None:
            return h  # (B, T, C)
        return self.logits(h if outputs is None else h[outputs])  # (B, T, V), or (N, V)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., C) final states -> (..., V) logits."""
        return softcap(self.output(h), self.shape.final_logit_softcap)

    def hidden_states(self, tokens: torch.Tensor, cache: KVCache | None = None,
                      positions: torch.Tensor | None = None,
                      mask: torch.Tensor | DocumentSpans | None = None) -> torch.Tensor:
        """(B, T, C) states after the final norm: what `output` turns into logits. Inference
        that needs the logits of a few positions projects only those (the vocabulary projection
        is a large share of a small model's compute).

        Packed rows (several sequences per row; inference, without a cache) give each token's
        `positions` (B, T) within its sequence and the attention `mask`: (B, 1, T, T), True where
        a query may attend to a key, or the DocumentSpans of contiguous documents."""
        h = tokens
        if self.tok_embeddings is not None:
            h = self.embed(tokens)  # (B, T, C)
            if self.shape.embedding_scale:
                h = h * torch.tensor(self.shape.dim**0.5, dtype=h.dtype)
        T = h.size(1)
        if cache is not None:
            cache.begin(T)
            mask = cache.mask
        ropes = {table: self.positioned(table, positions, cache) for table in ("rope", "rope_local")}
        windowed = {}
        if cache is None and isinstance(mask, torch.Tensor):
            windowed = self.windowed_masks(mask, positions)
        for key, layer in self.layers.items():
            window = self.shape.window_of(int(key))
            local = self.rope_local is not None and window is not None
            h = layer(h, ropes["rope_local" if local else "rope"], cache=cache, layer=key,
                      mask=windowed.get(window, mask))
        if cache is not None:
            cache.end(T)
        return self.norm(h) if self.norm is not None else h

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) tokens -> (B, T, C) rows of the embedding. Tied to the output projection, in
        training, on a plain matrix (not sharded: no FSDP, no DTensor), the rows' gradient is added
        straight into the matrix's gradient, which the output projection's backward has made: the
        embedding's own backward would fill a zero (V, C) matrix for it and autograd add the two,
        three passes over the largest matrix of a small model. Same sums, one fewer (V, C) buffer."""
        weight = self.tok_embeddings.weight
        if not (torch.is_grad_enabled() and weight.requires_grad and self.output is not None
                and self.output.weight is weight and not isinstance(weight, DTensor)
                and not isinstance(self, FSDPModule)):
            return self.tok_embeddings(tokens)
        rows = F.embedding(tokens, weight.detach()).requires_grad_()
        rows.register_hook(partial(add_rows_to_grad, weight, tokens))
        return rows

    def windowed_masks(self, mask: torch.Tensor, positions: torch.Tensor | None) -> dict[int, torch.Tensor]:
        """`mask` (B, 1, T, T) narrowed to each sliding window of the model: a query sees the keys
        less than the window behind it by position (by index where no positions are given)."""
        if positions is None:
            positions = torch.arange(mask.size(-1), device=mask.device)[None]  # (1, T)
        behind = positions[:, None, :, None] - positions[:, None, None, :]  # (B, 1, T, T): query - key
        windows = {self.shape.window_of(i) for i in range(self.shape.n_layers)} - {None}
        return {window: mask & (behind < window) for window in windows}

    def positioned(self, table: str, positions: torch.Tensor | None,
                   cache: KVCache | None) -> torch.Tensor | None:
        """Rotary table `table` (`rope` or `rope_local`) for the tokens of a forward: each token's
        row of `positions` (B, T), or of the cache's positions for them, -> (B, T, D/2, 2); or the
        table from position 0 (under sequence parallelism the forward takes a rank's share)."""
        rope = getattr(self, table)
        if rope is None or (positions is None and cache is None):
            return rope
        return rope[positions if positions is not None else cache.positions]

    def tie_embeddings(self) -> None:
        """Make the output projection the embedding's matrix again: again after anything that
        replaced either parameter (tensor parallelism distributes each on its own)."""
        if self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        # Leaving the meta device (to_empty), Module._apply gives each module a new parameter
        # of its own: a tied pair would come out as two matrices.
        super()._apply(fn, recurse)
        if self.shape.tie_embeddings:
            self.tie_embeddings()
        return self

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Fill the (non-persistent) buffers; call after `to_empty()`."""
        self.rope.copy_(self.rope_table())
        if self.rope_local is not None:
            self.rope_local.copy_(self.rope_table(local=True))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialize every parameter and buffer in place; call after `to_empty()`. Values depend
        only on `seed` and each parameter's name (see model/init.py)."""
        self.init_buffers()
        for name, param in self.named_parameters():
            name = canonical_name(name)
            if self.shape.tie_embeddings and name == "output.weight":
                name = "tok_embeddings.weight"  # the last pipeline stage's copy: the same values
            init_param_(param, self._init_rule(name), seed, name)

    def _init_rule(self, name: str) -> InitFn:
        """Norm gains 1 (stored as 0 where applied as 1 + w); biases 0; embeddings N(0, 1);
        matrices truncated normal with std 0.02, the residual-branch outputs (wo, w2) scaled down
        with depth (GPT-2 / OLMo style), and the output projection with std dim**-0.5 -- also the
        embedding when it is the output projection (tied)."""
        if name.endswith("norm.weight"):
            return lambda t, g: nn.init.zeros_(t) if self.shape.norm_offset else nn.init.ones_(t)
        if name.endswith(".bias"):
            return lambda t, g: nn.init.zeros_(t)
        if name == "tok_embeddings.weight" and not self.shape.tie_embeddings:
            return lambda t, g: nn.init.normal_(t, std=1.0, generator=g)
        if name in ("output.weight", "tok_embeddings.weight"):
            std = self.shape.dim**-0.5
        elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            std = 0.02 / math.sqrt(2 * self.shape.n_layers)
        else:
            std = 0.02
        return lambda t, g: nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=g)
