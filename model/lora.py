"""Low-rank adapters (LoRA, Hu et al. 2021) on a Transformer, applied from outside the model
like the parallelisms (model/parallel/parallelize.py):

    build on meta -> apply_lora -> pipeline split -> TP -> AC -> compile -> FSDP
    -> to_empty() -> init_weights / init_buffers -> init_lora -> load the base

Each target linear becomes a `LoraLinear`: its weight W (out x in) frozen, plus A (r x in,
kaiming-uniform as `peft` draws it) and B (out x r, zeros), computing x W^T + (alpha / r) (x A^T) B^T.
B = 0 makes the adapted model the base at the start. Every other parameter is frozen, so the
optimizer (which takes the parameters that require grad) holds moments for the adapters only.
The adapters keep the base weight's module path -- `layers.0.attention.wq.weight` stays,
`layers.0.attention.wq.lora_a` and `.lora_b` join it -- so checkpoints, initialization by name
and the pipeline split treat them like any other parameter, and loading the base leaves them
alone.

Under tensor parallelism the adapters are split with their weight (`AdapterColwiseParallel`,
`AdapterRowwiseParallel`): a column-parallel linear's B by output row (A whole on every rank),
a row-parallel one's A by input column (B whole); each rank then adds its slice of the update
to its slice of the output (column), or its partial sum (row), with no collective of its own.

Export (`merge_lora`, `export_peft_adapter`): W + (alpha / r) B A into a plain model, which
model/hf.py exports as its family's transformers class; or the adapters alone as the directory `peft`
writes, whose `PeftModel.from_pretrained` on the base's export computes the merged model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from forgeline.configs.schema import LoraConfig, ModelConfig
from forgeline.model.fileio import new_directory
from forgeline.model.hf import hf_weights, rows_to_hf
from forgeline.model.init import canonical_name, init_param_
from forgeline.model.transformer import Transformer

if TYPE_CHECKING:  # peft is imported where it is used: the ranks never need it
    from peft import LoraConfig as PeftLoraConfig

# Hugging Face name of a target (LoraConfig.targets, peft's target_modules) -> our linears in a
# block: several where the family fuses them (Phi-3's qkv_proj, gate_up_proj).
TARGETS = {
    "q_proj": ("attention.wq",),
    "k_proj": ("attention.wk",),
    "v_proj": ("attention.wv",),
    "qkv_proj": ("attention.wq", "attention.wk", "attention.wv"),
    "o_proj": ("attention.wo",),
    "gate_proj": ("feed_forward.w1",),
    "up_proj": ("feed_forward.w3",),
    "gate_up_proj": ("feed_forward.w1", "feed_forward.w3"),
    "down_proj": ("feed_forward.w2",),
}
ADAPTER_NAMES = ("lora_a", "lora_b")
TRAINS_BIAS = "trains_bias"  # a linear's attribute: its bias trains beside the adapters (sft.lora.bias)
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


class LoraLinear(nn.Linear):
    """A linear layer plus a low-rank update: x W^T + b + scale * (x A^T) B^T. The bias, where
    the family has one (Qwen2's q/k/v), is the base's: frozen like W unless sft.lora.bias says."""

    def __init__(self, linear: nn.Linear, rank: int, scale: float):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight = linear.weight  # the base's parameter itself: on meta, or with its values
        self.bias = linear.bias
        self.scale = scale
        like = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, linear.in_features, **like))  # (r, in)
        self.lora_b = nn.Parameter(torch.empty(linear.out_features, rank, **like))  # (out, r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The order peft computes in (x -> A -> B, then the scale): the same rounding.
        update = F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale
        return F.linear(x, self.weight, self.bias) + update

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_a.shape[0]}, scale={self.scale}"


def apply_lora(model: Transformer, lora: LoraConfig) -> None:
    """Give the target linears of every block of `model` (or of a pipeline stage; on the meta
    device or materialized) adapters, and freeze every other parameter. Adapters made on a real device
    hold garbage until `init_lora`. A fused target (Phi-3's qkv_proj) gives each linear it holds
    adapters of its own: exported as one adapter of their ranks together (`peft_state_dict`).
    The linears whose bias trains (`lora.bias`) are marked for `freeze_base`."""
    check_targets(model.shape, lora)
    for block in model.layers.values():
        for target in lora.targets:
            for path in TARGETS[target]:
                parent_path, _, attr = path.rpartition(".")
                parent = block.get_submodule(parent_path)
                setattr(parent, attr, LoraLinear(getattr(parent, attr), lora.rank, lora.alpha / lora.rank))
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            trains = lora.bias == "all" or (lora.bias == "lora_only" and isinstance(module, LoraLinear))
            setattr(module, TRAINS_BIAS, trains)
    freeze_base(model)


def check_targets(shape: ModelConfig, lora: LoraConfig) -> None:
    """Targets are the family's own Hugging Face module names (as `peft` finds them in its
    export): q_proj for Llama, qkv_proj for Phi-3."""
    modules = {hf.split(".")[-2] for hf in hf_weights(shape)
               if hf.startswith("model.layers.0.") and hf.endswith("_proj.weight")}
    if wrong := [target for target in lora.targets if target not in modules]:
        raise ValueError(f"sft.lora.targets {wrong} are not linear layers of a {shape.family} model, "
                         f"whose are {sorted(modules)}")


def freeze_base(model: nn.Module) -> None:
    """Only the adapters train, and the biases `apply_lora` marked. Again after anything that
    replaces parameters with new ones that require grad (tensor parallelism's SequenceParallel
    does, for the norms)."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            param.requires_grad_(name in ADAPTER_NAMES or (name == "bias" and trains_bias(module)))


def trains_bias(module: nn.Module) -> bool:
    return getattr(module, TRAINS_BIAS, False)


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(module, LoraLinear) for module in model.modules())


