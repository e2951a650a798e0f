"""eval.precision: the weights in bf16 while scoring and generating (the rotary tables kept in
fp32), near fp32's scores; refused before any work on a CPU without native bf16; the in-training
evaluation asked in the eval stage's precision."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from forgeline.configs import load_config
from forgeline.configs.schema import LayoutError
from forgeline.eval.lm import ForgelineLM, eval_precision
from forgeline.eval.scores import TaskItems
from forgeline.flows.cli import main
from forgeline.model.checkpoint.manager import MANIFEST_NAME, step_dir_name
from forgeline.model.parallel import mesh
from forgeline.model.parallel.mesh import cpu_has_native_bf16
from forgeline.model.training.callbacks import InTrainingEvalCallback
from forgeline.tasks import compare
from forgeline.tasks.evaluate import EvaluatedItems, preflight_eval, stage_precision
from forgeline.tasks.train.job import preflight_train, rank_config_yaml
from tests.conftest import debug_config, random_lm
from tests.unit.test_eval_lm import request

native_bf16 = pytest.mark.skipif(not cpu_has_native_bf16(),
                                 reason="precision=bf16 is refused on a CPU without native bf16")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bundle")


@pytest.fixture(scope="module")
def fp32(data_root: Path, bundle: Path) -> ForgelineLM:
    return random_lm(data_root / "data" / "tokenizer", bundle, max_seq_len=48, batch_size=4)


@native_bf16
def test_bf16_casts_the_weights_not_the_rotary_tables_and_scores_near_fp32(
        fp32: ForgelineLM, bundle: Path, data_root: Path) -> None:
    bf16 = ForgelineLM(bundle=str(bundle), tokenizer=str(data_root / "data" / "tokenizer"), batch_size=4,
                       precision="bf16")
    assert (fp32.precision, bf16.precision) == ("fp32", "bf16")  # auto: fp32 on the CPU
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert bf16.model.rope.dtype == torch.float32
    choices = [request("loglikelihood", "KING HENRY: Once more unto the breach,", answer)
               for answer in (" dear friends", " once more", " Hal")]
    document = [request("loglikelihood_rolling", "O Romeo, Romeo! wherefore art thou Romeo? " * 6)]
    wide = [score for score, _ in fp32.loglikelihood(choices)] + fp32.loglikelihood_rolling(document)
    narrow = [score for score, _ in bf16.loglikelihood(choices)] + bf16.loglikelihood_rolling(document)
    assert narrow == pytest.approx(wide, rel=5e-3)  # 1e-4 to 6e-4 measured
    assert narrow != wide  # bf16 it was
    # Generation decodes with a cache of the parameters' dtype.
    gen_kwargs = {"until": ["\u2603"], "max_gen_toks": 8}
    [text] = bf16.generate_until([request("generate_until", "ROMEO:", gen_kwargs)])
    assert text


def test_bf16_is_refused_before_any_work_on_a_cpu_without_native_support(
        fp32: ForgelineLM, bundle: Path, data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(mesh, "cpu_has_native_bf16", lambda: False)
    tokenizer = str(data_root / "data" / "tokenizer")
    with pytest.raises(LayoutError, match="precision=bf16 on a CPU without native bf16.* use precision=fp32"):
        ForgelineLM(bundle=str(bundle), tokenizer=tokenizer, precision="bf16")
    with pytest.raises(ValueError, match="precision=fp16: evaluation runs in auto, bf16_where_native, fp32 "
                                         "or bf16"):
        ForgelineLM(bundle=str(bundle), tokenizer=tokenizer, precision="fp16")
    with pytest.raises(LayoutError, match="use eval.precision=fp32"):
        preflight_eval(debug_config(tmp_path, "eval.precision=bf16"))
    preflight_eval(debug_config(tmp_path, "eval.precision=auto"))
    # Training that evaluates as it goes evaluates in it too.
    with pytest.raises(LayoutError, match="use eval.precision=fp32"):
        preflight_train(debug_config(tmp_path, "eval.precision=bf16", "eval.during_training.every_steps=10"))
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert main(["run", "--set", "eval.precision=bf16"]) == 2
    assert "use eval.precision=fp32" in capsys.readouterr().err
    assert list(empty.iterdir()) == []


def test_the_in_training_evaluation_scores_in_the_eval_stages_precision(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = debug_config(tmp_path, "eval.precision=bf16")
    assert "precision" not in yaml.safe_load(rank_config_yaml(cfg))["eval"]  # no input of training then
    in_training = debug_config(tmp_path, "eval.precision=bf16", "eval.during_training.every_steps=10")
    assert yaml.safe_load(rank_config_yaml(in_training))["eval"]["precision"] == "bf16"
    checkpoint = tmp_path / "checkpoints" / step_dir_name(10)
    checkpoint.mkdir(parents=True)
    (checkpoint / MANIFEST_NAME).write_text("{}")  # committed
    started: list[list[str]] = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **_: started.append(cmd))
    callback = InTrainingEvalCallback(in_training.eval.during_training, checkpoint.parent, tmp_path, "run", 8,
                                      {}, {}, in_training.eval.precision)
    callback._queue.append(10)
    callback._start_next()
    [cmd] = started
    assert cmd[cmd.index("--precision") + 1] == "bf16"


def test_runs_scored_in_another_precision_are_not_compared_item_by_item(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plan = {"language_modeling": {"tasks": ["forgeline_heldout"], "limit": 2, "num_fewshot": 0}}
    items = {"forgeline_heldout": TaskItems(ids=["a", "b"], values=[[-9.0, 4], [-7.0, 3]])}
    runs = {"fp32-run": EvaluatedItems("suite", plan, items, 512, "fp32"),
            "bf16-run": EvaluatedItems("suite", plan, items, 512, "bf16")}
    monkeypatch.setattr(compare, "logged_items", lambda client, run_id: runs[run_id])
    assert compare.paired_against_first(None, ["fp32-run", "bf16-run"]) == (
        "bf16-run - fp32-run: not paired, scored in bf16 and fp32: the same item may be scored differently")


@pytest.mark.parametrize("native", [True, False])
def test_bf16_where_native_is_bf16_on_a_cpu_that_has_it_and_fp32_on_one_that_has_not(
        native: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The shipped SmolLM2 configs' precision: refused before any work (exit 2, `use
    eval.precision=fp32`) on a CPU without native bf16 when it was `bf16`."""
    monkeypatch.setattr(mesh, "cpu_has_native_bf16", lambda: native)
    cfg = load_config("smollm2-sft.yaml")
    assert cfg.eval.precision == "bf16_where_native"
    with caplog.at_level(logging.INFO, logger="forgeline"):
        preflight_eval(cfg)
    expected = "bf16" if native else "fp32"
    assert stage_precision(cfg.eval) == expected
    assert f"eval.precision=bf16_where_native: {expected}, as this CPU has" in caplog.text
    if not native:  # plain bf16 is still refused where it would crawl
        with pytest.raises(LayoutError, match="eval.precision=bf16 on a CPU without native bf16"):
            eval_precision("bf16", "cpu", "eval.precision")
