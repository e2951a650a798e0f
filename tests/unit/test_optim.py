import math

import pytest
import torch
import torch.distributed as dist

from forgeline.configs import load_config
from forgeline.configs.schema import ModelConfig
from forgeline.model.training.amp import DynamicLossScaler
from forgeline.model.training.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, warmup_cosine
from forgeline.model.transformer import Transformer


def test_warmup_then_cosine_to_min_ratio() -> None:
    assert warmup_cosine(1, 10, 100, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(10, 10, 100, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(55, 10, 100, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert warmup_cosine(100, 10, 100, 0.1) == pytest.approx(0.1)


def test_scheduler_gives_update_n_the_lr_of_step_n() -> None:
    cfg = load_config("debug.yaml")
    model = Transformer(ModelConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=8))
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_lr_scheduler(optimizer, cfg.train)
    seen = []
    for _ in range(cfg.train.steps):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    warmup = cfg.train.warmup_steps
    assert seen[0] == pytest.approx(cfg.train.lr / warmup)
    assert seen[warmup - 1] == pytest.approx(cfg.train.lr)
    assert seen[-1] == pytest.approx(cfg.train.lr * cfg.train.min_lr_ratio)


def test_norm_gains_are_not_decayed() -> None:
    cfg = load_config("debug.yaml")
    model = Transformer(ModelConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=8))
    decayed, plain = build_optimizer(model, cfg.train).param_groups
    assert all(p.ndim == 2 for p in decayed["params"]) and decayed["weight_decay"] > 0
    assert all(p.ndim == 1 for p in plain["params"]) and plain["weight_decay"] == 0


def test_clip_matches_torch_on_plain_tensors() -> None:
    torch.manual_seed(0)
    ours, reference = (Transformer(ModelConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1,
                                             ffn_dim=8)) for _ in range(2))
    ours.init_weights(0)
    reference.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, 16, (2, 5))
    for model in (ours, reference):
        (model(tokens).square().sum() * 100).backward()
    norm = clip_grad_norm_(ours.parameters(), 0.5)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(ours.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_loss_scaler_backs_off_on_overflow_and_grows_after_clean_steps(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2)
        param = torch.nn.Parameter(torch.ones(3))
        param.grad = torch.tensor([8.0, 16.0, 24.0])
        assert scaler.unscale_([param], torch.device("cpu")) is False
        torch.testing.assert_close(param.grad, torch.tensor([1.0, 2.0, 3.0]))
        param.grad = torch.tensor([1.0, float("inf"), 0.0])
        assert scaler.unscale_([param], torch.device("cpu")) is True
    finally:
        dist.destroy_process_group()
    scaler.update(found_inf=True)
    assert scaler.scale == 4.0
    scaler.update(found_inf=False)
    scaler.update(found_inf=False)
    assert scaler.scale == 8.0 and scaler.state_dict() == {"scale": 8.0, "good_steps": 0}


def test_the_optimizer_is_fused_where_torch_has_the_kernel() -> None:
    """On the CPU torch defaults to its per-tensor AdamW loop; the fused kernel is 5x faster on
    SmolLM2's 135M parameters (bench/cpt.py)."""
    model = Transformer(ModelConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=8))
    optimizer = build_optimizer(model, load_config("debug.yaml").train)
    assert optimizer.defaults["fused"] is True