def is_adapter(name: str) -> bool:
    """Whether the parameter `name` is an adapter (not one of the base's weights)."""
    return name.rpartition(".")[2] in ADAPTER_NAMES


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """Initialize the adapters in place (after `to_empty()`, sharded or not) as `peft` does:
    A kaiming-uniform (a = sqrt(5): uniform within +-1/sqrt(in)), B zeros. Like every
    parameter (model/init.py), A's values depend on the seed and its name only."""
    for name, param in model.named_parameters():
        if name.endswith(".lora_a"):
            init_param_(param, _kaiming_uniform, seed, name)
        elif name.endswith(".lora_b"):
            param.zero_()


def _kaiming_uniform(t: torch.Tensor, generator: torch.Generator) -> None:
    nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=generator)


class AdapterColwiseParallel(ColwiseParallel):
    """ColwiseParallel that also lays out a LoraLinear's adapters: B split by output row like
    the weight, A whole on every rank. (ColwiseParallel itself would split A along r.)"""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _distribute(module, device_mesh, self.src_data_rank,
                    {"weight": Shard(0), "bias": Shard(0), "lora_a": Replicate(), "lora_b": Shard(0)})


class AdapterRowwiseParallel(RowwiseParallel):
    """RowwiseParallel that also lays out a LoraLinear's adapters: A split by input column like
    the weight, B whole on every rank. (RowwiseParallel itself would leave them plain tensors.)"""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _distribute(module, device_mesh, self.src_data_rank,
                    {"weight": Shard(1), "lora_a": Shard(1), "lora_b": Replicate()})


