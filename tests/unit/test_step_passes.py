"""Passes the train step saves over its largest tensors, each the same math as before: clipping
folded into the fused AdamW step, the cross-entropy's gradient made in place."""


import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from forgeline.configs.schema import ModelConfig
from forgeline.model.training.step import IGNORED, TrainStep, cross_entropy
from forgeline.model.transformer import Transformer

SHAPE = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=32)


class OpNames(TorchDispatchMode):
    """The names of the aten ops that run inside the block."""

    def __enter__(self) -> "OpNames":
        self.called: set[str] = set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.called.add(func._schema.name)
        return func(*args, **(kwargs or {}))


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def test_a_clipped_step_divides_in_the_fused_adamw_as_clipping_first_would(process_group: None) -> None:
    model = Transformer(SHAPE)
    model.init_weights(0)
    reference = Transformer(SHAPE)
    reference.load_state_dict(model.state_dict())
    batch = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    step = TrainStep(parts=[model], optimizers=[adamw(model)], schedulers=[], grad_accum_steps=1,
                     grad_clip=0.01, device=torch.device("cpu"), dp_group=dist.group.WORLD)
    with OpNames() as ops:
        result = step(batch)
    assert "aten::_foreach_mul_" not in ops.called  # no pass of its own over the gradients

    optimizer = adamw(reference)
    loss = torch.nn.functional.cross_entropy(reference(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    optimizer.step()
    assert norm > 0.01 and result.grad_norm == pytest.approx(norm.item(), rel=1e-6)
    # Adam's first update is lr * g / (|g| + eps): where a gradient is near eps, the one rounding
    # by which g * (1 / c) and g / c differ moves the update by up to ~1e-5 of lr (1.2e-7 seen on
    # one element of 512 on a loaded 2-core machine, where 1e-7 failed): the bound is 1e-4 of lr.
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_and_gradient_are_torch_s_without_nll_or_log_softmax_backward(reduction: str) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, 50, generator=generator) * 4
    targets = torch.randint(0, 50, (2, 8), generator=generator)
    targets[0, :3] = IGNORED
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    with OpNames() as ops:
        loss = cross_entropy(ours, targets, reduction)
        (loss * 3).backward()
    assert not {"aten::nll_loss_backward", "aten::_log_softmax_backward_data"} & ops.called
    expected = torch.nn.functional.cross_entropy(theirs.flatten(0, 1), targets.flatten(),
                                                 ignore_index=IGNORED, reduction=reduction)
    (expected * 3).backward()
    assert torch.equal(loss, expected)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=1e-8)


def test_a_cross_entropy_of_no_counted_target_is_torch_s_too() -> None:
    logits = torch.randn(1, 4, 10, requires_grad=True)
    targets = torch.full((1, 4), IGNORED)
    cross_entropy(logits, targets, "sum").backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    assert cross_entropy(logits, targets).isnan()  # as torch's mean over nothing
