"""Preference tuning (DPO) with real torchrun ranks on the debug model: the reference
log-probabilities computed in the layout, then three steps on packed pairs, in pipeline x FSDP2
(pp2 x dp2) and FSDP2 x tensor parallel (dp2 x tp2, loss parallel), every weight and with LoRA,
give the single process's losses, gradient norms, TRL's metrics and weights -- every pair weighing
the same across ranks, micro-steps and pipeline microbatches. The single process's loss and
gradients are TRL's (tests/unit/test_preference_trl.py).

The policy starts as its reference, so the first step's loss is log 2 exactly wherever the
reference's log-probabilities were computed: a reference read from the wrong rows, or another
layout's rounding taken for its own, would show there.

Run as a module under torchrun, this file is also the rank program: it builds the model in a
layout as the preference stage's ranks do, from the seed, and steps on fixed batches."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from torch.distributed.tensor import DTensor

from forgeline.configs import Config, load_config
from forgeline.model.lora import init_lora
from forgeline.model.parallel.mesh import build_meshes, init_distributed
from forgeline.model.training.loader import DocumentBatch
from forgeline.model.training.preference import CHOSEN, REJECTED
from forgeline.model.training.worker import build_model_parts, build_train_step
from forgeline.tasks.train.job import rank_config_yaml
from tests.conftest import REPO_ROOT, debug_config
from tests.integration.helpers import run_ranks

pytestmark = pytest.mark.integration

STEPS = 3
PREFERENCE = ["preference.beta=0.5", "model.init_from=base", "data.sources=[{kind: pairs}]",
              "pairs.instruction_types=[punctuation:no_comma]"]
LORA = ["preference.lora.rank=4", "preference.lora.alpha=8",
        "preference.lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"]
LAYOUTS = {
    "pp2xdp2": ["parallel.pp=2", "parallel.dp_shard=2"],
    "dp2xtp2": ["parallel.dp_shard=2", "parallel.tp=2"],
}


def global_batch(cfg: Config) -> DocumentBatch:
    """One global batch of packed pairs, as the data stage packs them: random tokens, (B, T + 1),
    two pairs a row (four documents), each reply's last tokens trained -- from a few in the first
    row to most of the sequence in the last, so that ranks and microbatches hold pairs of unequal
    lengths; the last row holds one pair only (a row the next pair did not fit in)."""
    generator = torch.Generator().manual_seed(0)
    rows, width = cfg.train.global_batch_size, cfg.data.seq_len + 1
    tokens = torch.randint(0, cfg.data.vocab_size, (rows, width), generator=generator)
    documents = torch.zeros(rows, width, dtype=torch.int32)
    sides = torch.zeros(rows, width, dtype=torch.uint8)
    for row in range(rows):
        pairs = 1 if row == rows - 1 else 2
        length = width // (2 * pairs)
        trained = max(2, int(length * (0.1 + 0.8 * row / rows)))
        for doc in range(2 * pairs):
            start = doc * length
            documents[row, start:] = doc
            sides[row, start + length - trained:start + length] = CHOSEN if doc % 2 == 0 else REJECTED
    return DocumentBatch(tokens, documents, sides > 0, sides)


def train_steps(root: Path, name: str, overrides: list[str]) -> dict:
    """The figures of every rank's file, merged: the steps' losses, gradient norms and metrics
    (rank 0's), and each trained parameter's values after the steps (from the ranks that hold it)."""
    cfg = debug_config(root, *PREFERENCE, *overrides)
    ranks = yaml.safe_load(rank_config_yaml(cfg))
    config_path, out = root / f"{name}.yaml", root / name
    config_path.write_text(yaml.safe_dump(ranks, sort_keys=False))
    out.mkdir()
    run_ranks("tests.integration.test_preference_layouts", cfg.parallel.world_size,
              ["--config", str(config_path), "--out", str(out)], REPO_ROOT)
    figures = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    weights = {name: value for rank in figures for name, value in rank["weights"].items()}
    return {"losses": figures[0]["losses"], "grad_norms": figures[0]["grad_norms"],
            "metrics": figures[0]["metrics"], "weights": weights}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    out = {}
    for kind, overrides in (("full", []), ("lora", LORA)):
        root = tmp_path_factory.mktemp(f"preference-{kind}")
        figures = train_steps(root, "single", overrides)
        assert figures["losses"][0] == pytest.approx(math.log(2), abs=1e-6)  # the policy is its reference
        assert figures["losses"][-1] < figures["losses"][0]  # and learns to prefer the chosen replies
        assert figures["metrics"][-1]["rewards/accuracies"] > 0.5
        out[kind] = root, figures
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_as_the_single_process(name: str, kind: str,
                                             references: dict[str, tuple[Path, dict]]) -> None:
    root, expected = references[kind]
    figures = train_steps(root, f"{name}-{kind}", LAYOUTS[name] + (LORA if kind == "lora" else []))
    assert figures["losses"] == pytest.approx(expected["losses"], rel=1e-5, abs=1e-6)
    assert figures["grad_norms"] == pytest.approx(expected["grad_norms"], rel=1e-5)
    for ours, theirs in zip(figures["metrics"], expected["metrics"], strict=True):
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)
    # Adam divides each gradient by its own size: rounding in tiny gradients shows as ~1e-6; a lost
    # or doubled reduction would move a weight by the order of an update (debug.yaml: lr 3e-3).
    assert set(figures["weights"]) == set(expected["weights"])
    for weight, values in expected["weights"].items():
        assert figures["weights"][weight] == pytest.approx(values, abs=2e-5), weight


def full(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective over the mesh of a DTensor)."""
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def rank_main(argv: list[str] | None = None) -> None:
    """The rank program of train_steps: writes rank{N}.json with the steps' figures and the values
    of the trained weights this rank holds."""
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
        for _, part in parts:  # the model a run from a base starts from: the seed's, here
            part.init_weights(cfg.train.seed)
            if cfg.preference.lora:
                init_lora(part, cfg.train.seed)
        train_step = build_train_step(cfg, mesh, dp_mesh, parts, device, torch.float32)
        local = cfg.train.global_batch_size // cfg.parallel.dp
        dp_rank = dp_mesh.get_local_rank()
        batch = global_batch(cfg).rows(slice(dp_rank * local, (dp_rank + 1) * local))
        batch.reference = train_step.target_log_probs(batch)  # the last stage's; None elsewhere
        results = [train_step(batch) for _ in range(STEPS)]
        named = [(name, param) for part in train_step.parts for name, param in part.named_parameters()
                 if param.requires_grad]
        figures = {"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
                   "metrics": [r.metrics for r in results],
                   "weights": {name: full(param).flatten().tolist() for name, param in named}}
        (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_main()
