"""Single-process inference: load a model from a checkpoint (any parallel layout) or from an
inference bundle, and generate text."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from forgeline.configs.schema import LoraConfig, ModelConfig
from forgeline.model.checkpoint.manager import load_model_weights, read_checkpoint_manifest
from forgeline.model.lora import apply_lora, export_peft_adapter, merge_lora
from forgeline.model.transformer import KVCache, Transformer

BUNDLE_WEIGHTS = "model.safetensors"
BUNDLE_SHAPE = "model_args.json"  # the model's shape (ModelConfig); the name of the first bundles


def _materialized(shape: ModelConfig, device: torch.device | str) -> Transformer:
    with torch.device("meta"):
        model = Transformer(shape)
    model.to_empty(device=device)
    model.init_buffers()  # weights come from the caller
    return model


def checkpoint_shape(checkpoint: str | Path) -> ModelConfig:
    """The shape of the model a checkpoint holds, from its manifest (no weights read)."""
    return ModelConfig(**read_checkpoint_manifest(Path(checkpoint))["model_args"])


def load_from_checkpoint(checkpoint: str | Path, device: torch.device | str = "cpu",
                         merge_adapters: bool = True) -> Transformer:
    """The checkpoint's model. A LoRA run's checkpoint (its manifest's `lora`) holds adapters
    beside the frozen weights: folded into them (model/lora.py merge_lora), or kept as such
    with `merge_adapters=False`."""
    checkpoint = Path(checkpoint)
    model = _materialized(checkpoint_shape(checkpoint), device)
    lora = checkpoint_lora(checkpoint)
    if lora:
        apply_lora(model, lora)
    load_model_weights(model, checkpoint)
    if lora and merge_adapters:
        merge_lora(model)
    return model.eval()


def checkpoint_lora(checkpoint: str | Path) -> LoraConfig | None:
    """The adapters a checkpoint holds (model/lora.py), None for a plain model."""
    lora = read_checkpoint_manifest(Path(checkpoint)).get("lora")
    return LoraConfig(**lora) if lora else None


def export_checkpoint_adapter(checkpoint: str | Path, out_dir: Path) -> Path | None:
    """A LoRA run's checkpoint's adapters as a `peft` adapter directory; None (nothing written)
    for a checkpoint without adapters. Its base is recorded as the run's base (its uri)."""
    manifest = read_checkpoint_manifest(Path(checkpoint))
    if not manifest.get("lora"):
        return None
    model = load_from_checkpoint(checkpoint, merge_adapters=False)
    base = manifest.get("base")
    return export_peft_adapter(model, LoraConfig(**manifest["lora"]), out_dir,
                               base_model=base and base["uri"])


def save_bundle(model: Transformer, out_dir: Path) -> None:
    """Weights (safetensors) and architecture (JSON): all inference needs besides a tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out_dir / BUNDLE_WEIGHTS)
    (out_dir / BUNDLE_SHAPE).write_text(json.dumps(model.shape.model_dump(mode="json"), indent=2) + "\n")


def load_bundle(bundle_dir: str | Path, device: torch.device | str = "cpu") -> Transformer:
    bundle_dir = Path(bundle_dir)
    shape = ModelConfig(**json.loads((bundle_dir / BUNDLE_SHAPE).read_text()))
    model = _materialized(shape, device)
    model.load_state_dict(load_file(bundle_dir / BUNDLE_WEIGHTS, device=str(device)))
    return model.eval()


class PackedLinear(nn.Module):
    """An nn.Linear for inference on the CPU computed by oneDNN with its weight reordered once
    into oneDNN's blocked layout, rather than by the default (MKL) GEMM on the plain weight.
    On the 2-core AVX-512 machine of bench/README.md: the tiny model's vocabulary
    projection at the 10 rows of a decoding step 2.7x faster, whole-sequence forwards ~10%
    (bench/eval). Results are the plain layer's to fp32 rounding. The original weight stays,
    so the state dict (and an export from it) is unchanged; the packed copy is taken once, so
    pack after the weights are final."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> nn.Module:
    """Make `model` (inference only: the packed layers have no backward) use PackedLinear for
    its fp32 linear layers where it runs on a CPU with oneDNN; elsewhere leave it as it is."""
    if not torch.backends.mkldnn.is_available():
        return model
    for module in list(model.modules()):
        for name, child in module.named_children():
            if (isinstance(child, nn.Linear) and child.weight.device.type == "cpu"
                    and child.weight.dtype == torch.float32):
                setattr(module, name, PackedLinear(child))
    return model


def generate_batch(model: Transformer, prompts: list[list[int]], max_new_tokens: int,
                   temperature: float = 0.0, stop_token: int | None = None,
                   stop: Callable[[int, list[int]], bool] | None = None,
                   generator: torch.Generator | None = None, top_p: float = 1.0,
                   batch_size: int | None = None,
                   ended: Callable[[int], None] | None = None) -> list[list[int]]:
    """Each prompt's new tokens, decoded together (stream_batch). A row ends at `stop_token`
    (not included) or once `stop(row, new_tokens)` is true; `ended(row)` is called then."""
    new: list[list[int]] = [[] for _ in prompts]
    for row, token in stream_batch(model, prompts, max_new_tokens, temperature, top_p,
                                   () if stop_token is None else (stop_token,), stop, generator,
                                   batch_size, ended):
        new[row].append(token)
    return new


@torch.no_grad()
def stream_batch(model: Transformer, prompts: list[list[int]], max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, stop_tokens: Collection[int] = (),
                 stop: Callable[[int, list[int]], bool] | None = None,
                 generator: torch.Generator | None = None, batch_size: int | None = None,
                 ended: Callable[[int], None] | None = None) -> Iterator[tuple[int, int]]:
    """Greedy (temperature 0) or sampled (sample_next) continuations of `prompts`, decoded
    together with a KV cache: yields (row, token) for each new token as soon as it is chosen. A
    row ends at a token of `stop_tokens` (not yielded), after max_new_tokens, or once
    `stop(row, new_tokens)` is true; `ended(row)` is called then. Prompts are cut to their last
    max_seq_len - max_new_tokens tokens.

    At most `batch_size` rows (default: all) decode at once; a row that ends gives its place to
    the next prompt waiting (continuous batching), so a batch is not held up by its longest
    reply while the rest of it idles. Each prompt but its last token is computed in one forward
    as it enters; every step then feeds each row one token, a prompt's last or the one just
    chosen."""
    room = model.shape.max_seq_len - max_new_tokens
    if room < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in "
                         f"max_seq_len={model.shape.max_seq_len}")
    if max_new_tokens < 1 or not prompts:
        return
    prompts = [p[-room:] for p in prompts]
    waiting = deque(range(len(prompts)))
    slots = min(batch_size or len(prompts), len(prompts))
    decoding = Decoding(model, slots, max(map(len, prompts)) + max_new_tokens)
    decoding.admit(range(decoding.slots), waiting, prompts)
    new: list[list[int]] = [[] for _ in prompts]
    while decoding.rows:
        chosen = sample_next(decoding.step(), temperature, top_p, generator)
        done = []
        for slot, (row, token) in enumerate(zip(decoding.rows, chosen.tolist(), strict=True)):
            if token not in stop_tokens:
                new[row].append(token)
                yield row, token
            if (token in stop_tokens or len(new[row]) == max_new_tokens
                    or (stop is not None and stop(row, new[row]))):
                done.append(slot)
                if ended is not None:
                    ended(row)
        decoding.feed = chosen
        if done:
            decoding.release(decoding.admit(done, waiting, prompts))


