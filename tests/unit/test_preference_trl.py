"""The preference loss against TRL's, on the same model and the same pairs: forgeline's step
(packed rows, the reference's log-probabilities computed beforehand by the reference model as the
trainer computes them) and TRL's DPOTrainer (padded pairs, its reference model or, with peft, the
model with its adapters off) give the same loss, the same gradients and the same metrics -- every
weight, and with LoRA the adapters'; SimPO against TRL's CPOTrainer. Across layouts (pp2 x dp2):
tests/integration/test_preference_layouts.py."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402
from trl.trainer.dpo_trainer import DataCollatorForPreference  # noqa: E402

from forgeline.configs.schema import LoraConfig, PreferenceConfig  # noqa: E402
from forgeline.model.hf import export_hf, from_hf_state_dict, import_hf  # noqa: E402
from forgeline.model.lora import apply_lora, is_adapter, peft_config, peft_state_dict  # noqa: E402
from forgeline.model.training.preference import STATS, PreferenceObjective  # noqa: E402
from forgeline.model.training.step import TrainStep  # noqa: E402
from tests.chat import save_chat_tokenizer  # noqa: E402
from tests.preference import PAIRS, packed_rows, rendered_pairs  # noqa: E402

BETA = 0.1
ROW_TOKENS = 256  # two or three pairs a row: pairs of one row and of several rows in one batch
LORA = LoraConfig(rank=4, alpha=8.0, targets=["q_proj", "k_proj", "v_proj", "o_proj"])


class GradientCatcher(torch.optim.Optimizer):
    """An optimizer whose step keeps each parameter's gradient instead of using it."""

    def __init__(self, params):  # noqa: ANN001
        super().__init__(params, {})
        self.caught: dict[torch.nn.Parameter, torch.Tensor] = {}

    def step(self, closure=None) -> None:  # noqa: ANN001
        self.caught = {p: p.grad.clone() for group in self.param_groups for p in group["params"]
                       if p.grad is not None}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return save_chat_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def tiny_llama(vocab_size: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).float()


def perturbed(model: LlamaForCausalLM, seed: int) -> LlamaForCausalLM:
    """A copy moved away from `model`: a policy whose log-ratios to the reference are not 0."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    return other


def forgeline_step(model: torch.nn.Module, cfg: PreferenceConfig) -> tuple[TrainStep, GradientCatcher]:
    catcher = GradientCatcher([p for p in model.parameters() if p.requires_grad])
    step = TrainStep(parts=[model], optimizers=[catcher], schedulers=[], grad_accum_steps=2, grad_clip=0.0,
                     device=torch.device("cpu"), dp_group=dist.group.WORLD,
                     objective=PreferenceObjective(cfg))
    return step, catcher


def with_reference(batch, reference_model: torch.nn.Module, cfg: PreferenceConfig):  # noqa: ANN001, ANN201
    """The batch with the reference model's log-probabilities, as the trainer computes them before
    training (TrainStep.target_log_probs)."""
    step, _ = forgeline_step(reference_model, cfg)
    batch.reference = step.target_log_probs(batch)
    return batch


def trl_trainer(policy, reference, tokenizer, tmp_path: Path, **kwargs) -> DPOTrainer:  # noqa: ANN001
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=BETA, loss_type=["sigmoid"], report_to=[],
                     use_cpu=True, bf16=False, disable_dropout=True, per_device_train_batch_size=len(PAIRS))
    texts = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    return DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=texts,
                      processing_class=tokenizer, **kwargs)


def trl_loss(trainer: DPOTrainer, examples: list[dict]) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's loss (its backward run) and metrics on the pairs, as its training step computes them."""
    inputs = DataCollatorForPreference(pad_token_id=trainer.processing_class.pad_token_id)(examples)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {name: values[-1] for name, values in trainer._metrics["train"].items()}


