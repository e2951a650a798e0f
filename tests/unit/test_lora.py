"""LoRA (model/lora.py) on a tiny random model, on the CPU: the merged Hugging Face export against
`peft` applying the exported adapter to the base's export, frozen base and adapter-only optimizer
state, adapters that survive loading the base (so training starts from the base exactly), and a
LoRA run's checkpoint refused as a base. Parallel layouts: tests/integration/test_lora_layouts.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from peft import PeftModel
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from forgeline.configs.schema import LoraConfig, ModelConfig
from forgeline.model.checkpoint.manager import MANIFEST_NAME, ModelState
from forgeline.model.hf import export_hf, load_hf_weights, to_hf_state_dict
from forgeline.model.lora import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    TARGETS,
    LoraLinear,
    apply_lora,
    export_peft_adapter,
    init_lora,
    is_adapter,
    merge_lora,
)
from forgeline.model.training.optim import build_optimizer
from forgeline.model.training.worker import BaseWeights, load_base
from forgeline.model.transformer import Transformer
from tests.conftest import debug_config

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = LoraConfig(rank=4, alpha=8.0, targets=ALL_TARGETS)
# Phi-3's modules: q, k and v fused, gate and up fused.
PHI3_LORA = LoraConfig(rank=4, alpha=8.0, targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
# SmolLM2-135M's shape (its config.json): what the optimizer-state fraction is reported for.
SMOLLM2 = ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                      norm_eps=1e-5, rope_theta=100000.0, max_seq_len=2048, tie_embeddings=True,
                      rope_layout="half")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer of about 300 tokens, saved in the transformers layout."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["To be, or not to be, that is the question."], trainer=trainer)
    directory = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(directory)
    return directory


# Families whose deltas touch the adapted layers: Qwen2's q/k/v biases; Gemma 2's head width,
# GeGLU, 1 + w and sandwich norms, scaled embeddings, soft-capping and sliding window.
FAMILY_DELTAS = {
    "llama": {},
    "qwen2": dict(family="qwen2", qkv_bias=True),
    "phi3": dict(family="phi3", sliding_window=8),
    "gemma2": dict(family="gemma2", attention_head_dim=24, activation="gelu_tanh", norm_offset=True,
                   sandwich_norms=True, embedding_scale=True, query_pre_attn_scalar=24,
                   attn_logit_softcap=5.0, final_logit_softcap=10.0, sliding_window=8, sliding_layers=[0],
                   tie_embeddings=True),
}


def tiny_shape(tokenizer_dir: Path, rope_layout: str = "interleaved", family: str = "llama") -> ModelConfig:
    vocab_size = len(PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir)))
    return ModelConfig(vocab_size=vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                       max_seq_len=64, rope_layout=rope_layout, **FAMILY_DELTAS[family])


def built(shape: ModelConfig, lora: LoraConfig | None, seed: int = 0) -> Transformer:
    """The trainer's order: on meta, adapters, materialized, initialized."""
    with torch.device("meta"):
        model = Transformer(shape)
    if lora:
        apply_lora(model, lora)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    if lora:
        init_lora(model, seed)
    return model


def trained_looking(shape: ModelConfig, lora: LoraConfig = LORA) -> Transformer:
    """A model with adapters as after training: B random (at init it is 0, and a test of the
    update could not fail), q and k scaled up so that a wrong rotary permutation of B shows."""
    model = built(shape, lora)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".lora_b"):
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("wq.weight", "wk.weight")):
                param.mul_(10)
            elif name.endswith(".bias"):  # 0 at init: a bias left out of an export would not show
                param.uniform_(-0.5, 0.5, generator=generator)
    return model.eval()


def base_of(model: Transformer) -> Transformer:
    """The frozen weights alone, as a plain model."""
    base = built(model.shape, None)
    base.load_state_dict({k: v for k, v in model.state_dict().items() if not is_adapter(k)})
    return base.eval()