class Decoding:
    """The rows being decoded, one per slot of a KV cache, and the token each is fed next."""

    def __init__(self, model: Transformer, slots: int, max_len: int):
        self.model, self.slots = model, slots
        weight = next(model.parameters())
        # Columns for a prompt and a short reply first: many rows end long before max_len.
        self.cache = KVCache(model.shape, slots, max_len, weight.device, weight.dtype, reserve=512)
        self.rows: list[int] = [-1] * slots  # the prompt each slot decodes
        self.feed = torch.zeros(slots, dtype=torch.long, device=weight.device)

    def step(self) -> torch.Tensor:
        """Feed every row its token: (rows, V) logits of the next."""
        return self.model.logits(self.model.hidden_states(self.feed[:, None], self.cache)[:, -1]).float()

    def admit(self, slots: Collection[int], waiting: deque[int], prompts: list[list[int]]) -> list[int]:
        """Give these slots the next prompts waiting; returns the slots left without one."""
        taken = [(slot, waiting.popleft()) for slot in list(slots)[:len(waiting)]]
        if taken:
            places = torch.tensor([slot for slot, _ in taken], device=self.feed.device)
            heads = [prompts[row][:-1] for _, row in taken]
            self.cache.place(places, self.prefilled(heads))
            self.feed[places] = torch.tensor([prompts[row][-1] for _, row in taken], device=self.feed.device)
            for slot, row in taken:
                self.rows[slot] = row
        return list(slots)[len(taken):]

    def prefilled(self, heads: list[list[int]]) -> KVCache:
        """A cache of `heads`, one a row, computed in one forward (right-padded: the padding's
        columns lie past each row's length, where no query looks)."""
        weight = next(self.model.parameters())
        width = max(1, max(map(len, heads)))
        cache = KVCache(self.model.shape, len(heads), width, weight.device, weight.dtype)
        if any(heads):
            tokens = torch.zeros(len(heads), width, dtype=torch.long, device=weight.device)
            for row, head in enumerate(heads):
                tokens[row, :len(head)] = torch.tensor(head, dtype=torch.long, device=weight.device)
            self.model.hidden_states(tokens, cache)
        cache.lengths = torch.tensor(list(map(len, heads)), device=weight.device)
        return cache

    def release(self, slots: list[int]) -> None:
        """Drop these slots, which no prompt took: no compute spent on them."""
        if not slots:
            return
        keep = [slot for slot in range(len(self.rows)) if slot not in set(slots)]
        index = torch.tensor(keep, dtype=torch.long, device=self.feed.device)
        self.cache.select(index)
        self.feed = self.feed.index_select(0, index)
        self.rows = [self.rows[slot] for slot in keep]


def sample_next(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Each row's next token (B,) from its logits (B, V): the likeliest at temperature 0, else
    drawn from softmax(logits / temperature) restricted to the likeliest tokens whose
    probability together first reaches `top_p` (nucleus sampling; 1 keeps every token)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        ranked, order = probs.sort(dim=-1, descending=True)
        ranked[ranked.cumsum(-1) - ranked >= top_p] = 0  # the mass before a token reached top_p already
        probs = torch.zeros_like(probs).scatter_(-1, order, ranked)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
