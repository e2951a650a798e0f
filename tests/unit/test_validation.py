"""Validation during training (train.val_every), piece by piece in one process: the fixed
validation batches, the byte count behind bits per byte, the forward-only loss, the callback's
last/best record and its checkpointed state. Layouts and bit-identical training:
tests/integration/test_validation.py."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from pydantic import ValidationError
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from forgeline.configs.schema import Config, ModelConfig, TrainConfig, resume_fingerprint
from forgeline.model.training.callbacks import ValidationCallback
from forgeline.model.training.loader import (
    VAL_SEED,
    ShardedSampleLoader,
    num_validation_batches,
    token_byte_lengths,
    validation_batches,
)
from forgeline.model.training.loop import TrainerState, ValResult
from forgeline.model.training.metrics import MetricsLogger, bits_per_byte
from forgeline.model.training.shards import DataError, ShardInfo, write_shard
from forgeline.model.training.step import TrainStep
from forgeline.model.transformer import Transformer
from forgeline.tasks.data.build import train_tokenizer

SEQ_LEN, VOCAB = 16, 64
TEXT = "Wie heißt du? ¿Qué tal? 東京は晴れ。 Shall I compare thee to a summer's day? naïve café 🙂"


def shards(tmp_path: Path, sizes: list[int]) -> list[ShardInfo]:
    """Shards of random samples; the samples of all shards are distinct."""
    rng = np.random.default_rng(0)
    out, first = [], 0
    for number, size in enumerate(sizes):
        samples = [rng.integers(1, VOCAB, SEQ_LEN + 1).astype(np.uint16) for _ in range(size)]
        entry = write_shard(tmp_path, "val", number, samples, [np.zeros(1, np.int32)] * size, first)
        out.append(ShardInfo(tmp_path / entry["path"], entry["samples"], entry["sha256"]))
        first += size
    return out


def rows(batches: list[torch.Tensor]) -> list[tuple[int, ...]]:
    return [tuple(row.tolist()) for batch in batches for row in batch]


def test_the_validation_batches_are_fixed_whatever_the_seed_and_layout(tmp_path: Path) -> None:
    val = shards(tmp_path, [10, 7, 9])
    loader = ShardedSampleLoader(val, 8, 0, 1, VAL_SEED)
    reference = [loader.next_batch() for _ in range(3)]
    one = validation_batches(val, 3, ShardedSampleLoader(val, 8, 0, 1, seed=123))
    assert rows(one) == rows(reference) and len(set(rows(one))) == 24
    # Two data-parallel ranks read the two halves of every global batch.
    halves = [validation_batches(val, 3, ShardedSampleLoader(val, 4, rank, 2, seed=7)) for rank in range(2)]
    assert [row for batch in zip(*halves, strict=True) for row in rows(list(batch))] == rows(one)
    assert rows(validation_batches(val, 3, ShardedSampleLoader(val, 8, 0, 1, seed=5))) == rows(one)  # again


def test_the_number_of_batches_is_bounded_by_the_split() -> None:
    manifest = {"splits": {"val": {"samples": 50}}}
    assert num_validation_batches(manifest, 16, 2) == 2
    assert num_validation_batches(manifest, 16, 8) == 3  # whole batches only
    with pytest.raises(DataError, match=r"holds 10 samples.*train.val_every=0"):
        num_validation_batches({"splits": {"val": {"samples": 10}}}, 16, 8)
    with pytest.raises(DataError, match="holds 0 samples"):
        num_validation_batches({"splits": {"train": {"samples": 100}}}, 16, 8)


def test_token_bytes_add_up_to_the_utf8_bytes_of_the_text(tmp_path: Path) -> None:
    """Byte-level BPE: tokens split multi-byte characters, and still every byte counts once."""
    tokenizer = train_tokenizer([TEXT] * 3, 300, ["<|endoftext|>"])  # the data stage's own
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    lengths = token_byte_lengths(tmp_path)
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids = tokenizer.encode(TEXT).ids + [eos] + tokenizer.encode(TEXT[::-1]).ids
    assert lengths[eos] == 0
    assert lengths[ids].sum() == 2 * len(TEXT.encode())
    assert len(ids) < 2 * len(TEXT.encode())  # it did merge bytes into tokens


def test_bits_per_byte() -> None:
    assert bits_per_byte(math.log(2), 100, 100) == pytest.approx(1.0)
    assert bits_per_byte(2.0, 300, 1200) == pytest.approx(2.0 * 300 / (math.log(2) * 1200))


def tiny_step(grad_accum_steps: int) -> TrainStep:
    model = Transformer(ModelConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                    max_seq_len=32))
    model.init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return TrainStep(parts=[model], optimizers=[optimizer], schedulers=[], grad_accum_steps=grad_accum_steps,
                     grad_clip=1.0, device=torch.device("cpu"), dp_group=dist.group.WORLD)


def test_the_validation_loss_is_forward_only_and_leaves_training_state_alone(process_group: None) -> None:
    step = tiny_step(grad_accum_steps=2)
    model = step.parts[0]
    batches = [torch.randint(0, VOCAB, (4, SEQ_LEN + 1), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    optimizer_state = step.optimizers[0].state_dict()
    rng = torch.get_rng_state()
    loss = step.validation_loss(batches)
    everything = torch.cat(batches)
    expected = F.cross_entropy(model(everything[:, :-1]).flatten(0, 1), everything[:, 1:].flatten())
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())
    assert step.optimizers[0].state_dict() == optimizer_state
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_validation_leaves_fsdp_parameters_sharded(process_group: None) -> None:
    """A forward without backward leaves FSDP units gathered; the next step must see the sharded
    parameters that receive the gradients (else it clips and measures no gradient at all)."""
    step = tiny_step(grad_accum_steps=1)
    model = step.parts[0]
    mesh = init_device_mesh("cpu", (1,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=False)  # as under pipeline parallelism
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    sharded = {name: id(p) for name, p in model.named_parameters()}
    step.validation_loss([torch.randint(0, VOCAB, (2, SEQ_LEN + 1))])
    assert {name: id(p) for name, p in model.named_parameters()} == sharded
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_the_callback_reports_the_last_and_keeps_the_best() -> None:
    losses = iter([3.0, 2.0, 2.5, 2.0])
    trainer = SimpleNamespace(
        state=TrainerState(schedulers=[], loader=None, scaler=None), total_steps=10,
        device=torch.device("cpu"), train_step=SimpleNamespace(validation_loss=lambda batches: next(losses),
                                                               objective_metrics=dict))
    callback = ValidationCallback(every=3, batches=[], tokens=1000, text_bytes=2000)
    reported = {}
    for step in range(1, 11):
        trainer.state.step = step
        metrics = {"loss": 1.0}
        callback.post_step(trainer, metrics)
        if "val/loss" in metrics:
            reported[step] = (metrics["val/loss"], metrics["val/bpb"])
    assert list(reported) == [3, 6, 9, 10]  # every 3 steps and at the last
    assert reported[6] == (2.0, bits_per_byte(2.0, 1000, 2000))
    assert trainer.state.val_last == ValResult(10, 2.0, bits_per_byte(2.0, 1000, 2000))
    assert trainer.state.val_best.step == 6  # the first of two equal losses


def test_the_best_validation_survives_a_checkpoint(tmp_path: Path, process_group: None) -> None:
    train = shards(tmp_path, [16])

    def trainer_state() -> TrainerState:
        scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]),
                                                      lambda step: 1.0)
        return TrainerState([scheduler], ShardedSampleLoader(train, 4, 0, 1, seed=0), scaler=None)

    saved = trainer_state()
    saved.val_last, saved.val_best = ValResult(300, 2.5, 1.25), ValResult(200, 2.25, 1.125)
    dcp.save({"train": saved}, checkpoint_id=tmp_path / "ckpt")
    resumed = trainer_state()
    assert resumed.val_best is None
    dcp.load({"train": resumed}, checkpoint_id=tmp_path / "ckpt")
    assert (resumed.val_last, resumed.val_best) == (saved.val_last, saved.val_best)
    dcp.save({"train": trainer_state()}, checkpoint_id=tmp_path / "before-any")  # no validation yet
    dcp.load({"train": resumed}, checkpoint_id=tmp_path / "before-any")
    assert resumed.val_last is None and resumed.val_best is None


def test_a_validation_step_prints_a_progress_line(process_group: None,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    logger = MetricsLogger(None, 0, log_every=10, total_steps=100, flops_per_step=1.0, peak_flops=1.0,
                           device=torch.device("cpu"))
    logger.log_step(3, {"loss": 2.0, "step_time_s": 0.1})
    assert "step 3/100" not in caplog.text
    logger.log_step(4, {"loss": 2.0, "step_time_s": 0.1, "val/loss": 2.125, "val/bpb": 1.5})
    assert "step 4/100" in caplog.text and "val/loss 2.125" in caplog.text and "val/bpb 1.5" in caplog.text


def test_the_config_keys() -> None:
    assert TrainConfig().val_every > 0 and TrainConfig().val_batches > 0  # on by default
    assert TrainConfig(val_every=0).val_every == 0
    with pytest.raises(ValidationError):
        TrainConfig(val_every=-1)
    with pytest.raises(ValidationError):
        TrainConfig(val_batches=0)


def test_changing_validation_keeps_the_checkpoints_resumable() -> None:
    fingerprint = resume_fingerprint(Config(), "data")
    assert resume_fingerprint(Config().with_values({"train.val_every": 0, "train.val_batches": 3}),
                              "data") == fingerprint
    assert resume_fingerprint(Config().with_values({"train.lr": 1e-5}), "data") != fingerprint


def test_checkpoints_from_before_the_later_keys_stay_resumable() -> None:
    """The fingerprint the code before tie_embeddings, rope_layout, init_from, document_masking
    and validation computed for a config: equal, so an upgrade resumes instead of retraining."""
    import hashlib
    import json

    from forgeline.configs.schema import OPERATIONAL_TRAIN_FIELDS

    cfg = Config()
    before = {"model": cfg.model.model_dump(mode="json", exclude={"vocab_size", "init_from", "tie_embeddings",
                                                                 "rope_layout"}),
              "train": cfg.train.model_dump(mode="json", exclude=set(OPERATIONAL_TRAIN_FIELDS) | {
                  "document_masking"}),
              "data": "data"}
    expected = hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
    assert resume_fingerprint(cfg, "data") == expected
    masked = cfg.with_values({"train.document_masking": True})
    assert resume_fingerprint(masked, "data") != resume_fingerprint(cfg, "data")
    assert resume_fingerprint(cfg.with_values({"model.tie_embeddings": True}), "data") != \
        resume_fingerprint(cfg, "data")
