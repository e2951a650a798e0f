"""Single-process inference: load a model from a checkpoint (any parallel layout) or from an
inference bundle, and generate text."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from forgeline.model.checkpoint import load_model_weights, read_checkpoint_manifest
from forgeline.model.llama import ModelArgs, Transformer

BUNDLE_WEIGHTS = "model.safetensors"
BUNDLE_ARGS = "model_args.json"


def _materialized(args: ModelArgs, device: torch.device | str) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_buffers()  # weights come from the caller
    return model


def load_from_checkpoint(checkpoint: str | Path, device: torch.device | str = "cpu") -> Transformer:
    checkpoint = Path(checkpoint)
    args = ModelArgs(**read_checkpoint_manifest(checkpoint)["model_args"])
    model = _materialized(args, device)
    load_model_weights(model, checkpoint)
    return model.eval()


def save_bundle(model: Transformer, out_dir: Path) -> None:
    """Weights (safetensors) and architecture (JSON): all inference needs besides a tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out_dir / BUNDLE_WEIGHTS)
    (out_dir / BUNDLE_ARGS).write_text(json.dumps(model.args.to_dict(), indent=2) + "\n")


def load_bundle(bundle_dir: str | Path, device: torch.device | str = "cpu") -> Transformer:
    bundle_dir = Path(bundle_dir)
    args = ModelArgs(**json.loads((bundle_dir / BUNDLE_ARGS).read_text()))
    model = _materialized(args, device)
    model.load_state_dict(load_file(bundle_dir / BUNDLE_WEIGHTS, device=str(device)))
    return model.eval()


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
             stop_token: int | None = None, stop: Callable[[list[int]], bool] | None = None,
             generator: torch.Generator | None = None) -> list[int]:
    """Greedy (temperature 0) or sampled continuation of `prompt`; returns the new tokens.
    Ends at `stop_token`, or once `stop(new_tokens)` is true. The context is cut to the
    model's last max_seq_len tokens."""
    device = next(model.parameters()).device
    tokens = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([tokens[-model.args.max_seq_len:]], device=device)
        logits = model(window)[0, -1].float()  # (V,)
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        else:
            token = int(logits.argmax())
        if token == stop_token:
            break
        tokens.append(token)
        new.append(token)
        if stop is not None and stop(new):
            break
    return new