def sample(shape: ModelConfig) -> torch.Tensor:
    return torch.randint(0, shape.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("rope_layout, family", [("interleaved", "llama"), ("half", "llama"),
                                                 ("half", "qwen2"), ("interleaved", "qwen2"),
                                                 ("half", "gemma2"), ("half", "phi3"),
                                                 ("interleaved", "phi3")])
def test_merged_export_equals_peft_adapter_on_base_export(rope_layout: str, family: str, tokenizer_dir: Path,
                                                          tmp_path: Path) -> None:
    lora = PHI3_LORA if family == "phi3" else LORA
    model = trained_looking(tiny_shape(tokenizer_dir, rope_layout, family), lora)
    tokens = sample(model.shape)
    with torch.no_grad():
        ours = model(tokens)
    base_dir = export_hf(base_of(model), tokenizer_dir, tmp_path / "base")
    adapter_dir = export_peft_adapter(model, lora, tmp_path / "adapter", base_model=str(base_dir))
    merged_dir = export_hf(merge_lora(copy.deepcopy(model)), tokenizer_dir, tmp_path / "merged")
    assert {p.name for p in adapter_dir.iterdir()} == {PEFT_CONFIG, PEFT_WEIGHTS}

    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(base_dir).eval()(tokens).logits
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
        peft_model.eval()
        peft_logits = peft_model(tokens).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged_dir).eval()(tokens).logits
    # peft found every adapter: one pair per target linear of each layer.
    adapted = [name for name, _ in peft_model.named_modules() if name.endswith(".lora_A.default")]
    assert len(adapted) == model.shape.n_layers * len(lora.targets)
    gap = (merged_logits - peft_logits).abs().max().item()
    print(f"[{rope_layout}] max |merged - peft(base + adapter)| = {gap:.2e}; "
          f"|ours - peft| = {(ours - peft_logits).abs().max().item():.2e}; "
          f"adapters move the logits by {(peft_logits - base_logits).abs().max().item():.2f}")
    assert (peft_logits - base_logits).abs().max() > 0.1  # the adapters matter: a wrong one shows
    assert AutoModelForCausalLM.from_pretrained(merged_dir).config.model_type == family
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, peft_logits, atol=1e-5, rtol=1e-5)


def test_targets_are_the_families_own_module_names(tokenizer_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"sft.lora.targets \['q_proj'\] are not linear layers of a phi3 "
                                         r"model, whose are \['down_proj', 'gate_up_proj', 'o_proj', "
                                         r"'qkv_proj'\]"):
        built(tiny_shape(tokenizer_dir, "half", "phi3"), LoraConfig(targets=["q_proj"]))
    with pytest.raises(ValueError, match="qkv_proj"):
        built(tiny_shape(tokenizer_dir), PHI3_LORA)


def test_export_refuses_unmerged_adapters(tokenizer_dir: Path) -> None:
    with pytest.raises(ValueError, match="merge LoRA adapters"):
        to_hf_state_dict(trained_looking(tiny_shape(tokenizer_dir)))


def adapter_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if is_adapter(name)}


def test_only_adapters_train_and_hold_optimizer_state(tokenizer_dir: Path, tmp_path: Path) -> None:
    train = debug_config(tmp_path).train
    model = trained_looking(tiny_shape(tokenizer_dir)).train()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_params(model))
    assert len(trainable) == 2 * model.shape.n_layers * len(ALL_TARGETS)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, train)
    tokens = sample(model.shape)
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()

    stateful = {id(p) for p in optimizer.state}
    assert stateful == {id(p) for p in adapter_params(model).values()}
    for name, param in model.named_parameters():
        changed = not torch.equal(param, before[name])
        assert changed == is_adapter(name), name


def test_smollm2_optimizer_state_is_a_fraction_of_full_fine_tuning(tmp_path: Path) -> None:
    """Counted on the meta device: SmolLM2-135M's shape, the default targets (q, k, v, o; r = 8)
    and all seven."""
    train = debug_config(tmp_path).train
    for lora, most in ((LoraConfig(), 0.01), (LoraConfig(targets=ALL_TARGETS), 0.025)):
        with torch.device("meta"):
            model = Transformer(SMOLLM2)
            apply_lora(model, lora)
        total = sum(p.numel() for p in model.parameters())
        in_optimizer = sum(p.numel() for group in build_optimizer(model, train).param_groups
                           for p in group["params"])
        assert in_optimizer == sum(p.numel() for p in adapter_params(model).values())
        # AdamW keeps two moments per parameter it updates: the state shrinks as the parameters do.
        print(f"SmolLM2-135M, targets {lora.targets}, r={lora.rank}: {in_optimizer:,} of {total:,} "
              f"parameters trained, optimizer state {in_optimizer / total:.2%} of full fine-tuning")
        assert in_optimizer / total < most