def test_full_dpo_loss_gradients_and_metrics_equal_trls(process_group: None, tokenizer,  # noqa: ANN001
                                                       tmp_path: Path) -> None:
    pairs = rendered_pairs(tokenizer)
    cfg = PreferenceConfig(beta=BETA)
    reference_hf = tiny_llama(len(tokenizer), seed=0)
    policy_hf = perturbed(reference_hf, seed=1)
    reference, _ = import_hf(reference_hf)
    policy, shape = import_hf(policy_hf)
    batch = with_reference(packed_rows(pairs, ROW_TOKENS, tokenizer.pad_token_id), reference, cfg)
    assert len(batch.tokens) >= 3  # several rows, each holding more than one pair for most

    step, catcher = forgeline_step(policy.train(), cfg)
    result = step(batch)
    expected, trl_metrics = trl_loss(trl_trainer(policy_hf, reference_hf, tokenizer, tmp_path),
                                     [p.trl_example() for p in pairs])

    assert result.loss == pytest.approx(expected.item(), abs=1e-5)
    trl_grads = from_hf_state_dict({name: p.grad for name, p in policy_hf.named_parameters()}, shape)
    ours = {name: catcher.caught[param] for name, param in policy.named_parameters()}
    assert set(ours) == set(trl_grads)
    for name, grad in ours.items():
        torch.testing.assert_close(grad, trl_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    assert set(result.metrics) == set(STATS)  # every metric TRL logs, each compared below
    for name, value in result.metrics.items():
        assert value == pytest.approx(trl_metrics[name], abs=1e-5), name
    assert 0 < result.metrics["rewards/accuracies"] < 1  # a test of the rewards that could fail


def test_lora_dpo_against_the_model_with_its_adapters_off_equals_trl_with_peft(
        process_group: None, tokenizer, tmp_path: Path) -> None:
    """TRL's reference for adapters it adds (a peft_config) is the policy with its adapters off;
    forgeline's is the model it starts from, computed before training -- the base, its adapters at
    their initialization (B = 0). Here both policies' adapters hold the same trained-looking values."""
    pairs = rendered_pairs(tokenizer)
    cfg = PreferenceConfig(beta=BETA, lora=LORA)
    base, shape = import_hf(tiny_llama(len(tokenizer), seed=0))
    policy = copy.deepcopy(base)
    apply_lora(policy, LORA)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B = 0 would give a policy equal to its reference
        for name, param in policy.named_parameters():
            if is_adapter(name):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    base_dir = export_hf(base, tmp_path / "tokenizer", tmp_path / "base")
    trainer = trl_trainer(LlamaForCausalLM.from_pretrained(base_dir), None, tokenizer, tmp_path,
                          peft_config=dataclasses.replace(peft_config(LORA, None), inference_mode=False))
    adapters = {name.replace(".default", ""): param for name, param in trainer.model.named_parameters()
                if param.requires_grad}
    with torch.no_grad():
        for name, value in peft_state_dict(policy).items():
            adapters[name].copy_(value)

    batch = with_reference(packed_rows(pairs, ROW_TOKENS, tokenizer.pad_token_id), base, cfg)
    step, catcher = forgeline_step(policy.train(), cfg)
    result = step(batch)
    expected, trl_metrics = trl_loss(trainer, [p.trl_example() for p in pairs])

    assert result.loss == pytest.approx(expected.item(), abs=1e-5)
    grads = copy.deepcopy(policy)
    with torch.no_grad():
        for name, param in grads.named_parameters():
            param.copy_(catcher.caught[dict(policy.named_parameters())[name]] if is_adapter(name) else 0)
    ours = peft_state_dict(grads)
    assert set(ours) == set(adapters) and len(ours) == 2 * 4 * shape.n_layers
    for name, grad in ours.items():
        torch.testing.assert_close(grad, adapters[name].grad, rtol=1e-4, atol=1e-5, msg=name)
    assert set(result.metrics) == set(STATS)  # every metric TRL logs, each compared below
    for name, value in result.metrics.items():
        assert value == pytest.approx(trl_metrics[name], abs=1e-5), name


def test_simpo_loss_gradients_and_metrics_equal_trls_cpo_trainer(process_group: None, tokenizer,  # noqa: ANN001
                                                                tmp_path: Path) -> None:
    """SimPO needs no reference: CPOTrainer's loss_type simpo (cpo_alpha 0), length-averaged."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    pairs = rendered_pairs(tokenizer)
    cfg = PreferenceConfig(loss="simpo", beta=2.0, simpo_gamma=0.5)
    policy_hf = tiny_llama(len(tokenizer), seed=0)
    policy, shape = import_hf(policy_hf)
    step, catcher = forgeline_step(policy.train(), cfg)
    result = step(packed_rows(pairs, ROW_TOKENS, tokenizer.pad_token_id))

    args = CPOConfig(output_dir=str(tmp_path / "cpo"), loss_type="simpo", cpo_alpha=0.0, beta=cfg.beta,
                     simpo_gamma=cfg.simpo_gamma, report_to=[], use_cpu=True, bf16=False)
    texts = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    trainer = CPOTrainer(model=policy_hf, args=args, train_dataset=texts, processing_class=tokenizer)
    trainer.model.train()
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, cpo_batch(pairs, tokenizer.pad_token_id))
    loss.backward()

    assert result.loss == pytest.approx(loss.item(), abs=1e-5)
    theirs = from_hf_state_dict({name: p.grad for name, p in policy_hf.named_parameters()}, shape)
    for name, param in policy.named_parameters():
        torch.testing.assert_close(catcher.caught[param], theirs[name], rtol=1e-4, atol=1e-5, msg=name)
    assert set(result.metrics) == set(STATS)  # every metric TRL logs, each compared below
    for name, value in result.metrics.items():
        assert value == pytest.approx(metrics[name], abs=1e-5), name


def cpo_batch(pairs: list, pad_id: int) -> dict[str, torch.Tensor]:
    """CPOTrainer's tokenized batch of the pairs: each reply's sequence padded on the right, its
    labels the reply's trained tokens (-100 on the prompt and the padding)."""
    batch = {}
    for side in ("chosen", "rejected"):
        examples = [pair.trl_example() for pair in pairs]
        ids = [example["prompt_ids"] + example[f"{side}_ids"] for example in examples]
        labels = [[-100] * len(example["prompt_ids"]) + example[f"{side}_ids"] for example in examples]
        width = max(map(len, ids))
        batch[f"{side}_input_ids"] = torch.tensor([row + [pad_id] * (width - len(row)) for row in ids])
        batch[f"{side}_attention_mask"] = torch.tensor([[1] * len(row) + [0] * (width - len(row))
                                                        for row in ids])
        batch[f"{side}_labels"] = torch.tensor([row + [-100] * (width - len(row)) for row in labels])
    return batch
