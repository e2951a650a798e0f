import math

import pytest

from forgeline.configs import load_config
from forgeline.model.llama import ModelArgs, Transformer
from forgeline.model.optim import build_lr_scheduler, build_optimizer, warmup_cosine


def test_warmup_then_cosine_to_min_ratio() -> None:
    assert warmup_cosine(1, 10, 100, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(10, 10, 100, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(55, 10, 100, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert warmup_cosine(100, 10, 100, 0.1) == pytest.approx(0.1)


def test_scheduler_gives_update_n_the_lr_of_step_n() -> None:
    cfg = load_config("debug.yaml")
    model = Transformer(ModelArgs(vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=8))
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
    model = Transformer(ModelArgs(vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=8))
    decayed, plain = build_optimizer(model, cfg.train).param_groups
    assert all(p.ndim == 2 for p in decayed["params"]) and decayed["weight_decay"] > 0
    assert all(p.ndim == 1 for p in plain["params"]) and plain["weight_decay"] == 0
