"""Document masking (train.document_masking) with real torchrun ranks on the debug model: the
first training step's loss and gradient norm, and the forward-only validation loss after it, on
packed rows of several documents are the single process's in tensor parallelism with sequence
parallelism and loss parallelism, and in pipeline parallelism, where every stage takes the
documents. That the single process gives each document's own losses:
tests/unit/test_document_masking.py.

Run as a module under torchrun, this file is also the rank program: it builds the model in a
layout as the train stage's ranks do, from the seed, and steps once on a fixed packed batch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from forgeline.configs import Config, load_config
from forgeline.model.parallel.mesh import build_meshes, init_distributed
from forgeline.model.training.loader import DocumentBatch
from forgeline.model.training.worker import build_model_parts, build_train_step
from forgeline.tasks.train.job import rank_config_yaml
from tests.conftest import REPO_ROOT, debug_config
from tests.integration.helpers import run_ranks

pytestmark = pytest.mark.integration

# 4 layers so that the V and interleaved schedules can place 2 stages on each of 2 pipeline ranks;
# 2 micro-steps of 2 pipeline microbatches each cut the batch's documents four ways.
BASE = ["model.n_layers=4", "train.document_masking=true", "train.grad_accum_steps=2"]
LAYOUTS = {
    "tp2-sp": ["parallel.tp=2"],
    "pp2-1F1B": ["parallel.pp=2"],
    "pp2-ZBVZeroBubble": ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble",
                          "parallel.pp_stages_per_rank=2"],
}
SLOW_LAYOUTS = {
    "pp2xtp2-selective-ac": ["parallel.pp=2", "parallel.tp=2", "parallel.activation_checkpoint=selective"],
    "pp2-compile-full-ac": ["parallel.pp=2", "parallel.compile=true", "parallel.activation_checkpoint=full"],
}
# Rows longer than the dense mask's limit (model/transformer.py DENSE_MASK_MAX_LEN) attend document by
# document; without documents, a row longer than a sliding window attends in blocks of queries.
LONG_ROWS = {
    "long": ["data.seq_len=320"],
    "long-window": ["data.seq_len=320", "model.sliding_window=40", "train.document_masking=false"],
}
LONG_LAYOUTS = {"tp2-sp": LAYOUTS["tp2-sp"], "pp2-1F1B": LAYOUTS["pp2-1F1B"]}


def packed_batch(cfg: Config) -> DocumentBatch:
    """The batch of every rank (no layout here is data parallel): random tokens, and rows of a few
    documents each, cut at random places -- a row that does not begin with a document start
    begins with the tail of an earlier one."""
    generator = torch.Generator().manual_seed(0)
    shape = (cfg.train.global_batch_size, cfg.data.seq_len + 1)
    tokens = torch.randint(0, cfg.data.vocab_size, shape, generator=generator)
    starts = torch.rand(shape, generator=generator) < 0.1
    return DocumentBatch(tokens, starts.cumsum(dim=1, dtype=torch.int32))


def first_step(root: Path, name: str, overrides: list[str]) -> dict:
    cfg = debug_config(root, *BASE, *overrides)
    config_path, out = root / f"{name}.yaml", root / f"{name}.json"
    config_path.write_text(rank_config_yaml(cfg))
    run_ranks("tests.integration.test_document_masking", cfg.parallel.world_size,
              ["--config", str(config_path), "--out", str(out)], REPO_ROOT)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("document-masking")
    return root, first_step(root, "single", [])


@pytest.mark.parametrize("name", [*LAYOUTS, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW_LAYOUTS)])
def test_layout_gives_the_single_process_first_step(name: str, reference: tuple[Path, dict]) -> None:
    root, expected = reference
    figures = first_step(root, name, (LAYOUTS | SLOW_LAYOUTS)[name])
    assert figures == pytest.approx(expected, rel=1e-5)


@pytest.fixture(scope="module")
def long_references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """Each long-row variant's single-process step, computed when first asked for."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LONG_LAYOUTS)
@pytest.mark.parametrize("rows", LONG_ROWS)
def test_long_rows_give_the_single_process_first_step(rows: str, layout: str,
                                                      tmp_path_factory: pytest.TempPathFactory,
                                                      long_references: dict[str, tuple[Path, dict]]) -> None:
    if rows not in long_references:
        root = tmp_path_factory.mktemp(f"document-masking-{rows}")
        long_references[rows] = root, first_step(root, "single", LONG_ROWS[rows])
    root, expected = long_references[rows]
    figures = first_step(root, layout, [*LONG_ROWS[rows], *LONG_LAYOUTS[layout]])
    assert figures == pytest.approx(expected, rel=1e-5)


def rank_main(argv: list[str] | None = None) -> None:
    """The rank program of first_step: writes the step's loss and gradient norm, and the
    validation loss of the same batch after it."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    device, rank, world_size = init_distributed()
    try:
        mesh, dp_mesh = build_meshes(cfg.parallel, world_size, device.type)
        shape = cfg.model.for_vocabulary(cfg.data.vocab_size)
        parts = build_model_parts(cfg, shape, mesh, device, torch.float32)
        train_step = build_train_step(cfg, mesh, dp_mesh, parts, device, torch.float32)
        batch = packed_batch(cfg)
        result = train_step(batch)
        val_loss = train_step.validation_loss([batch])
        if rank == 0:
            Path(args.out).write_text(json.dumps({"loss": result.loss, "grad_norm": result.grad_norm,
                                                  "val_loss": val_loss}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_main()
