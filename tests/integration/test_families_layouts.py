"""Every model family from a Hugging Face base, trained by the train stage with real torchrun
ranks: a tiny random model of each family, made offline with transformers, is the base.

Step-0 parity in one process, dp2 x tp2 and pp2 x dp2: on the first global batch, the train
stage's first loss equals transformers' for the base (fp32, 1e-5 relative) and its gradient norm
transformers' (1e-4 relative). The steps after it train to the single process's losses (1e-5
relative) in each layout. Every delta of a family is on in its base: biases, q/k norms,
a head width of its own, sliding windows shorter than a row, llama3 rope scaling, Gemma's
soft-capping and sandwich norms, Phi-3's fused projections.

And each family's pp2 x dp2 run, exported as the register stage exports it, loads in transformers
as its base's family and computes the checkpoint's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from mlflow import MlflowClient
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from forgeline.configs import Config
from forgeline.model.families import FAMILIES
from forgeline.model.training.loader import ShardedSampleLoader
from forgeline.model.training.shards import read_manifest, split_shards
from forgeline.tasks.data.build import build_dataset, train_tokenizer
from forgeline.tasks.runner import run_stage
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import resolve_tracking_uri
from forgeline.tasks.train.job import TrainResult
from tests.conftest import debug_config
from tests.integration.test_init_from import COMMON, first_step_metrics, train_run
from tests.unit.test_families import randomize_gains_and_biases

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The debug config's shape (configs/debug.yaml); rows of 64 tokens, so a window of 16 slides.
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=176, max_position_embeddings=512, rms_norm_eps=1e-5)
WINDOW = 16
FAMILY_FIELDS = {
    "llama": dict(tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mistral": dict(sliding_window=WINDOW, tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=24, tie_word_embeddings=True),
    "gemma2": dict(head_dim=24, query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                   final_logit_softcapping=10.0, layer_types=["sliding_attention", "full_attention"]),
    "gemma3_text": dict(head_dim=24, query_pre_attn_scalar=24, sliding_window=WINDOW,
                        layer_types=["sliding_attention", "full_attention"],
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "phi3": dict(sliding_window=WINDOW, tie_word_embeddings=False),
}
STEPS = 3
LAYOUTS = {
    "single": [],
    "dp2xtp2": ["parallel.dp_shard=2", "parallel.tp=2"],
    "pp2xdp2": ["parallel.pp=2", "parallel.dp_shard=2"],
}


def test_every_family_is_here() -> None:
    assert set(FAMILY_FIELDS) == set(FAMILIES)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One byte-level BPE tokenizer, the debug data's EOS first, shared by every base."""
    texts = ["To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the "
             "slings and arrows of outrageous fortune"] * 4
    directory = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(texts, 400, ["<|endoftext|>"]),
                            eos_token="<|endoftext|>").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def bases(tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random base of each family, its norms and biases randomized so a swap shows."""
    fast = PreTrainedTokenizerFast.from_pretrained(str(tokenizer))
    out = {}
    for family, fields in FAMILY_FIELDS.items():
        directory = tmp_path_factory.mktemp("bases") / family
        torch.manual_seed(0)
        config = AutoConfig.for_model(family, **SHAPE, **fields, vocab_size=len(fast),
                                      eos_token_id=fast.eos_token_id, pad_token_id=fast.eos_token_id)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomize_gains_and_biases(model)
        model.save_pretrained(directory)
        fast.save_pretrained(directory)
        out[family] = directory
    return out


@pytest.fixture(scope="module")
def root(bases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The debug data, tokenized with the bases' (one) tokenizer."""
    root = tmp_path_factory.mktemp("families")
    build_dataset(debug_config(root, f"model.init_from={bases['llama']}"))
    return root


def config(root: Path, base: Path, name: str, *overrides: str) -> Config:
    return debug_config(root, f"model.init_from={base}", f"train.out_dir={root / name}", *COMMON, *overrides)


def transformers_step0(cfg: Config, base: Path) -> tuple[float, float]:
    """transformers' loss and gradient norm for the base on the first global batch."""
    data_dir = Path(cfg.data.out_dir)
    loader = ShardedSampleLoader(split_shards(data_dir, read_manifest(data_dir), "train"),
                                 cfg.train.global_batch_size, 0, 1, cfg.train.seed)
    batch = loader.next_batch()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    logits = model(batch[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    loss.backward()
    return loss.item(), torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()


def losses(cfg: Config, result: TrainResult) -> list[float]:
    client = MlflowClient(resolve_tracking_uri(cfg))
    history = client.get_metric_history(train_run(cfg, result).info.run_id, "loss")
    return [metric.value for metric in sorted(history, key=lambda m: m.step)]


@pytest.fixture(scope="module")
def trained() -> dict[tuple[str, str], tuple[Config, TrainResult]]:
    """(family, layout) -> its train stage's config and result, run once."""
    return {}


def train(family: str, layout: str, root: Path, bases: dict[str, Path],
          trained: dict[tuple[str, str], tuple[Config, TrainResult]]) -> tuple[Config, TrainResult]:
    if (family, layout) not in trained:
        cfg = config(root, bases[family], f"{family}-{layout}", f"train.steps={STEPS}", *LAYOUTS[layout])
        trained[family, layout] = cfg, run_stage(stage_named("train"), cfg)
    return trained[family, layout]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILY_FIELDS)
def test_a_layout_starts_at_transformers_loss_and_trains_as_one_process(
        family: str, layout: str, root: Path, bases: dict[str, Path],
        trained: dict[tuple[str, str], tuple[Config, TrainResult]]) -> None:
    cfg, result = train(family, layout, root, bases, trained)
    (loss, norm), (hf_loss, hf_norm) = first_step_metrics(cfg, result), transformers_step0(cfg, bases[family])
    print(f"step-0 parity {family} {layout}: loss {loss:.7f} vs {hf_loss:.7f} "
          f"(rel {abs(loss / hf_loss - 1):.1e}), grad norm {norm:.6f} vs {hf_norm:.6f} "
          f"(rel {abs(norm / hf_norm - 1):.1e})")
    assert loss == pytest.approx(hf_loss, rel=1e-5)
    assert norm == pytest.approx(hf_norm, rel=1e-4)
    ours, single = losses(cfg, result), losses(*train(family, "single", root, bases, trained))
    print(f"losses {family} {layout}: {ours} vs one process {single}")
    assert len(ours) == STEPS and ours == pytest.approx(single, rel=1e-5)


@pytest.mark.parametrize("family", FAMILY_FIELDS)
def test_a_pp2xdp2_run_exported_as_the_register_stage_exports_it_is_its_family_in_transformers(
        family: str, root: Path, bases: dict[str, Path],
        trained: dict[tuple[str, str], tuple[Config, TrainResult]], tmp_path: Path) -> None:
    """The pp2 x dp2 run above, exported as the register stage exports it (tasks/register.py
    create_version: load_from_checkpoint, then export_hf), loads in transformers as its base's
    family -- model_type, class, the base's weight names -- and computes the checkpoint's logits,
    past a sliding window, to fp32 rounding. The register stage itself is not run: its MLflow
    logging adds nothing per family (tests/integration/test_init_from.py registers and serves a
    continued run). (A run of its own at lr ~ 0 checked the export against the base's weights: 7
    more pp2 x dp2 launches, and no mapping the logits would not show.)"""
    from forgeline.model.hf import export_hf
    from forgeline.model.inference import load_from_checkpoint

    _, result = train(family, "pp2xdp2", root, bases, trained)
    ours = load_from_checkpoint(result.checkpoint)
    exported = AutoModelForCausalLM.from_pretrained(export_hf(ours, bases[family], tmp_path / "hf"),
                                                    dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(bases[family], dtype=torch.float32)
    assert exported.config.model_type == base.config.model_type == family
    assert type(exported) is type(base)
    assert exported.state_dict().keys() == base.state_dict().keys()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, base.config.vocab_size, (2, 3 * WINDOW), generator=generator)
    with torch.no_grad():
        theirs, mine = exported(tokens).logits, ours(tokens)
    gap = (theirs - mine).abs().max().item()
    print(f"export {family}: {len(base.state_dict())} tensors, largest |logit difference| {gap:.1e}")
    assert gap <= 1e-5 * mine.abs().max().item()
    trained_away = [name for name, weight in exported.state_dict().items()
                    if not torch.equal(weight, base.state_dict()[name])]
    assert trained_away  # the trained weights, not the base's