def _distribute(module: nn.Module, mesh: DeviceMesh, src_data_rank: int | None,
                placements: dict[str, Placement]) -> None:
    """Each of these parameters of `module` (those it has: a plain nn.Linear has no adapters)
    as a DTensor with its placement, requires_grad kept."""
    for name, placement in placements.items():
        param = getattr(module, name, None)
        if param is None:
            continue
        dist_param = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist_param, requires_grad=param.requires_grad))


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight (W += scale * B A) and put plain nn.Linear layers back:
    the model computes the same, and its state dict is the base's names only. In place; a full
    (unsharded) model."""
    for module in list(model.modules()):
        for attr, child in list(module.named_children()):
            if isinstance(child, LoraLinear):
                child.weight.add_(child.lora_b @ child.lora_a, alpha=child.scale)
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                  device="meta")
                plain.weight, plain.bias = child.weight, child.bias
                setattr(module, attr, plain)
    return model


def peft_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """A full model's adapters under the names `peft` saves them for the family's Hugging Face
    model (base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight), B's rows in the
    Hugging Face order of its weight's rows (model/hf.py): the export's W + scale B A is then the
    permutation of ours. The adapters of a fused tensor's parts (Phi-3's qkv_proj) are one
    adapter of their ranks together: A stacked, B block-diagonal, so B A is each part's B A on
    its own rows. Biases that trained are saved where peft saves them: an adapted linear's as
    `{module}.base_layer.bias`, another's as `{module}.bias`."""
    ours = {canonical_name(name): param for name, param in model.state_dict().items()}
    trained_biases = {canonical_name(f"{name}.bias") for name, module in model.named_modules()
                      if trains_bias(module)}
    out = {}
    for hf, names in hf_weights(model.shape).items():
        if hf.endswith(".bias"):
            if any(name in trained_biases for name in names):
                module = hf.removesuffix(".bias")
                adapted = any(f"{name.removesuffix('.bias')}.lora_a" in ours for name in names)
                key = f"base_model.model.{module}.base_layer.bias" if adapted else f"base_model.model.{hf}"
                out[key] = torch.cat([rows_to_hf(name, ours[name], model.shape) for name in names])
            continue
        linears = [name.removesuffix(".weight") for name in names]
        adapted = [linear for linear in linears if f"{linear}.lora_a" in ours]
        if not adapted:
            continue
        module = hf.removesuffix(".weight")
        out[f"base_model.model.{module}.lora_A.weight"] = torch.cat([ours[f"{m}.lora_a"] for m in adapted])
        out[f"base_model.model.{module}.lora_B.weight"] = torch.block_diag(
            *(rows_to_hf(f"{m}.weight", ours[f"{m}.lora_b"], model.shape) for m in adapted))
    return out


def peft_config(lora: LoraConfig, base_model: str | None) -> PeftLoraConfig:
    """`peft`'s own LoraConfig of these adapters: it writes adapter_config.json. A fused target's
    adapter has the rank of its parts together, and alpha to keep their scale alpha / rank."""
    from peft import LoraConfig as PeftLoraConfig

    parts = {target: len(TARGETS[target]) for target in lora.targets if len(TARGETS[target]) > 1}
    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.targets),
                          rank_pattern={t: n * lora.rank for t, n in parts.items()},
                          alpha_pattern={t: n * lora.alpha for t, n in parts.items()},
                          lora_dropout=0.0, bias=lora.bias, task_type="CAUSAL_LM", inference_mode=True,
                          base_model_name_or_path=base_model)


def export_peft_adapter(model: Transformer, lora: LoraConfig, out_dir: Path,
                        base_model: str | None = None) -> Path:
    """Write `out_dir` as `peft`'s save_pretrained does for the base's transformers model: adapter_config.json
    and adapter_model.safetensors, for `PeftModel.from_pretrained(base, out_dir)` on the base's
    Hugging Face export (`base_model`: where that base is, recorded for AutoPeftModel). Written to
    a temporary sibling and renamed into place; an existing non-empty `out_dir` is never touched."""
    weights = {k: v.detach().float().cpu().contiguous() for k, v in peft_state_dict(model).items()}
    if not weights:
        raise ValueError("the model has no LoRA adapters to export (apply_lora)")
    with new_directory(out_dir) as tmp:
        save_file(weights, tmp / PEFT_WEIGHTS, metadata={"format": "pt"})
        peft_config(lora, base_model).save_pretrained(tmp)
    return Path(out_dir)
