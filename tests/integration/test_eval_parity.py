"""The forgeline backend and lm-eval's own `hf` backend, on the same trained model (exported to
Hugging Face format) and the same task subset, score every item alike: the same per-item
choices and metrics, log-likelihoods within float tolerance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lm_eval
import pytest
import torch
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from forgeline.eval.lm import ForgelineLM
from forgeline.eval.suite import render_suite, suite_task_manager
from forgeline.model.hf import export_hf
from forgeline.model.inference import load_from_checkpoint
from forgeline.tasks.train.job import train_model
from tests.conftest import debug_config

pytestmark = pytest.mark.integration

TASKS = ["forgeline_arc_easy", "forgeline_hellaswag", "forgeline_heldout"]
LIMIT = 12


@pytest.fixture(scope="module")
def exported(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("eval-parity")
    result = train_model(debug_config(root, f"data.out_dir={data_root / 'data'}", "train.steps=40",
                                      "train.peak_tflops=1"))
    return export_hf(load_from_checkpoint(result.checkpoint), data_root / "data" / "tokenizer", root / "hf")


def loglikelihood(response: float | tuple[float, bool]) -> float:
    """A filtered response is the log-likelihood, or (log-likelihood, is_greedy)."""
    return response[0] if isinstance(response, list | tuple) else response


def numbers(results: dict) -> dict[str, float]:
    """The metrics of a task's results (without alias and the "N/A" standard errors)."""
    return {k: v for k, v in results.items() if isinstance(v, int | float)}


def evaluate(task_manager: TaskManager, model: object) -> dict:
    return lm_eval.simple_evaluate(model=model, tasks=TASKS, limit=LIMIT, task_manager=task_manager,
                                   log_samples=True, bootstrap_iters=0)


def test_forgeline_and_hf_backends_agree_item_by_item(exported: Path, data_root: Path,
                                                      tmp_path: Path) -> None:
    task_manager = suite_task_manager(render_suite(tmp_path / "tasks", data_root / "data"))
    ours = evaluate(task_manager, ForgelineLM(hf=str(exported), tokenizer=str(exported), batch_size=4))
    reference = HFLM(pretrained=str(exported), dtype="float32", device="cpu", batch_size=4)
    theirs = evaluate(task_manager, reference)
    for task in TASKS:
        for mine, hf_item in zip(ours["samples"][task], theirs["samples"][task], strict=True):
            assert mine["doc_id"] == hf_item["doc_id"]
            # A log-likelihood per choice; a document's (rolling) is a list of one.
            a = [loglikelihood(x) for x in mine["filtered_resps"]]
            b = [loglikelihood(x) for x in hf_item["filtered_resps"]]
            assert a == pytest.approx(b, rel=1e-6, abs=1e-3)  # rel: float32 sums over whole documents
            assert a.index(max(a)) == b.index(max(b))  # the same answer chosen
        assert numbers(ours["results"][task]) == pytest.approx(numbers(theirs["results"][task]), rel=1e-5)


# Two families whose deltas differ the most from Llama's: Qwen2's q/k/v biases; Gemma 2's head
# width, GeGLU, 1 + w and sandwich norms, scaled embeddings, soft-capping and a sliding window.
FAMILY_BASES = {
    "qwen2": dict(tie_word_embeddings=True),
    "gemma2": dict(head_dim=24, query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=5.0,
                   final_logit_softcapping=10.0, layer_types=["sliding_attention", "full_attention"]),
}


@pytest.mark.parametrize("family", FAMILY_BASES)
def test_a_base_of_another_family_scores_as_lm_evals_hf_backend(family: str, data_root: Path,
                                                                 tmp_path: Path) -> None:
    """A tiny random base of the family, made with transformers with the data's tokenizer: the
    `forgeline` class (the model imported into forgeline's Transformer) and lm-eval's `hf`
    (transformers' own class) give the same per-item log-likelihoods and scores."""
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from tests.unit.test_families import randomize_gains_and_biases

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(data_root / "data" / "tokenizer"))
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.eos_token_id, **FAMILY_BASES[family])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_gains_and_biases(model)
    base = tmp_path / family
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    task_manager = suite_task_manager(render_suite(tmp_path / "tasks", data_root / "data"))
    ours = evaluate(task_manager, ForgelineLM(hf=str(base), tokenizer=str(base), batch_size=4))
    # The tokenizer given, not AutoTokenizer's pick: for a qwen2 directory that is Qwen2Tokenizer,
    # whose own normalizer (NFC) re-tokenizes this Shakespeare-trained BPE's text. A real Qwen
    # base ships that tokenizer in its tokenizer.json, which forgeline reads.
    theirs = evaluate(task_manager, HFLM(pretrained=str(base), tokenizer=tokenizer, dtype="float32",
                                         device="cpu", batch_size=4))
    for task in TASKS:
        for mine, hf_item in zip(ours["samples"][task], theirs["samples"][task], strict=True):
            a = [loglikelihood(x) for x in mine["filtered_resps"]]
            b = [loglikelihood(x) for x in hf_item["filtered_resps"]]
            assert a == pytest.approx(b, rel=1e-5, abs=1e-3)
        assert numbers(ours["results"][task]) == pytest.approx(numbers(theirs["results"][task]), rel=1e-5)


def test_lm_evals_own_command_line_runs_the_forgeline_class_beside_its_own(exported: Path, data_root: Path,
                                                                          tmp_path: Path) -> None:
    """`forgeline lm-eval` adds the `forgeline` model class to lm-eval's own (`hf` here): one
    command line scores the same exported model with either backend, alike."""
    suite = render_suite(tmp_path / "tasks", data_root / "data")
    scores = {}
    for model, model_args in (("forgeline", f"hf={exported},tokenizer={exported}"),
                              ("hf", f"pretrained={exported},dtype=float32")):
        out = tmp_path / model
        subprocess.run([sys.executable, "-m", "forgeline.flows.cli", "lm-eval", "run", "--model", model,
                        "--model_args", model_args, "--device", "cpu", "--batch_size", "4",
                        "--tasks", "forgeline_arc_easy", "--include_path", str(suite), "--limit", "5",
                        "--output_path", str(out)],
                       check=True, cwd=tmp_path, timeout=600)
        (results_file,) = out.rglob("results_*.json")
        results = json.loads(results_file.read_text())
        assert results["config"]["model"] == model
        assert results["n-samples"]["forgeline_arc_easy"]["effective"] == 5
        scores[model] = results["results"]["forgeline_arc_easy"]["acc_norm,none"]
    assert scores["forgeline"] == pytest.approx(scores["hf"]) and 0 <= scores["hf"] <= 1
