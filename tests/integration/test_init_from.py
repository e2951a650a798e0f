"""Continued pre-training from a Hugging Face Llama (`model.init_from`) with real torchrun ranks:
a small random `LlamaForCausalLM` with tied embeddings, made here and saved as a user's
`save_pretrained` would, is the base.

Step-0 parity: on the same first global batch, the train stage's first loss equals the loss
transformers computes for the base (fp32, 1e-5 relative) and its gradient norm (before
clipping) transformers' (1e-4 relative) -- in one process and in the layouts below, each rank
loading only its shards. The SmolLM2-sized figures are in test_init_from_smollm2.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import pytest
import torch
import torch.nn.functional as F
from mlflow import MlflowClient
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from forgeline.configs import Config
from forgeline.configs.schema import ConfigError
from forgeline.model.checkpoint.manager import read_checkpoint_manifest
from forgeline.model.fileio import sha256_file
from forgeline.model.training.loader import ShardedSampleLoader
from forgeline.model.training.shards import read_manifest, split_shards
from forgeline.tasks.cache import CACHE_TAG
from forgeline.tasks.data.build import build_dataset, train_tokenizer
from forgeline.tasks.pretrained import CACHE_ENV, resolve_base
from forgeline.tasks.register import HFGenerator
from forgeline.tasks.runner import STAGE_TAG, run_stage
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import resolve_tracking_uri
from forgeline.tasks.train.job import TrainResult, train_model
from tests.conftest import debug_config

pytestmark = pytest.mark.integration

# The debug config's model keys (configs/debug.yaml): a base of this shape fits them.
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=176, max_position_embeddings=512)
COMMON = ["train.document_masking=false", "train.val_every=0", "train.peak_tflops=1", "train.warmup_steps=0",
          "checkpoint.every_steps=100"]
LAYOUTS = {
    "tp2": ["parallel.tp=2"],  # sequence and loss parallel: the tied matrix sharded by vocabulary row
    "pp2": ["parallel.pp=2"],  # the tied matrix's two copies on two ranks
}
# dp2 and pp2 x dp2: test_init_from_smollm2.py, on the real model.
SLOW_LAYOUTS = {
    "hsdp2x2": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
}


def save_tokenizer(directory: Path) -> int:
    """A byte-level BPE tokenizer with the debug data's EOS; its size."""
    texts = ["To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the "
             "slings and arrows of outrageous fortune"] * 4
    tokenizer = train_tokenizer(texts, 400, ["<|endoftext|>"])  # the data stage's own
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return len(fast)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("base") / "tiny-llama"
    vocab_size = save_tokenizer(directory)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, vocab_size=vocab_size, tie_word_embeddings=True,
                                         rms_norm_eps=1e-5, rope_theta=10000.0))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def root(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The debug data built for the base: tokenized with its tokenizer."""
    root = tmp_path_factory.mktemp("cpt")
    build_dataset(debug_config(root, f"model.init_from={base_dir}"))
    return root


def config(root: Path, base: Path, name: str, *overrides: str) -> Config:
    return debug_config(root, f"model.init_from={base}", f"train.out_dir={root / name}", *COMMON, *overrides)


def train_run(cfg: Config, result: TrainResult):  # noqa: ANN201 (an mlflow Run)
    client = MlflowClient(resolve_tracking_uri(cfg))
    checkpoint = Path(result.checkpoint).resolve()
    [run] = client.search_runs([client.get_experiment_by_name("forgeline-debug").experiment_id],
                               filter_string=f"tags.`forgeline.checkpoint` = '{checkpoint}'")
    return run


def first_step_metrics(cfg: Config, result: TrainResult) -> tuple[float, float]:
    client, run_id = MlflowClient(resolve_tracking_uri(cfg)), train_run(cfg, result).info.run_id
    loss, norm = (min(client.get_metric_history(run_id, key), key=lambda m: m.step).value
                  for key in ("loss", "grad_norm"))
    return loss, norm


@pytest.fixture(scope="module")
def transformers_step0(root: Path, base_dir: Path) -> tuple[float, float]:
    """transformers' loss and gradient norm for the base on the first global batch."""
    cfg = config(root, base_dir, "reference")
    data_dir = Path(cfg.data.out_dir)
    loader = ShardedSampleLoader(split_shards(data_dir, read_manifest(data_dir), "train"),
                                 cfg.train.global_batch_size, 0, 1, cfg.train.seed)
    batch = loader.next_batch()
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    logits = model(batch[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    return loss.item(), torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()


@pytest.fixture(scope="module")
def single(root: Path, base_dir: Path) -> tuple[Config, TrainResult]:
    cfg = config(root, base_dir, "single", "train.steps=4", "checkpoint.every_steps=2")
    return cfg, run_stage(stage_named("train"), cfg)


def test_data_is_tokenized_with_the_base_tokenizer(root: Path, base_dir: Path) -> None:
    tokenizer = read_manifest(root / "data")["tokenizer"]
    assert tokenizer["source_sha256"] == sha256_file(base_dir / "tokenizer.json")


def assert_step0_parity(layout: str, ours: tuple[float, float], theirs: tuple[float, float]) -> None:
    """Loss within 1e-5 and gradient norm within 1e-4 of transformers', relative; the observed
    differences printed (`pytest -s`) for the README."""
    (loss, norm), (hf_loss, hf_norm) = ours, theirs
    print(f"step-0 parity {layout}: loss {loss:.7f} vs {hf_loss:.7f} (rel {abs(loss / hf_loss - 1):.1e}), "
          f"grad norm {norm:.6f} vs {hf_norm:.6f} (rel {abs(norm / hf_norm - 1):.1e})")
    assert loss == pytest.approx(hf_loss, rel=1e-5)
    assert norm == pytest.approx(hf_norm, rel=1e-4)


def test_first_step_matches_transformers_in_one_process(single: tuple[Config, TrainResult],
                                                        transformers_step0: tuple[float, float]) -> None:
    assert_step0_parity("single", first_step_metrics(*single), transformers_step0)


@pytest.mark.parametrize("name", [*LAYOUTS, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW_LAYOUTS)])
def test_first_step_matches_transformers_in_layout(name: str, root: Path, base_dir: Path,
                                                   transformers_step0: tuple[float, float]) -> None:
    cfg = config(root, base_dir, name, "train.steps=1", *(LAYOUTS | SLOW_LAYOUTS)[name])
    result = run_stage(stage_named("train"), cfg)
    assert_step0_parity(name, first_step_metrics(cfg, result), transformers_step0)


def test_the_checkpoints_and_mlflow_record_the_base(single: tuple[Config, TrainResult],
                                                    base_dir: Path) -> None:
    cfg, result = single
    base = read_checkpoint_manifest(Path(result.checkpoint))["base"]
    assert base["uri"] == str(base_dir) and len(base["weights_sha256"]) == 64
    assert result.base == base
    run = train_run(cfg, result)
    assert run.data.tags["forgeline.base"] == str(base_dir)
    assert run.data.tags["forgeline.base_sha256"] == base["weights_sha256"]
    inputs = {i.dataset.name: i.dataset for i in run.inputs.dataset_inputs}
    assert inputs["base-model"].digest == base["weights_sha256"][:32]


def test_a_continued_run_resumes_from_its_own_checkpoint(single: tuple[Config, TrainResult],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A run that died after its step-2 checkpoint continues from it, not from the base again,
    to the same weights."""
    cfg, result = single
    final = Path(result.checkpoint)
    manifest = read_checkpoint_manifest(final)
    shutil.rmtree(final)  # as if it died before its last save
    caplog.set_level("INFO")
    resumed = train_model(cfg)
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "resumed from" in log and "step-00000002" in log
    assert "started from the base" not in log
    assert resumed.step == 4 and resumed.loss == result.loss
    # The tensor data bit-identical (.metadata is DCP's pickled index, not byte-stable).
    data = [{name: sha for name, sha in m["files"].items() if name.endswith(".distcp")}
            for m in (read_checkpoint_manifest(final), manifest)]
    assert data[0] == data[1] and data[0]


def test_a_conflicting_shape_fails_before_launch_naming_both_values(root: Path, base_dir: Path) -> None:
    cfg = config(root, base_dir, "conflict", "model.n_layers=3")
    with pytest.raises(ConfigError, match=r"model.n_layers=3 but the base .* has 2"):
        run_stage(stage_named("train"), cfg)
    assert not (root / "conflict").exists()


def test_data_of_another_tokenizer_is_refused_naming_both_hashes(data_root: Path, base_dir: Path,
                                                                 tmp_path: Path) -> None:
    cfg = debug_config(tmp_path, f"model.init_from={base_dir}", f"data.out_dir={data_root / 'data'}",
                       *COMMON)
    sha = "[0-9a-f]{64}"
    with pytest.raises(ConfigError, match=rf"trained on the corpus \(sha256 {sha}\).*tokenizer sha256 {sha}"):
        train_model(cfg)


def test_the_export_of_a_continued_run_loads_in_transformers_tied(single: tuple[Config, TrainResult],
                                                                   base_dir: Path, tmp_path: Path) -> None:
    """`forgeline checkpoints export --format hf`: transformers loads it with the base's
    tokenizer and architecture, the matrix tied again, logits those of forgeline's checkpoint."""
    from transformers import AutoTokenizer

    from forgeline.flows.cli import main
    from forgeline.model.inference import load_from_checkpoint

    _, result = single
    out = tmp_path / "hf"
    run_config = Path(result.out_dir) / "config.yaml"  # the config the ranks ran with
    assert main(["checkpoints", "export", "4", "--format", "hf", "--out", str(out),
                 "--config", str(run_config)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    assert exported.config.tie_word_embeddings
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "rms_norm_eps"):
        assert getattr(exported.config, key) == getattr(base.config, key), key
    assert exported.config.rope_parameters["rope_theta"] == base.config.rope_parameters["rope_theta"]
    text = "Now is the winter of our discontent, made glorious summer by this sun of York."
    ids = AutoTokenizer.from_pretrained(out)(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == AutoTokenizer.from_pretrained(base_dir)(text).input_ids
    with torch.no_grad():
        ours = load_from_checkpoint(result.checkpoint)(ids)
        assert (exported(ids).logits - ours).abs().max().item() <= 1e-4
        assert (exported(ids).logits - base(ids).logits).abs().max().item() > 1e-3  # it trained


@pytest.mark.slow
def test_a_continued_run_is_evaluated_beside_its_base_and_its_version_serves(
        single: tuple[Config, TrainResult], base_dir: Path, root: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The eval stage evaluates the base too, on the same items: its scores beside the run's
    in metrics.json, report.json and MLflow -- the base's, as lm-eval's own `hf` backend scores
    the base directory --, computed once per base and suite (a second evaluation reads them
    from the cache). The registered version of the continued run serves through its pyfunc
    the greedy continuation forgeline's own generation gives."""
    import json

    import lm_eval
    import pandas as pd

    from forgeline.eval.suite import suite_task_manager
    from forgeline.model.inference import generate_batch, load_from_checkpoint
    from forgeline.tasks import evaluate

    monkeypatch.setenv(CACHE_ENV, str(root / "cache"))
    cfg, trained = single
    cfg = cfg.with_values({"eval.out_dir": str(root / "eval"), "registry.out_dir": str(root / "register")})
    result = run_stage(stage_named("eval"), cfg)
    metrics = json.loads((root / "eval" / "metrics.json").read_text())
    report = json.loads((root / "eval" / "report.json").read_text())
    assert report["base"]["uri"] == str(base_dir)
    assert set(report["base"]["dimensions"]) == set(result.dimensions)
    assert metrics["base/overall"] == report["base"]["overall"] == result.base_overall
    assert metrics["versus_base/overall"] == pytest.approx(result.overall - result.base_overall)
    items = json.loads((root / "eval" / "items.json").read_text())
    assert all(items["base"][task]["ids"] == items["model"][task]["ids"] for task in items["model"])
    assert metrics["base/stderr/overall"] > 0 and metrics["stderr/overall"] > 0
    # The change is paired on the shared items -- all of them -- with its own interval.
    versus = report["versus_base"]
    assert versus["shared_items"] == {task: len(entry["ids"]) for task, entry in items["model"].items()}
    assert metrics["versus_base/stderr/overall"] == versus["overall_stderr"] > 0
    assert "change (paired)" in result.markdown() and "±" in result.markdown()
    bpb = "forgeline_heldout/bits_per_byte"
    assert metrics[bpb] != metrics[f"base/{bpb}"]  # two models, not one twice
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={base_dir},device=cpu,dtype=float32", tasks=["forgeline_heldout"],
        limit=cfg.eval.dimensions["language_modeling"].limit,
        task_manager=suite_task_manager(root / "eval" / "tasks"), bootstrap_iters=0)
    their_bpb = theirs["results"]["forgeline_heldout"]["bits_per_byte,none"]
    assert metrics[f"base/{bpb}"] == pytest.approx(their_bpb, rel=1e-4)
    client = MlflowClient(resolve_tracking_uri(cfg))
    [run] = client.search_runs([client.get_experiment_by_name("forgeline-debug").experiment_id],
                               filter_string=f"tags.`{STAGE_TAG}` = 'eval'")
    assert run.data.metrics["eval/base/overall"] == pytest.approx(result.base_overall)
    [cached] = (root / "cache" / "evals").glob("*.json")

    loads = []
    real_lm = evaluate.ForgelineLM
    monkeypatch.setattr(evaluate, "ForgelineLM", lambda **kwargs: loads.append(kwargs) or real_lm(**kwargs))
    again = evaluate.evaluate_model(cfg)
    # One model loaded: the run's; the base's scores come from the cache.
    assert [set(kwargs) - {"batch_size"} for kwargs in loads] == [{"checkpoint", "tokenizer", "max_length",
                                                                   "precision"}]
    assert again.base_dimensions == result.base_dimensions and cached.is_file()

    registered = run_stage(stage_named("register"), cfg)
    mlflow.set_tracking_uri(resolve_tracking_uri(cfg))
    served = mlflow.pyfunc.load_model(registered.model_uri)
    prompt = "To be, or not to be"
    [text] = served.predict(pd.DataFrame({"prompt": [prompt]}), params={"max_new_tokens": 8})
    tokenizer = PreTrainedTokenizerFast.from_pretrained(base_dir)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        [ours] = generate_batch(load_from_checkpoint(trained.checkpoint), [ids], 8,
                                stop_token=tokenizer.eos_token_id)
    assert text and text == tokenizer.decode(ours, skip_special_tokens=True)


@pytest.mark.slow
def test_a_registered_version_is_a_base_with_its_version_as_lineage(base_dir: Path, root: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The small base registered as register.py registers a model (its Hugging Face directory as
    the pyfunc's `hf` artifact), then trained from as models:/NAME@ALIAS."""
    monkeypatch.setenv(CACHE_ENV, str(root / "cache"))
    cfg = config(root, "models:/tiny-base@champion", "from-registry", "train.steps=1")
    mlflow.set_tracking_uri(resolve_tracking_uri(cfg))
    with mlflow.start_run():
        info = mlflow.pyfunc.log_model(name="model", python_model=HFGenerator(),
                                       artifacts={"hf": str(base_dir)}, pip_requirements=["torch"],
                                       registered_model_name="tiny-base")
    MlflowClient().set_registered_model_alias("tiny-base", "champion", info.registered_model_version)
    result = run_stage(stage_named("train"), cfg)
    version = f"tiny-base/{info.registered_model_version}"
    assert result.base["model_version"] == version and result.base["uri"] == "models:/tiny-base@champion"
    assert Path(result.base["path"]).is_relative_to(root / "cache" / "bases" / "models")
    assert train_run(cfg, result).data.tags["forgeline.parent_model_version"] == version



def register_base(directory: Path, name: str) -> str:
    """`directory` registered as register.py registers a model (the pyfunc's `hf` artifact); its
    version."""
    with mlflow.start_run():
        info = mlflow.pyfunc.log_model(name="model", python_model=HFGenerator(),
                                       artifacts={"hf": str(directory)}, pip_requirements=["torch"],
                                       registered_model_name=name)
    return str(info.registered_model_version)


def last_train_run(cfg: Config):  # noqa: ANN201 (an mlflow Run)
    client = MlflowClient(resolve_tracking_uri(cfg))
    [latest] = client.search_runs([client.get_experiment_by_name("forgeline-debug").experiment_id],
                                  f"tags.`{STAGE_TAG}` = 'train'", max_results=1,
                                  order_by=["attributes.start_time DESC"])
    return latest


@pytest.mark.slow
def test_a_moved_alias_retrains_from_the_new_base_and_an_unmoved_one_is_a_cache_hit(
        base_dir: Path, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """models:/NAME@ALIAS moved to another version -- other weights, the same tokenizer and
    shape, `model.init_from` unchanged: the train stage's cache key holds the weights' sha256, so
    it runs again, and starts from the new base instead of resuming the checkpoints of the old
    one. While the alias stays, the stage is a cache hit."""
    monkeypatch.setenv(CACHE_ENV, str(root / "cache"))
    cfg = config(root, "models:/moving-base@champion", "moving", "train.steps=1")
    mlflow.set_tracking_uri(resolve_tracking_uri(cfg))
    other = tmp_path / "other"
    shutil.copytree(base_dir, other)  # its tokenizer: the data's
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig.from_pretrained(base_dir)).save_pretrained(other)
    first_version, other_version = register_base(base_dir, "moving-base"), register_base(other, "moving-base")
    client = MlflowClient()
    client.set_registered_model_alias("moving-base", "champion", first_version)

    first = run_stage(stage_named("train"), cfg)
    assert first.base["model_version"] == f"moving-base/{first_version}"
    assert last_train_run(cfg).data.tags[CACHE_TAG] == "miss"
    assert run_stage(stage_named("train"), cfg) == first
    assert last_train_run(cfg).data.tags[CACHE_TAG] == "hit"

    client.set_registered_model_alias("moving-base", "champion", other_version)
    caplog.set_level("INFO")
    moved = run_stage(stage_named("train"), cfg)
    tags = last_train_run(cfg).data.tags
    assert tags[CACHE_TAG] == "miss" and tags[f"{CACHE_TAG}.reason"] == "changed: base"
    assert moved.base["model_version"] == f"moving-base/{other_version}"
    assert moved.base["weights_sha256"] == resolve_base(cfg).sha256 != first.base["weights_sha256"]
    assert tags["forgeline.parent_model_version"] == f"moving-base/{other_version}"
    log = "\n".join(record.getMessage() for record in caplog.records)
    assert "started from the base models:/moving-base@champion" in log and "resumed from" not in log
    assert read_checkpoint_manifest(Path(moved.checkpoint))["base"] == moved.base
    assert moved.loss != first.loss  # another model's first step


def test_a_forgeline_checkpoint_is_a_base(single: tuple[Config, TrainResult], root: Path) -> None:
    """A committed step directory of another run: its weights (DCP, each rank its shards), its shape
    and the tokenizer of the data it was trained on. The first loss is the checkpoint's own on the
    first batch."""
    from forgeline.model.inference import load_from_checkpoint

    _, trained = single
    cfg = config(root, Path(trained.checkpoint), "from-checkpoint", "train.steps=1", "parallel.pp=2")
    result = run_stage(stage_named("train"), cfg)
    assert result.base["uri"] == trained.checkpoint and result.base["path"] == trained.checkpoint
    data_dir = Path(cfg.data.out_dir)
    batch = ShardedSampleLoader(split_shards(data_dir, read_manifest(data_dir), "train"),
                                cfg.train.global_batch_size, 0, 1, cfg.train.seed).next_batch()
    with torch.no_grad():
        logits = load_from_checkpoint(trained.checkpoint)(batch[:, :-1])
    expected = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert first_step_metrics(cfg, result)[0] == pytest.approx(expected, rel=1e-5)