@pytest.mark.parametrize("source", ["hf", "checkpoint"])
def test_loading_the_base_keeps_the_adapters_and_starts_at_the_base(source: str, tokenizer_dir: Path,
                                                                    tmp_path: Path) -> None:
    # A Hugging Face base is read as it is, so its model rotates halves (model/hf.py).
    shape = tiny_shape(tokenizer_dir, "half" if source == "hf" else "interleaved")
    base = built(shape, None, seed=5).eval()  # other values than the run's own init (seed 0)
    if source == "hf":
        directory = export_hf(base, tokenizer_dir, tmp_path / "base")
    else:
        directory = tmp_path / "checkpoint"
        dcp.save({"model": ModelState([base])}, checkpoint_id=directory, no_dist=True)
    # The trainer's order with a base: meta, adapters, materialized, buffers, adapters
    # initialized, then the base's weights loaded (model/training/worker.py).
    with torch.device("meta"):
        model = Transformer(shape)
    apply_lora(model, LORA)
    model.to_empty(device="cpu")
    model.init_buffers()
    init_lora(model, seed=0)
    initialized = {name: p.detach().clone() for name, p in adapter_params(model).items()}
    if source == "hf":
        load_hf_weights([model], directory, shape)
    else:
        dcp.load({"model": BaseWeights([model])}, checkpoint_id=directory, no_dist=True)

    for name, param in adapter_params(model).items():
        assert torch.equal(param, initialized[name]), name
        if name.endswith(".lora_a"):  # kaiming-uniform as peft: within +-1/sqrt(in), not degenerate
            bound = param.shape[1] ** -0.5
            assert 0.5 * bound < param.abs().max() <= bound
        else:
            assert not param.any()
    assert all(isinstance(model.layers["0"].get_submodule(path), LoraLinear)
               for target in ALL_TARGETS for path in TARGETS[target])
    tokens = sample(shape)
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens), base(tokens))


def test_a_lora_checkpoint_is_refused_as_a_base(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Its weights are the frozen ones beside adapters: loaded as a base, they would silently
    drop what the run learned."""
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"lora": LORA.model_dump(mode="json")}))
    model = built(tiny_shape(tokenizer_dir), None)
    with pytest.raises(ValueError, match="start from its merged export"):
        load_base([model], {"uri": "runs:/sft", "path": str(tmp_path)}, model.shape)


@pytest.mark.parametrize("bias, trained", [("none", set()), ("lora_only", {"wq"}),
                                           ("all", {"wq", "wk", "wv"})])
def test_biases_train_as_configured_and_reach_both_exports(bias: str, trained: set[str], tokenizer_dir: Path,
                                                           tmp_path: Path) -> None:
    """Qwen2's q/k/v biases with adapters on q and o only: sft.lora.bias picks which biases train
    (as peft's `bias`); one optimizer step moves exactly the adapters and those biases, and the
    trained biases reach the merged export and the peft adapter, whose `from_pretrained` on the
    base's export (with the base's biases) gives the merged model's logits."""
    lora = LoraConfig(rank=4, alpha=8.0, targets=["q_proj", "o_proj"], bias=bias)
    model = trained_looking(tiny_shape(tokenizer_dir, "interleaved", "qwen2"), lora).train()
    base_dir = export_hf(base_of(model), tokenizer_dir, tmp_path / "base")
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    biases = {f"layers.{i}.attention.{linear}.bias" for i in range(model.shape.n_layers)
              for linear in trained}
    assert trainable == set(adapter_params(model)) | biases

    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, debug_config(tmp_path).train)
    tokens = sample(model.shape)
    torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    moved = {name for name, param in model.named_parameters() if not torch.equal(param, before[name])}
    assert moved == trainable

    model.eval()
    with torch.no_grad():
        for name in biases:  # what a longer training would do: biases far from the base's
            model.get_parameter(name).add_(0.5)
        ours = model(tokens)
    adapter_dir = export_peft_adapter(model, lora, tmp_path / "adapter", base_model=str(base_dir))
    merged_dir = export_hf(merge_lora(copy.deepcopy(model)), tokenizer_dir, tmp_path / "merged")
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir),
                                                adapter_dir).eval()(tokens).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged_dir).eval()(tokens).logits
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, peft_logits, atol=1e-5, rtol=1e-5)
